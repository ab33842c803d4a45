"""The environment the operator gives the Ray pods and the trainer driver.

The builder writes it into every pod template, the reconciler into every Ray job submission, and
the trainer reads it back: one type, so the names cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

# The names live with the API, whose rules keep a job's own variables off them.
from rlhfjob.api import (
    ENV_ATTEMPT,
    ENV_JOB_CONFIG,
    ENV_JOB_NAME,
    ENV_JOB_NAMESPACE,
    ENV_ROLE,
    ENV_TRAINER_METRICS_PORT,
    ENV_TRAINER_REPLICAS,
)

TRAINER_METRICS_PORT = 9400
"""The head's port of the trainer driver's `/metrics` (the chart's PodMonitor scrapes it)."""
TRAINER_METRICS_PORT_NAME = "trainer-metrics"

_NAMES = {
    "job_name": ENV_JOB_NAME,
    "job_namespace": ENV_JOB_NAMESPACE,
    "role": ENV_ROLE,
    "job_config": ENV_JOB_CONFIG,
    "attempt": ENV_ATTEMPT,
    "metrics_port": ENV_TRAINER_METRICS_PORT,
    "trainer_replicas": ENV_TRAINER_REPLICAS,
}


@dataclass(frozen=True)
class PodEnv:
    """What a pod or driver is told about its job; a field left as None is not set."""

    job_name: str | None = None
    job_namespace: str | None = None
    role: str | None = None
    """The pod's role (``head`` or a worker group); only pods have one."""
    job_config: str | None = None
    attempt: int | None = None
    """Only Ray job submissions carry it: pods outlive attempts."""
    metrics_port: int | None = None
    """Where the trainer driver serves its metrics; only the head, where the driver runs."""
    trainer_replicas: int | None = None
    """Only Ray job submissions of an elastic trainer below its replicas carry it: the trainer
    replicas this driver trains with."""

    def to_env(self) -> dict[str, str]:
        """The variables, in field order (manifests stay byte-identical)."""
        values = ((_NAMES[f.name], getattr(self, f.name)) for f in fields(self))
        return {name: str(value) for name, value in values if value is not None}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PodEnv:
        """Read it back; unset or empty is None, and an unreadable number counts as unset."""
        found = {field: environ.get(name) or None for field, name in _NAMES.items()}

        def number(field: str) -> int | None:
            text = found.pop(field)
            return int(text) if text and text.isdigit() else None

        return cls(
            attempt=number("attempt"),
            metrics_port=number("metrics_port"),
            trainer_replicas=number("trainer_replicas"),
            **found,
        )
