"""The status the operator writes (phase, conditions, progress, restarts) and `RLHFJob`, the
whole object.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)
from pydantic.alias_generators import to_camel

from rlhfjob.api.base import (
    API_VERSION,
    KIND,
    MAX_NAME_LENGTH,
    MAX_SPEC_BYTES,
    NAME_PATTERN,
    ApiModel,
    size_error,
)
from rlhfjob.api.training import RLHFJobSpec


class Phase(StrEnum):
    PENDING = "Pending"
    PROVISIONING = "Provisioning"
    RUNNING = "Running"
    RECOVERING = "Recovering"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"

    @property
    def terminal(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


class ConditionType(StrEnum):
    """The conditions the operator keeps on a job, one of each at most."""

    CLUSTER_READY = "ClusterReady"
    DASHBOARD_REACHABLE = "DashboardReachable"
    TRAINER_RUNNING = "TrainerRunning"
    HEALTHY = "Healthy"
    DEGRADED = "Degraded"
    DRAINING = "Draining"
    ADMITTED = "Admitted"
    SUSPENDED = "Suspended"
    COMPLETE = "Complete"
    FAILED = "Failed"


class Condition(ApiModel):
    """A Kubernetes-style condition: the latest observation of one aspect of the job."""

    model_config = ConfigDict(strict=False)  # timestamps arrive as text

    type: str = Field(
        max_length=316,
        description="What the condition is about: " + ", ".join(ConditionType) + ".",
    )
    status: Literal["True", "False", "Unknown"]
    """Whether it holds: True, False or Unknown."""
    reason: str = Field(default="", max_length=1024)
    """Why, in one CamelCase word (for example Ready, Unschedulable, TrainerHung)."""
    message: str = Field(default="", max_length=32768)
    """Why, for humans."""
    last_transition_time: datetime | None = None
    """When status last changed (RFC 3339)."""
    observed_generation: int | None = None
    """The job's metadata.generation when the condition was set."""


class CheckpointRef(ApiModel):
    """A complete checkpoint the trainer reported in its heartbeat."""

    model_config = ConfigDict(strict=False)  # timestamps arrive as text
    step: int
    """The training step it holds: a resumed run continues after it."""
    path: str
    """Its directory on the checkpoint volume."""
    time: datetime | None = None
    """When the operator first saw it reported (RFC 3339)."""


class EvaluationResult(ApiModel):
    """The latest held-out evaluation the trainer reported (`spec.evaluation`)."""

    model_config = ConfigDict(strict=False)  # timestamps arrive as text
    step: int
    """The training step it evaluated (0: before the first)."""
    score: float | None = None
    """Mean reward of the greedy responses."""
    accuracy: float | None = None
    """Fraction of prompts whose greedy response passed (reward >= passThreshold)."""
    pass_at_k: float | None = None
    """Fraction of prompts with a passing response among `samples` sampled ones."""
    time: datetime | None = None
    """When the operator first saw it reported (RFC 3339)."""


class ExportRef(ApiModel):
    """The trained policy exported as a Hugging Face directory (`spec.export`)."""

    model_config = ConfigDict(strict=False)  # timestamps arrive as text
    step: int
    """The training step it holds."""
    path: str
    """Its directory on the checkpoint volume (or its bucket URL, once uploaded)."""
    time: datetime | None = None
    """When the operator first saw it reported (RFC 3339)."""


class Progress(ApiModel):
    """How fast the job trains and when it should end, from the trainer's heartbeat."""

    model_config = ConfigDict(strict=False)  # timestamps arrive as text

    steps_per_second: float | None = None
    """Training steps per second: a moving average over the steps the operator saw advance
    (time between attempts, a restart's, is left out)."""
    eta: datetime | None = None
    """When the last step should finish at that rate (RFC 3339)."""
    reward_mean: float | None = None
    """Mean reward of the last step the trainer reported."""
    tokens_per_second: float | None = None
    """Generation throughput of the last step's rollout, in tokens per second."""
    step_time: datetime | None = None
    """When the trainer reported status.currentStep: the next rate is measured from it."""


class RestartRecord(ApiModel):
    """One climb of the recovery ladder: why, from which checkpoint, and how fast."""

    model_config = ConfigDict(strict=False)  # timestamps arrive as text

    time: datetime
    """When the operator decided to restart (RFC 3339)."""
    reason: str
    """Why, as a restart reason: for example TrainerFailed, TrainerHung, HeadLost."""
    message: str = ""
    """What the operator saw, for humans."""
    resumed_from_step: int | None = None
    """The checkpoint's step the restart resumed from; unset: there was none (step 0)."""
    detection_seconds: float | None = None
    """Seconds from the trainer's last sign of life (its exit, its last heartbeat, the head's
    last Ready) to the operator's decision."""
    resumed_time: datetime | None = None
    """When the restarted trainer first finished a step past its checkpoint (RFC 3339)."""

    @property
    def failure_time(self) -> datetime:
        """When the failure happened, as far as the operator can tell."""
        return self.time - timedelta(seconds=self.detection_seconds or 0)


