"""What one run takes from its process, read once: the `RunContext`.

The driver builds it at its start from the pod environment (`rlhfjob.contract.PodEnv`, which the
operator writes), the trainer's own settings (``$RLHF_*`` below, ``$RAY_ADDRESS``) and the
command line, and passes it down; nothing later reads the environment for itself. A run
outside the operator has no job name, namespace or attempt: the defaults.

This module imports only the standard library and `rlhfjob` (the driver uses it before Ray).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rlhf_trainer.ranks.adoption import DEFAULT_ADOPT_TIMEOUT_S, adoption_timeout_s, namespace_of
from rlhfjob import contract
from rlhfjob.api import ENV_TRAINER_METRICS_PORT, RLHFJob, RLHFJobSpec, actor_slots

ENV_METRICS_PORT = ENV_TRAINER_METRICS_PORT
"""Port of the driver's Prometheus endpoint (unset: no endpoint); the operator sets it."""
ENV_ACTOR_LOGS = "RLHF_ACTOR_LOGS"
"""Set to 1 to forward the actors' own logs (DeepSpeed's, mostly) to the driver's output."""
ENV_RAY_ADDRESS = "RAY_ADDRESS"
"""Ray's own variable: the cluster to join (unset: the driver starts a local Ray)."""


@dataclass(frozen=True)
class RunContext:
    """One driver's facts about its run that the job file does not hold."""

    job_name: str | None = None
    """The RLHFJob's name under the operator (it names the heartbeat Lease); None locally."""
    job_namespace: str | None = None
    attempt: int = 0
    """Which restart this driver is (0 first); the Lease and the step log carry it."""
    job_config: str | None = None
    """The job file: ``--config``, else ``$RLHF_JOB_CONFIG``."""
    resume_from: str | None = None
    """``--resume-from``: a checkpoint directory, ``latest``, or None (start at step 0)."""
    metrics_port: int | None = None
    """``--metrics-port``, else ``$RLHF_TRAINER_METRICS_PORT``; None: no endpoint."""
    ray_address: str | None = None
    actor_logs: bool = False
    adopt_timeout_s: float = DEFAULT_ADOPT_TIMEOUT_S
    """How long a previous attempt's actors have to answer (``$RLHF_ADOPT_TIMEOUT_S``)."""
    trainer_replicas: int | None = None
    """``$RLHF_TRAINER_REPLICAS``: the trainer replicas an elastic restart trains with (the
    operator sets it below `roles.trainer.replicas`); None: the spec's."""
    zero_ranks: Mapping[str, int] = field(default_factory=dict)
    """Ranks of a ZeRO-3 role (``trainer``, ``reference``, ``critic``) that replace the spec's
    count, whatever `trainer_replicas` says: a run started in-process with other ranks (tests,
    tools). A role left out runs the spec's count. The global batch does not depend on it
    (`rlhf_trainer.algo.batch.ShardPlan`), and checkpoints load into any count
    (`rlhf_trainer.state.reshard`)."""

    def __post_init__(self) -> None:
        bad = {role: ranks for role, ranks in self.zero_ranks.items() if ranks < 1}
        if self.trainer_replicas is not None and self.trainer_replicas < 1:
            bad["trainer replicas"] = self.trainer_replicas
        if bad:
            raise ValueError(f"a ZeRO-3 role needs at least one rank: {bad}")

    def zero_ranks_for(self, spec: RLHFJobSpec) -> dict[str, int]:
        """The ranks of each ZeRO-3 role that differ from the spec's: `zero_ranks`, and the
        trainer's from `trainer_replicas` (replicas x actors per replica) unless given."""
        ranks = dict(self.zero_ranks)
        if self.trainer_replicas is not None:
            ranks.setdefault("trainer", self.trainer_replicas * actor_slots(spec.roles.trainer))
        return ranks

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str],
        *,
        config: str | None = None,
        resume_from: str | None = None,
        metrics_port: int | None = None,
    ) -> RunContext:
        """The context of a driver in `environ`; the command line's values win over it."""
        pod = contract.PodEnv.from_env(environ)
        port = environ.get(ENV_METRICS_PORT)  # strict: a port that is no number is a mistake
        return cls(
            job_name=pod.job_name,
            job_namespace=pod.job_namespace,
            attempt=pod.attempt or 0,
            job_config=config or pod.job_config,
            resume_from=resume_from,
            metrics_port=metrics_port if metrics_port is not None else int(port) if port else None,
            ray_address=environ.get(ENV_RAY_ADDRESS) or None,
            actor_logs=environ.get(ENV_ACTOR_LOGS) == "1",
            adopt_timeout_s=adoption_timeout_s(environ),
            trainer_replicas=pod.trainer_replicas,
        )

    def ray_namespace(self, job: RLHFJob) -> str:
        """The Ray namespace of this job and spec (`rlhf_trainer.ranks.adoption.ray_namespace`)."""
        return namespace_of(job, self.job_name, self.job_namespace)
