"""What the reconciler saw: the views `lifecycle.decide` bases a plan on.

Plain frozen records, so the decision core is tested on them alone; `rlhf_operator.parsers`
reads them off Kubernetes and Ray objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from rlhf_operator.queueing import WorkloadView
from rlhfjob.api import RLHFJob
from rlhfjob.contract import ExitCode, LeaseReport

PERMANENT_REFUSALS = frozenset({400, 422})
"""HTTP codes of an apply the same manifest would get again (BadRequest, Invalid)."""
RETRIED_REFUSALS = frozenset({403, 409})
"""HTTP codes of an apply that may pass later (RBAC granted, quota freed, a conflict gone)."""
NOT_OWNED = "NotOwned"
"""The refusal's reason when an object of the job's name exists and the job does not control
it: the operator never adopts one (its roles, its cloud identity, its data), so the job fails."""

POD_CREATION_EVENTS = frozenset({"FailedToCreateHeadPod", "FailedToCreateWorkerPod"})
"""KubeRay's Warning reasons when the API server refused a pod it tried to create."""
SPEC_REJECTED_EVENTS = frozenset({"InvalidRayClusterSpec", "InvalidRayClusterMetadata"})
"""KubeRay's Warning reasons when its own validation refused the RayCluster."""
PERMANENT_POD_ERRORS = (
    "violates PodSecurity",  # Pod Security admission: the namespace's level refuses the pod
    " is invalid",  # pod validation: the pod as built can never exist
    "failed quota:",  # a quota that needs requests/limits the pod does not set
)
"""Words of a refused pod that the same pod would get again; other refusals (`exceeded quota`,
a ServiceAccount not there yet, a webhook) may pass later."""


@dataclass(frozen=True)
class RoleView:
    """One worker group's pods: how many are Ready against how many the group asks for."""

    ready: int
    desired: int


@dataclass(frozen=True)
class ClusterView:
    """The job's RayCluster as KubeRay reports it, and its pods."""

    name: str
    created: datetime
    ready: bool
    """KubeRay's `status.state == ready`: all pods were running and ready once (it stays so)."""
    uid: str | None = None
    """The RayCluster's uid: the operator deletes only the cluster it saw (a precondition)."""
    pods_read: bool = True
    """Whether the pods were read for this view: when not, `roles` is empty (unknown)."""
    deleting: bool = False
    dashboard: str | None = None
    """Where the operator reaches the Ray dashboard (head Service, or the local stand-in)."""
    head_not_ready_since: datetime | None = None
    """Set while KubeRay's HeadPodReady condition is False: since when."""
    head_created: datetime | None = None
    """When the current head pod was created: a head newer than the running trainer replaced
    the one it ran on."""
    roles: dict[str, RoleView] = field(default_factory=dict)
    """Worker groups (one per role) by name."""
    head_pods: int = 0
    """Head pods not being deleted (0 when the pods were not read): KubeRay stops reconciling a
    cluster with more than one."""


@dataclass(frozen=True)
class RayJobView:
    """The current attempt's Ray job, from the Job Submission API."""

    submission_id: str
    status: Literal["PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED"]
    message: str = ""
    exit_code: int | None = None
    ended: datetime | None = None
    """When the driver exited (Ray's `end_time`), for detection latency."""

    @property
    def active(self) -> bool:
        return self.status in ("PENDING", "RUNNING")

    @property
    def failed_retryably(self) -> bool:
        """The driver failed, and a restart may help (not a non-retryable exit)."""
        return self.status == "FAILED" and self.exit_code != ExitCode.NON_RETRYABLE


@dataclass(frozen=True, kw_only=True)
class HeartbeatView(LeaseReport):
    """The trainer's Lease: what it reported (`LeaseReport`) and when it last renewed."""

    renewed: datetime
    stop_requested_at: datetime | None = None
    """The operator's own request to checkpoint and stop, while it is on the Lease."""


