"""The operator's public words for what went wrong.

They appear in `status.restartHistory[].reason`, as Event reasons, in the `reason` label of
`rlhf_operator_restarts_total` and friends, and in the README's failure table; renaming one
breaks dashboards and alerts, so each is spelt once, here.
"""

from __future__ import annotations

from enum import StrEnum


class RestartReason(StrEnum):
    """Why the operator climbed the recovery ladder (design decision 5)."""

    TRAINER_FAILED = "TrainerFailed"
    """The Ray job FAILED or was STOPPED by someone else: the driver is gone."""
    TRAINER_POD_LOST = "TrainerPodLost"
    """As TrainerFailed, with a trainer pod missing at that moment."""
    TRAINER_HUNG = "TrainerHung"
    """No heartbeat within `heartbeatTimeoutSeconds` (or none at all since it started)."""
    TRAINER_STALLED = "TrainerStalled"
    """Heartbeats continue but the step has not moved for `progressTimeoutSeconds`."""
    HEAD_LOST = "HeadLost"
    """The Ray head (and with it every job and actor) is gone."""
    CLUSTER_UNHEALTHY = "ClusterUnhealthy"
    """The RayCluster or its dashboard stayed unhealthy past `clusterRecoveryTimeoutSeconds`."""
    TRAINER_RESIZED = "TrainerResized"
    """Not a failure: an elastic trainer running on fewer replicas had every pod back, so it
    checkpointed its step and restarted on all of them. It counts against no budget."""


class FailureReason(StrEnum):
    """Why a job ended Failed (the `Failed` condition's reason and its Event)."""

    NON_RETRYABLE = "NonRetryableError"
    RESTARTS_EXHAUSTED = "RestartsExhausted"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    PROVISIONING_TIMEOUT = "ProvisioningTimeout"
    """The RayCluster was not ready within `provisioningTimeoutSeconds` (the cause is quoted)."""
    INVALID_SPEC = "InvalidSpec"
    CLUSTER_REJECTED = "ClusterRejected"
    """The API server (HTTP 400/422) or KubeRay's validation refused an object the job needs:
    the same spec would be refused again, so the job fails at once, quoting the refusal."""
    POD_CREATION_FAILED = "PodCreationFailed"
    """KubeRay could not create the Ray pods for a reason that does not pass (Pod Security, an
    invalid pod), for longer than a short grace."""


class EventReason(StrEnum):
    """The other reasons of the job's Events and conditions: its progress, not its failures."""

    PROVISIONING = "Provisioning"
    SUBMITTED = "Submitted"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    """Training resumed after a restart, or the job after `spec.suspend` was cleared."""
    DEGRADED = "Degraded"
    """An elastic role runs below its replica count (the condition's reason: BelowReplicas)."""
    REPLICAS_RESTORED = "ReplicasRestored"
    BELOW_REPLICAS = "BelowReplicas"
    ALL_REPLICAS = "AllReplicas"
    DRAINING = "Draining"
    """The trainer was asked to checkpoint its step and stop before its cluster is released."""
    DRAINED = "Drained"
    """It did (or no step was under way): the cluster is released, the checkpoint kept."""
    DRAIN_TIMED_OUT = "DrainTimedOut"
    """It did not stop within `checkpoint.stopGracePeriodSeconds`: released anyway."""
    NODE_DRAINED = "NodeDrained"
    """A trainer pod's node is being drained: the job checkpoints and moves off it."""
    RESIZING = "Resizing"
    """An elastic trainer below its replicas has every pod back: it checkpoints its step and
    stops, then restarts on all of them (the Draining condition's reason)."""
    QUEUED = "Queued"
    """The job waits in its Kueue LocalQueue; no pod exists before Kueue admits it."""
    ADMITTED = "Admitted"
    """Kueue admitted the whole job (every role's pods fit the quota)."""
    PREEMPTED = "Preempted"
    """Kueue evicted the job (a preemption): it drains, then gives its quota back."""
    QUOTA_RELEASED = "QuotaReleased"
    """Every pod of a stopped job is gone: its Kueue quota went back to the queue."""
    EVALUATED = "Evaluated"
    """The trainer scored the held-out set (`spec.evaluation`); the status has the figures."""
    EXPORTED = "Exported"
    """The trained policy was written as a Hugging Face directory (`spec.export`)."""
    TRACKING_UNAVAILABLE = "TrackingUnavailable"
    """An experiment tracker did not take the run's metrics; training goes on."""
    OPERATOR_OUTDATED = "OperatorOutdated"
    """The job has fields this operator does not know (its CRD is newer): it is left as it is,
    running or not, until the operator is upgraded."""


class DrainCause(StrEnum):
    """Why a job drains: its trainer checkpoints its step and stops before the cluster goes.

    A drain is a state of the job, held in the `Draining` condition (status True while under
    way, the cause its reason, so these values are its wire form); what follows the release
    depends on the cause alone.
    """

    SUSPEND = EventReason.DRAINING.value
    """`spec.suspend` became true: the job ends Suspended, its checkpoints kept."""
    PREEMPTION = EventReason.PREEMPTED.value
    """Kueue evicted the job: it gives its quota back and is queued again."""
    NODE_DRAIN = EventReason.NODE_DRAINED.value
    """A trainer pod's node is being drained: a new cluster, off that node, resumes."""
    RESIZE = EventReason.RESIZING.value
    """An elastic trainer has every pod back: it restarts on all of them, the cluster kept."""

    @classmethod
    def of(cls, reason: str) -> DrainCause | None:
        """The cause a `Draining` condition's reason names; None for a reason no operator
        of this version writes (a hand edit): not a drain it started, so none it must end."""
        try:
            return cls(reason)
        except ValueError:
            return None