MAX_RESTART_HISTORY = 20


class RLHFJobStatus(ApiModel):
    """What the operator last observed. Written only by the operator."""

    model_config = ConfigDict(strict=False)  # timestamps arrive as text

    phase: Phase = Phase.PENDING
    """Pending: accepted, no cluster yet (or resuming after a suspend). Provisioning: the
    RayCluster is being created and its pods started. Running: the trainer runs. Recovering:
    a failure was detected and the job climbs the recovery ladder. Suspended: spec.suspend is
    set, the cluster is released, checkpoints stay. Succeeded and Failed are terminal: the
    cluster is released and the phase never changes again."""
    conditions: list[Condition] = Field(default_factory=list, max_length=32)
    """The latest observation of each aspect of the job, one entry per type."""
    observed_generation: int | None = None
    """The metadata.generation the operator last acted on; behind metadata.generation while a
    change of the spec is not applied yet."""
    current_step: int | None = None
    """The last training step the trainer finished (from its heartbeat)."""
    total_steps: int | None = None
    """Training steps of the whole run: spec.algorithm.totalSteps, or what the trainer computed
    from epochs."""
    last_checkpoint: CheckpointRef | None = None
    evaluation: EvaluationResult | None = None
    """The latest held-out evaluation (`spec.evaluation`)."""
    export: ExportRef | None = None
    """Where the trained policy was exported (`spec.export`)."""
    tracking_failures: int = 0
    """Calls to experiment trackers the trainer gave up so far (`spec.tracking`); never fatal."""
    """The newest complete checkpoint; a restart resumes from it."""
    progress: Progress | None = None
    """Steps per second, the estimated end and the latest reward (from the heartbeat)."""
    trainer_replicas: int | None = None
    """Trainer replicas the running trainer trains with, when an elastic trainer runs below
    roles.trainer.replicas (the job is then Degraded); unset: all of them."""
    trainer_short_since: datetime | None = None
    """Since when fewer trainer pods than the trainer needs have been Ready (RFC 3339): an
    elastic trainer's replacement timeout counts from it."""
    resizes: int = 0
    """Times the trainer was restarted on a different number of replicas (not failures: they
    count against no restart budget)."""
    restart_count: int = 0
    """Restarts so far; the job fails (RestartsExhausted) when one more would exceed
    spec.recovery.maxRestarts."""
    restart_history: list[RestartRecord] = Field(
        default_factory=list, max_length=MAX_RESTART_HISTORY
    )
    """The most recent restarts, oldest first."""
    last_heartbeat_time: datetime | None = None
    """When the trainer last renewed its heartbeat Lease (RFC 3339)."""
    submission_id: str | None = None
    """The Ray job of the current attempt, once submitted."""
    ray_cluster_name: str | None = None
    """The RayCluster the operator created for the job."""
    dashboard_url: str | None = None
    """The Ray dashboard of the job's cluster; only the job's pods and the operator may reach
    it."""
    start_time: datetime | None = None
    """When the operator started the job: first created its RayCluster (RFC 3339)."""
    completion_time: datetime | None = None
    """When the job became Succeeded or Failed (RFC 3339)."""
    message: str = ""
    """What is happening, for humans."""


class ObjectMeta(BaseModel):
    """The parts of metadata the platform reads; the rest passes through untouched."""

    model_config = ConfigDict(
        extra="allow",
        populate_by_name=True,
        alias_generator=to_camel,
        use_attribute_docstrings=True,
    )

    name: str = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=NAME_PATTERN,
        description=f"The job's name: a DNS-1035 label of at most {MAX_NAME_LENGTH} characters, "
        "since it names the RayCluster and, with a suffix, every object made for the job.",
    )
    namespace: str = "default"
    """Where the job and everything made for it live."""
    uid: str | None = None
    """Set by the API server; the objects made for the job are owned through it."""
    generation: int | None = None
    """Set by the API server; counts changes of the spec."""
    labels: dict[str, str] = Field(default_factory=dict)
    """The job's own labels; the Ray pods do not inherit them."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """The job's own annotations."""


class RLHFJob(ApiModel):
    """A whole RLHFJob object as stored by the API server (or written in a file)."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["rlhf.dev/v1alpha1"] = API_VERSION  # type: ignore[assignment]
    """The API group and version."""
    kind: Literal["RLHFJob"] = KIND  # type: ignore[assignment]
    """The kind of object."""
    metadata: ObjectMeta
    spec: RLHFJobSpec
    status: RLHFJobStatus | None = None

    @model_validator(mode="before")
    @classmethod
    def _bounded_spec(cls, data: Any) -> Any:
        """A spec above `MAX_SPEC_BYTES` is refused before any of it is validated: the cost of
        validating (and of everything the operator does with a job) grows with its size."""
        spec = data.get("spec") if isinstance(data, dict) else None
        if spec is not None and (
            error := size_error("spec", spec, MAX_SPEC_BYTES, "large env values or randomInit")
        ):
            raise error
        return data
