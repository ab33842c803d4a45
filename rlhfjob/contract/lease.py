"""The heartbeat Lease report (design decision 4): what the trainer tells the operator.

The trainer driver writes a `LeaseReport` into the annotations of a Lease named after the job
(`to_annotations`); the operator reads it back (`from_annotations`). Each field names its
annotation and its codec once, here, so a new field is one line plus its round-trip test. Decoding
is lenient both ways: a key the reader does not know is ignored (a newer trainer), a missing or
unreadable one is None (an older trainer, a hand edit), never an error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any, NamedTuple

from rlhfjob.api import GROUP

LEASE_STEP = f"{GROUP}/step"
LEASE_TOTAL_STEPS = f"{GROUP}/total-steps"
LEASE_CHECKPOINT_STEP = f"{GROUP}/checkpoint-step"
LEASE_CHECKPOINT_PATH = f"{GROUP}/checkpoint-path"
LEASE_PHASE = f"{GROUP}/phase"
"""What the driver is doing: a step's phase (`generate`, `update`, ...), or one of these two."""
PHASE_STARTING = "starting"
"""Booting its actors, before the first step."""
PHASE_EXITING = "exiting"
"""Done (trained, drained or failed): drawing its curve, taking its actors down, then leaving.
Ray's verdict on the job follows; the operator gives it `EXIT_GRACE_SECONDS` beyond the
heartbeat timeout before it calls the driver hung."""
EXIT_GRACE_SECONDS = 60
LEASE_ATTEMPT = f"{GROUP}/attempt"
LEASE_STEP_TIME = f"{GROUP}/step-time"
"""RFC 3339 time at which `step` last advanced: the operator's evidence of progress."""
LEASE_ROLLOUT_ENGINES = f"{GROUP}/rollout-engines"
"""`<live>/<desired>` rollout engines the trainer generates with (elastic roles, decision 5)."""
LEASE_REWARD_MODELS = f"{GROUP}/reward-models"
"""`<live>/<desired>` reward-model replicas the trainer scores with (an elastic role too)."""
LEASE_REWARD_MEAN = f"{GROUP}/reward-mean"
"""Mean reward of the last step (a decimal number): the job's status shows it."""
LEASE_TOKENS_PER_SECOND = f"{GROUP}/tokens-per-second"
"""Generation throughput of the last step's rollout, in tokens per second."""
LEASE_CHECKPOINT_REQUESTED_AT = f"{GROUP}/checkpoint-requested-at"
"""When the trainer saw a request to checkpoint now (preemption): its acknowledgement."""
LEASE_CHECKPOINT_SAVED_STEP = f"{GROUP}/checkpoint-saved-step"
"""The step of the checkpoint it saved in answer: after that the pods may go."""
LEASE_STOP_REQUESTED_AT = f"{GROUP}/stop-requested-at"
"""The one annotation the operator writes (RFC 3339): "finish your step, checkpoint it and exit"
(a drain before the cluster is released). The trainer sees it at its next renewal, answers in
`checkpoint-requested-at` with the same time, and ignores a request it (or an earlier driver)
already answered; the operator removes it when the drain ends."""


def format_time(moment: datetime) -> str:
    """RFC 3339 in UTC with a ``Z`` suffix, the form Kubernetes writes."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: str | None) -> datetime | None:
    """The inverse of `format_time`; also reads Kubernetes' own timestamps."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


class EngineCount(NamedTuple):
    """Live and desired members of an elastic role (rollout engines, reward models); on the wire
    ``<live>/<desired>``."""

    live: int
    desired: int

    def __str__(self) -> str:
        return f"{self.live}/{self.desired}"

    @classmethod
    def parse(cls, value: str) -> EngineCount:
        live, _, desired = value.partition("/")
        return cls(int(live), int(desired))


@dataclass(frozen=True)
class _Codec:
    encode: Callable[[Any], str]
    decode: Callable[[str], Any]