@dataclass(frozen=True)
class Observed:
    """Everything `lifecycle.decide` bases a plan on."""

    job: RLHFJob
    now: datetime
    created: datetime
    cluster: ClusterView | None = None
    ray_job: RayJobView | None = None
    """None: Ray does not know this attempt's job (the dashboard answered 404)."""
    previous_ray_job: RayJobView | None = None
    """The previous attempt's job while recovering: it must be gone before the next starts."""
    dashboard_error: str | None = None
    """Set when the dashboard did not answer; `ray_job` is then unknown, not absent."""
    trusted_dashboard: str | None = None
    """The dashboard address whose head Service this reconcile found to be the job's
    RayCluster's own (`parsers.head_service_problem`): the only address the job's token is
    sent to. None: not checked this time, or not the cluster's (then `dashboard_error` says
    why)."""
    ray_job_read: bool = True
    """Whether the dashboard was asked for this attempt's job this time and answered. When
    not (the cluster not ready, its dashboard silent), `ray_job` None is unknown, not absent:
    a drain under way then goes by the trainer's Lease, never by the silence."""
    heartbeat: HeartbeatView | None = None
    scheduling_problem: str | None = None
    """The scheduler's latest FailedScheduling message for the cluster's pods."""
    startup_problem: str | None = None
    """The kubelet's reason a container of the cluster's pods cannot start (a missing Secret, an
    image it cannot pull); read only while the cluster is not ready."""
    submit_error: str | None = None
    """Set when this reconcile's submission failed or was refused: it did not happen."""
    cluster_warning: ClusterWarning | None = None
    """KubeRay's newest Warning on the RayCluster that says why its pods do not come up (read
    only while the cluster is not ready)."""
    apply_error: ApplyRefusal | None = None
    """Set when the API server refused this reconcile's apply: that object was not changed,
    nor the RayCluster, which is applied only after everything its pods need."""
    drained_nodes: tuple[str, ...] = ()
    """Cordoned nodes (a drain under way) that a trainer pod of the cluster runs on."""
    policy_problems: tuple[str, ...] = ()
    """How the job breaks the installation's job policy now (`JobPolicy.problems`): checked at
    every reconcile, so a policy tightened, or a field changed past admission, ends a job
    already running."""
    workload: WorkloadView | None = None
    """A queued job's Kueue Workload (None: not created yet, or the job is not queued)."""
    workload_error: ApplyRefusal | None = None
    """Set when this reconcile's create of the Workload was refused (or its priority class
    is missing): the job is not in the queue."""
    pods_left: int = 0
    """Pods of the job's RayCluster still there while it has no cluster (a queued job gives
    its quota back only once this is 0)."""


@dataclass(frozen=True)
class ApplyRefusal:
    """The API server refused to create or change an object the job needs (HTTP 4xx)."""

    kind: str
    name: str
    code: int
    reason: str = ""
    """The Status reason: Invalid, BadRequest, Forbidden, Conflict, AlreadyExists."""
    message: str = ""
    """The Status message, trimmed, with any Secret value of the manifest redacted."""

    @property
    def permanent(self) -> bool:
        """The same manifest would be refused again, or the object is someone else's:
        retrying cannot help."""
        return self.code in PERMANENT_REFUSALS or self.reason == NOT_OWNED

    @property
    def text(self) -> str:
        if self.reason == NOT_OWNED:
            return f"the operator will not use the {self.kind} {self.name}: {self.message}"
        code = f"{self.code} {self.reason}".strip()
        return f"the API server refused the {self.kind} {self.name} ({code}): {self.message}"


@dataclass(frozen=True)
class ClusterWarning:
    """A Warning KubeRay recorded on the RayCluster: it could not create a pod, or refused the
    spec. The newest one is what the job shows while its cluster is not ready."""

    reason: str
    """KubeRay's Event reason (FailedToCreateWorkerPod, ...)."""
    message: str
    first_seen: datetime
    last_seen: datetime
    count: int = 1

    @property
    def spec_rejected(self) -> bool:
        return self.reason in SPEC_REJECTED_EVENTS

    @property
    def permanent(self) -> bool:
        """Retrying cannot help: KubeRay refused the spec, or the pod itself was refused."""
        return self.spec_rejected or any(word in self.message for word in PERMANENT_POD_ERRORS)

    @property
    def text(self) -> str:
        return f"KubeRay {self.reason}: {self.message}"
