"""What a plan says to do: the actions, Events and next status `decide` returns (decision 2).

The reconciler carries a `Plan` out: each action is one idempotent call to Kubernetes, Ray or
Kueue. Also the names the steps write into conditions, so that tests and the reconciler read
the same words.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from rlhfjob.api import ConditionType, RLHFJobStatus
from rlhfjob.contract import FailureReason

TRAINER = "trainer"
"""The trainer's role (its worker group's name)."""


@dataclass(frozen=True)
class ApplyCluster:
    """Server-side apply the RayCluster, its ConfigMap and the trainer's RBAC."""


@dataclass(frozen=True)
class DeleteCluster:
    reason: str


@dataclass(frozen=True)
class SubmitRayJob:
    submission_id: str
    resume: bool
    trainer_replicas: int | None = None
    """An elastic trainer started on fewer replicas than the spec's; None: all."""


@dataclass(frozen=True)
class StopRayJob:
    submission_id: str


@dataclass(frozen=True)
class DeleteJob:
    """ttlSecondsAfterFinished has passed: delete the RLHFJob (checkpoints stay)."""


@dataclass(frozen=True)
class RequestStop:
    """Ask the trainer, through its Lease, to checkpoint its step and exit (a drain)."""

    at: datetime


@dataclass(frozen=True)
class ClearStopRequest:
    """The drain is over: take the request off the Lease, so no later driver obeys it."""


@dataclass(frozen=True)
class ApplyWorkload:
    """Create the queued job's Kueue Workload: its pod sets, queue and priority."""


@dataclass(frozen=True)
class SetWorkloadActive:
    """`spec.suspend` changed: Kueue keeps an inactive Workload out of its queue."""

    active: bool


@dataclass(frozen=True)
class ReleaseQuota:
    """Every pod of the job is gone: clear the Workload's quota reservation (Kueue requeues an
    evicted Workload, so the job runs again when it fits)."""


@dataclass(frozen=True)
class SetPodsReady:
    """Tell Kueue whether every group of the admitted job is ready (its `waitForPodsReady`)."""

    ready: bool


@dataclass(frozen=True)
class FinishWorkload:
    """The job ended and its pods are gone: Kueue frees the quota for good."""

    succeeded: bool
    message: str


Action = (
    ApplyCluster
    | DeleteCluster
    | SubmitRayJob
    | StopRayJob
    | DeleteJob
    | RequestStop
    | ClearStopRequest
    | ApplyWorkload
    | SetWorkloadActive
    | ReleaseQuota
    | SetPodsReady
    | FinishWorkload
)


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class Plan:
    status: RLHFJobStatus
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    """Seconds until something time-based is due (a deadline, a backoff); None: the timer."""
    dashboard_retry_at: datetime | None = None
    """Set while the dashboard does not answer: before then, the reconciler does not ask it
    again (it reuses the last answer); None: ask on every reconcile."""


# Condition types the operator maintains (the API lists them: `api.ConditionType`).
CLUSTER_READY = ConditionType.CLUSTER_READY.value
TRAINER_RUNNING = ConditionType.TRAINER_RUNNING.value
DASHBOARD_REACHABLE = ConditionType.DASHBOARD_REACHABLE.value
HEALTHY = ConditionType.HEALTHY.value
SUSPENDED = ConditionType.SUSPENDED.value
COMPLETE = ConditionType.COMPLETE.value
FAILED = ConditionType.FAILED.value
DEGRADED = ConditionType.DEGRADED.value
DRAINING = ConditionType.DRAINING.value
ADMITTED = ConditionType.ADMITTED.value

# ClusterReady reasons while the cluster is not ready: the kind of cause the message quotes.
CREATING = "Creating"
APPLY_REFUSED = "ApplyRefused"
"""The API server refused an object for now (403: RBAC or a quota; 409): retried."""
CLUSTER_REJECTED = FailureReason.CLUSTER_REJECTED.value
"""The API server (400, 422) or KubeRay's validation refused the RayCluster or an object of
the job: the job fails."""
POD_CREATION_FAILED = FailureReason.POD_CREATION_FAILED.value
"""KubeRay could not create a pod (its Warning Event on the RayCluster)."""
UNSCHEDULABLE = "Unschedulable"
"""A pod exists but the scheduler cannot place it."""
CONTAINERS_NOT_STARTING = "ContainersNotStarting"
"""A pod is placed but the kubelet cannot start a container (a missing Secret, an image pull)."""
PODS_NOT_READY = "PodsNotReady"
"""No cause known: the pods are starting."""