_INT = _Codec(str, int)
_FLOAT = _Codec(lambda value: f"{value:.6g}", float)
_TEXT = _Codec(str, str)
_TIME = _Codec(format_time, parse_time)
_ENGINES = _Codec(str, EngineCount.parse)


def _wire(key: str, codec: _Codec) -> dict[str, Any]:
    """A field's annotation and how its value is written there."""
    return {"key": key, "codec": codec}


@dataclass(frozen=True, kw_only=True)
class LeaseReport:
    """The trainer's progress as the Lease carries it; None fields are not written."""

    step: int | None = field(default=None, metadata=_wire(LEASE_STEP, _INT))
    """Last completed training step."""
    step_changed: datetime | None = field(default=None, metadata=_wire(LEASE_STEP_TIME, _TIME))
    """When `step` was first reported with its current value (stalled versus slow)."""
    total_steps: int | None = field(default=None, metadata=_wire(LEASE_TOTAL_STEPS, _INT))
    phase: str | None = field(default=None, metadata=_wire(LEASE_PHASE, _TEXT))
    """What the trainer is doing now (``generate``, ``update``, ...)."""
    checkpoint_step: int | None = field(default=None, metadata=_wire(LEASE_CHECKPOINT_STEP, _INT))
    checkpoint_path: str | None = field(default=None, metadata=_wire(LEASE_CHECKPOINT_PATH, _TEXT))
    attempt: int | None = field(default=None, metadata=_wire(LEASE_ATTEMPT, _INT))
    """Which restart wrote it, so the operator ignores a stale writer."""
    rollout_engines: EngineCount | None = field(
        default=None, metadata=_wire(LEASE_ROLLOUT_ENGINES, _ENGINES)
    )
    reward_models: EngineCount | None = field(
        default=None, metadata=_wire(LEASE_REWARD_MODELS, _ENGINES)
    )
    reward_mean: float | None = field(default=None, metadata=_wire(LEASE_REWARD_MEAN, _FLOAT))
    """Mean reward of the last step."""
    tokens_per_second: float | None = field(
        default=None, metadata=_wire(LEASE_TOKENS_PER_SECOND, _FLOAT)
    )
    """Generation throughput of the last step's rollout."""
    checkpoint_requested_at: datetime | None = field(
        default=None, metadata=_wire(LEASE_CHECKPOINT_REQUESTED_AT, _TIME)
    )
    checkpoint_saved_step: int | None = field(
        default=None, metadata=_wire(LEASE_CHECKPOINT_SAVED_STEP, _INT)
    )

    def __post_init__(self) -> None:
        for name in ("rollout_engines", "reward_models"):  # "1/2" and (1, 2) are accepted too
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, EngineCount.parse(value))
            elif isinstance(value, tuple) and not isinstance(value, EngineCount):
                object.__setattr__(self, name, EngineCount(*value))

    @classmethod
    def key(cls, name: str) -> str:
        """The annotation of field `name`."""
        return str(next(f for f in fields(cls) if f.name == name).metadata["key"])

    def to_annotations(self) -> dict[str, str]:
        encoded = {}
        for f in fields(LeaseReport):
            value = getattr(self, f.name)
            if value is not None:
                encoded[f.metadata["key"]] = f.metadata["codec"].encode(value)
        return encoded

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, str]) -> LeaseReport:
        decoded: dict[str, Any] = {}
        for f in fields(LeaseReport):
            text = annotations.get(f.metadata["key"])
            if text is None:
                continue
            with contextlib.suppress(ValueError):  # unreadable counts as missing
                decoded[f.name] = f.metadata["codec"].decode(text)
        return LeaseReport(**decoded)

    def updated(self, **changes: Any) -> LeaseReport:
        """A copy with `changes` (field names) applied; a change of None keeps the field."""
        return replace(self, **{name: v for name, v in changes.items() if v is not None})
