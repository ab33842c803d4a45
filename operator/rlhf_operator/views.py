"""What the reconciler saw, and the pure parsers that read it off Kubernetes and Ray objects.

No I/O and no clock of their own (the caller passes `now`), so each parser is tested on plain
objects. Unreadable input (a garbled annotation, a missing timestamp) reads as "not known",
never as a crash: the lifecycle policy decides what not knowing means.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from rlhf_operator import names
from rlhfjob.api import RLHFJob
from rlhfjob.contract import DASHBOARD_ANNOTATION, LeaseReport
from rlhfjob.contract import kuberay as ray
from rlhfjob.contract.lease import parse_time

MESSAGE_LIMIT = 2000
"""What is kept of an error or a Ray job's message: enough to say why, short enough for status."""
_EXIT_CODE = re.compile(r"exit code (-?\d+)")


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


@dataclass(frozen=True, kw_only=True)
class HeartbeatView(LeaseReport):
    """The trainer's Lease: what it reported (`LeaseReport`) and when it last renewed."""

    renewed: datetime


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
    heartbeat: HeartbeatView | None = None
    scheduling_problem: str | None = None
    """The scheduler's latest FailedScheduling message for the cluster's pods."""
    submit_error: str | None = None
    """Set when this reconcile's submission failed or was refused: it did not happen."""


# ---------------------------------------------------------------------------------------------
# Parsers


def error_text(error: BaseException) -> str:
    """An error as the status and Events show it."""
    return (str(error) or type(error).__name__)[:MESSAGE_LIMIT]


def heartbeat_from_lease(lease: Any) -> HeartbeatView | None:
    """Read the trainer's Lease; unreadable annotations count as missing, never as a crash."""
    if lease is None or lease.spec is None or lease.spec.renew_time is None:
        return None
    renewed = lease.spec.renew_time
    if renewed.tzinfo is None:
        renewed = renewed.replace(tzinfo=UTC)
    report = LeaseReport.from_annotations((lease.metadata and lease.metadata.annotations) or {})
    return HeartbeatView(renewed=renewed, **vars(report))


def pod_ready(pod: Any) -> bool:
    if pod.metadata.deletion_timestamp is not None or pod.status is None:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def role_views(cluster: dict[str, Any], pods: list[Any]) -> dict[str, RoleView]:
    """Ready worker pods per group against the group's replicas (one group per role)."""
    ready: dict[str, int] = {}
    for pod in pods:
        labels = pod.metadata.labels or {}
        if labels.get(ray.LABEL_NODE_TYPE) == ray.NODE_WORKER and pod_ready(pod):
            group = labels.get(ray.LABEL_GROUP, "")
            ready[group] = ready.get(group, 0) + 1
    return {
        group["groupName"]: RoleView(ready.get(group["groupName"], 0), group.get("replicas", 0))
        for group in cluster.get("spec", {}).get("workerGroupSpecs") or []
    }


def scheduling_problem(pods: list[Any]) -> str | None:
    """The scheduler's message for a pod of the cluster it could not place, if any."""
    for pod in pods:
        for condition in (pod.status.conditions if pod.status else None) or []:
            if condition.type == "PodScheduled" and condition.status == "False":
                return f"pod {pod.metadata.name}: {condition.message or condition.reason}"
    return None


def head_created(pods: list[Any]) -> datetime | None:
    """Creation time of the newest head pod that is not being deleted."""
    times = [
        pod.metadata.creation_timestamp
        for pod in pods
        if (pod.metadata.labels or {}).get(ray.LABEL_NODE_TYPE) == ray.NODE_HEAD
        and pod.metadata.deletion_timestamp is None
        and pod.metadata.creation_timestamp is not None
    ]
    return max(times) if times else None


def head_not_ready_since(cluster: dict[str, Any], now: datetime) -> datetime | None:
    """From KubeRay's HeadPodReady condition: since when the head is not Ready (None: it is)."""
    for condition in (cluster.get("status") or {}).get("conditions") or []:
        if (
            condition.get("type") == ray.CONDITION_HEAD_POD_READY
            and condition.get("status") == "False"
        ):
            return parse_time(condition.get("lastTransitionTime")) or now
    return None


def cluster_view(
    job: RLHFJob, body: dict[str, Any] | None, pods: list[Any], now: datetime
) -> ClusterView | None:
    """The RayCluster `body` (None: there is none) and its pods, as the policy needs them."""
    if body is None:
        return None
    metadata = body["metadata"]
    annotations = metadata.get("annotations") or {}
    return ClusterView(
        name=metadata["name"],
        created=parse_time(metadata.get("creationTimestamp")) or now,
        ready=(body.get("status") or {}).get("state") == ray.STATE_READY,
        deleting=bool(metadata.get("deletionTimestamp")),
        dashboard=annotations.get(DASHBOARD_ANNOTATION) or names.dashboard_url(job),
        head_not_ready_since=head_not_ready_since(body, now),
        head_created=head_created(pods),
        roles=role_views(body, pods),
    )


def ray_job_view(submission_id: str, body: dict[str, Any]) -> RayJobView:
    """A job as the Job Submission API's `GET /api/jobs/<id>` describes it."""
    message = body.get("message") or ""
    exit_code = body.get("driver_exit_code")
    if exit_code is None and (match := _EXIT_CODE.search(message)):
        exit_code = int(match.group(1))
    end_ms = body.get("end_time")
    return RayJobView(
        submission_id=submission_id,
        status=body["status"],
        message=message[:MESSAGE_LIMIT],
        exit_code=exit_code,
        ended=datetime.fromtimestamp(end_ms / 1000, UTC) if end_ms else None,
    )
