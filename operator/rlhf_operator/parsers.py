"""The pure parsers that read the reconciler's views (`rlhf_operator.views`) off Kubernetes
and Ray objects.

No I/O and no clock of their own (the caller passes `now`), so each parser is tested on plain
objects. Unreadable input (a garbled annotation, a missing timestamp) reads as "not known",
never as a crash: the lifecycle policy decides what not knowing means.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rlhf_operator import names
from rlhf_operator.texts import CAUSE_LIMIT, MESSAGE_LIMIT
from rlhf_operator.views import (
    POD_CREATION_EVENTS,
    SPEC_REJECTED_EVENTS,
    ApplyRefusal,
    ClusterView,
    ClusterWarning,
    HeartbeatView,
    RayJobView,
    RoleView,
)
from rlhfjob.api import RLHFJob
from rlhfjob.contract import DASHBOARD_ANNOTATION, LeaseReport
from rlhfjob.contract import kuberay as ray
from rlhfjob.contract.lease import LEASE_STOP_REQUESTED_AT, parse_time

_EXIT_CODE = re.compile(r"exit code (-?\d+)")
_RAY_JOB_STATES = ("PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""Control characters but tab and line feed: never in a status message."""

# ---------------------------------------------------------------------------------------------
# Ownership


def controller_of(body: dict[str, Any]) -> dict[str, Any] | None:
    """The owner reference marked `controller` of an object, if any."""
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    owners = (metadata or {}).get("ownerReferences")
    for owner in owners if isinstance(owners, list) else []:
        if isinstance(owner, dict) and owner.get("controller") is True:
            return owner
    return None


@dataclass(frozen=True)
class Claim:
    """Whose an existing object of a job's name is, when not the job's: `earlier` when its
    controller is an RLHFJob of the same name that is gone (Kubernetes is collecting it: wait),
    else someone else's (never adopted)."""

    earlier: bool
    message: str


def claim(body: dict[str, Any], owner: dict[str, Any]) -> Claim | None:
    """None when `owner` (the job's owner reference) controls the object `body`; else whose
    it is, in words that name it."""
    held = controller_of(body)
    if held is not None and owner.get("uid") and held.get("uid") == owner.get("uid"):
        return None
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    where = f"{(metadata or {}).get('namespace', '')}/{(metadata or {}).get('name', '?')}"
    kind = str(body.get("kind") or "object")
    if held is not None and all(held.get(k) == owner.get(k) for k in ("kind", "name")):
        group = str(held.get("apiVersion", "")).split("/")[0]
        if group == str(owner.get("apiVersion", "")).split("/")[0]:
            return Claim(
                True,
                f"{kind} {where} belongs to an earlier {held['kind']} of this name "
                f"(uid {held.get('uid')}), which Kubernetes is deleting",
            )
    holder = (
        f"it is controlled by {held.get('kind')} {held.get('name')} (uid {held.get('uid')})"
        if held is not None
        else "it has no controller"
    )
    return Claim(
        False,
        f"{kind} {where} exists and is not this job's ({holder}); the operator never adopts "
        "an object: remove it, or give the job another name",
    )


NO_TOKEN = "the job's token is not sent to it"


def head_service_problem(service: dict[str, Any] | None, cluster: ClusterView) -> str | None:
    """Why the operator will not send the job's token to the head Service `service`: it is
    missing, or its controller is not the job's RayCluster `cluster` (by uid; the cluster is
    the job's, checked by `claim`). A Service of that name that someone else made would get
    the token and every answer of it would be believed. None: it is the cluster's own."""
    if service is None:
        return f"the Ray head Service does not exist (yet): {NO_TOKEN}"
    held = controller_of(service)
    if (
        held is not None
        and cluster.uid is not None
        and held.get("uid") == cluster.uid
        and held.get("kind") == ray.RAY_CLUSTER_KIND
    ):
        return None
    metadata = service.get("metadata") if isinstance(service.get("metadata"), dict) else {}
    name = _one_line((metadata or {}).get("name") or "?", 80)
    holder = (
        f"its controller is {_one_line(held.get('kind'), 60)} {_one_line(held.get('name'), 80)} "
        f"(uid {_one_line(held.get('uid'), 60)})"
        if held is not None
        else "it has no controller"
    )
    return f"the Service {name} is not the RayCluster {cluster.name}'s own ({holder}): {NO_TOKEN}"


# ---------------------------------------------------------------------------------------------
# Words, times and the API server's refusals


def error_text(error: BaseException) -> str:
    """An error as the status and Events show it."""
    return (str(error) or type(error).__name__)[:MESSAGE_LIMIT]


def _one_line(text: Any, limit: int = CAUSE_LIMIT) -> str:
    """Words from the API server or KubeRay on one line, trimmed to `limit`."""
    line = " ".join(str(text or "").split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _time(value: Any) -> datetime | None:
    """A timestamp from the client (datetime, maybe naive) or a body (RFC 3339); else None."""
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    if isinstance(value, str):
        try:
            parsed = parse_time(value)
        except ValueError:
            return None
        return _time(parsed)
    return None


def api_status(body: Any) -> tuple[str, str]:
    """(reason, message) of the API server's Status body; ("", "") when there is none.

    Only the Status `message` and `reason` are read: never the request echoed back, nor the
    details (which may quote the object).
    """
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    try:
        status = json.loads(body) if isinstance(body, str) else None
    except ValueError:
        status = None
    if not isinstance(status, dict):
        return "", ""
    reason, message = status.get("reason"), status.get("message")
    return (
        reason if isinstance(reason, str) else "",
        message if isinstance(message, str) else "",
    )


def secret_values(manifest: dict[str, Any]) -> list[str]:
    """Every value of a Secret manifest (as sent and decoded): what must never be quoted."""
    if manifest.get("kind") != "Secret":
        return []
    found: list[str] = []
    for key in ("data", "stringData"):
        values = manifest.get(key)
        for value in values.values() if isinstance(values, dict) else []:
            if not isinstance(value, str) or not value:
                continue
            found.append(value)
            if key == "data":
                try:
                    decoded = base64.b64decode(value, validate=True).decode()
                except (binascii.Error, ValueError):
                    continue
                if decoded:
                    found.append(decoded)
    return sorted(set(found), key=len, reverse=True)


def redact(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "[redacted]")
    return text


def apply_refusal(manifest: dict[str, Any], code: int, reason: str, message: str) -> ApplyRefusal:
    """The API server's refusal of `manifest`, fit to show: trimmed, Secret values redacted."""
    metadata = manifest.get("metadata") if isinstance(manifest.get("metadata"), dict) else {}
    secrets = secret_values(manifest)
    words = redact(" ".join(str(message or "").split()), secrets)
    return ApplyRefusal(
        kind=str(manifest.get("kind") or "object"),
        name=str((metadata or {}).get("name") or "?"),
        code=code,
        reason=redact(_one_line(reason, 40), secrets),
        message=_one_line(words) or f"HTTP {code}",
    )


# ---------------------------------------------------------------------------------------------
# The RayCluster, its pods and KubeRay's Events, the trainer's Lease, the Ray job


def _event_times(event: Any, now: datetime) -> tuple[datetime, datetime]:
    """When an Event (core/v1, as the client reads it) first and last happened."""
    metadata = getattr(event, "metadata", None)
    first = (
        _time(getattr(event, "first_timestamp", None))
        or _time(getattr(event, "event_time", None))
        or _time(getattr(metadata, "creation_timestamp", None))
        or now
    )
    series = getattr(event, "series", None)
    last = (
        _time(getattr(series, "last_observed_time", None))
        or _time(getattr(event, "last_timestamp", None))
        or _time(getattr(event, "event_time", None))
        or first
    )
    return first, max(first, last)


def cluster_warning(
    events: Iterable[Any], cluster: dict[str, Any] | None, pods: list[Any], now: datetime
) -> ClusterWarning | None:
    """The newest of KubeRay's Warnings on this RayCluster that still says why pods are missing.

    Events of an earlier RayCluster of the same name (another uid, or older than this one) do not
    count, nor a failure to create a pod older than the newest pod: KubeRay has since managed.
    """
    metadata = (cluster or {}).get("metadata") or {}
    uid = metadata.get("uid") if isinstance(metadata, dict) else None
    created = _time(metadata.get("creationTimestamp")) if isinstance(metadata, dict) else None
    newest_pod = head_created(pods, any_type=True)
    newest: ClusterWarning | None = None
    for event in events or []:
        reason = getattr(event, "reason", None)
        if getattr(event, "type", None) != "Warning" or not isinstance(reason, str):
            continue
        if reason not in POD_CREATION_EVENTS | SPEC_REJECTED_EVENTS:
            continue
        about = getattr(getattr(event, "involved_object", None), "uid", None)
        if uid and about and about != uid:
            continue
        first, last = _event_times(event, now)
        if created is not None and last < created:
            continue
        if reason in POD_CREATION_EVENTS and newest_pod is not None and last < newest_pod:
            continue
        count = getattr(getattr(event, "series", None), "count", None) or getattr(
            event, "count", None
        )
        message = _one_line(getattr(event, "message", None)).removeprefix(
            "(combined from similar events): "
        )
        warning = ClusterWarning(
            reason=reason,
            message=message,
            first_seen=first,
            last_seen=last,
            count=count if isinstance(count, int) and count > 0 else 1,
        )
        if newest is None or warning.last_seen >= newest.last_seen:
            newest = warning
    return newest


def trainer_nodes(pods: list[Any]) -> set[str]:
    """The nodes the cluster's head and trainer pods (not being deleted) run on: the pods a
    node drain must wait for (the PodDisruptionBudget's)."""
    return {
        pod.spec.node_name
        for pod in pods
        if _labels(pod).get(names.LABEL_ROLE) in ("head", "trainer")
        and pod.metadata.deletion_timestamp is None
        and getattr(pod.spec, "node_name", None)
    }


def heartbeat_from_lease(lease: Any) -> HeartbeatView | None:
    """Read the trainer's Lease; unreadable annotations count as missing, never as a crash."""
    if lease is None or lease.spec is None or lease.spec.renew_time is None:
        return None
    renewed = lease.spec.renew_time
    if renewed.tzinfo is None:
        renewed = renewed.replace(tzinfo=UTC)
    annotations = (lease.metadata and lease.metadata.annotations) or {}
    report = LeaseReport.from_annotations(annotations)
    requested = parse_time(annotations.get(LEASE_STOP_REQUESTED_AT))
    return HeartbeatView(renewed=renewed, stop_requested_at=requested, **vars(report))


def _labels(pod: Any) -> dict[str, Any]:
    labels = getattr(getattr(pod, "metadata", None), "labels", None)
    return labels if isinstance(labels, dict) else {}


def _deleting(pod: Any) -> bool:
    return getattr(getattr(pod, "metadata", None), "deletion_timestamp", None) is not None


def _conditions(pod: Any) -> list[Any]:
    conditions = getattr(getattr(pod, "status", None), "conditions", None)
    return conditions if isinstance(conditions, list) else []


def pod_ready(pod: Any) -> bool:
    if _deleting(pod):
        return False
    return any(
        getattr(c, "type", None) == "Ready" and getattr(c, "status", None) == "True"
        for c in _conditions(pod)
    )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def role_views(cluster: dict[str, Any], pods: list[Any]) -> dict[str, RoleView]:
    """Ready worker pods per group against the group's replicas (one group per role)."""
    ready: dict[str, int] = {}
    for pod in pods:
        labels = _labels(pod)
        if labels.get(ray.LABEL_NODE_TYPE) == ray.NODE_WORKER and pod_ready(pod):
            group = labels.get(ray.LABEL_GROUP, "")
            ready[group] = ready.get(group, 0) + 1
    spec = cluster.get("spec") if isinstance(cluster.get("spec"), dict) else {}
    groups = (spec or {}).get("workerGroupSpecs")
    return {
        group["groupName"]: RoleView(
            ready.get(group["groupName"], 0), _count(group.get("replicas"))
        )
        for group in (groups if isinstance(groups, list) else [])
        if isinstance(group, dict) and isinstance(group.get("groupName"), str)
    }


def scheduling_problem(pods: list[Any]) -> str | None:
    """The scheduler's message for a pod of the cluster it could not place, if any."""
    for pod in pods:
        for condition in _conditions(pod):
            if (
                getattr(condition, "type", None) == "PodScheduled"
                and getattr(condition, "status", None) == "False"
            ):
                name = getattr(getattr(pod, "metadata", None), "name", None) or "?"
                words = getattr(condition, "message", None) or getattr(condition, "reason", None)
                return f"the scheduler cannot place pod {name}: {_one_line(words)}"
    return None


STARTUP_FAILURES = frozenset(
    {
        "CreateContainerConfigError",  # a Secret, ConfigMap or key the pod names is missing
        "CreateContainerError",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)
"""The kubelet's waiting reasons that mean a container will not start by waiting alone: the user
must fix something (create the Secret, the pull secret, the image)."""


def startup_problem(pods: list[Any]) -> str | None:
    """The kubelet's words for a container of the cluster's pods that cannot start, if any.

    Kubelet retries these itself (a Secret created later is picked up), so they are shown, not
    acted on; the provisioning deadline still bounds the wait."""
    for pod in pods:
        status = getattr(pod, "status", None)
        for container in [
            *(getattr(status, "init_container_statuses", None) or []),
            *(getattr(status, "container_statuses", None) or []),
        ]:
            waiting = getattr(getattr(container, "state", None), "waiting", None)
            reason = getattr(waiting, "reason", None)
            if reason in STARTUP_FAILURES:
                pod_name = getattr(getattr(pod, "metadata", None), "name", None) or "?"
                words = getattr(waiting, "message", None)
                said = f"{reason}: {_one_line(words)}" if words else reason
                name = getattr(container, "name", None) or "?"
                return f"container {name} of pod {pod_name} cannot start: {said}"
    return None


def head_created(pods: list[Any], *, any_type: bool = False) -> datetime | None:
    """Creation time of the newest head pod (any pod: `any_type`) that is not being deleted."""
    times = [
        created
        for pod in pods
        if (any_type or _labels(pod).get(ray.LABEL_NODE_TYPE) == ray.NODE_HEAD)
        and not _deleting(pod)
        and (created := _time(getattr(getattr(pod, "metadata", None), "creation_timestamp", None)))
    ]
    return max(times) if times else None


def head_pod_count(pods: list[Any]) -> int:
    """Head pods that are not being deleted."""
    return sum(
        1
        for pod in pods
        if _labels(pod).get(ray.LABEL_NODE_TYPE) == ray.NODE_HEAD and not _deleting(pod)
    )


def head_not_ready_since(cluster: dict[str, Any], now: datetime) -> datetime | None:
    """From KubeRay's HeadPodReady condition: since when the head is not Ready (None: it is)."""
    status = cluster.get("status")
    conditions = status.get("conditions") if isinstance(status, dict) else None
    for condition in conditions if isinstance(conditions, list) else []:
        if (
            isinstance(condition, dict)
            and condition.get("type") == ray.CONDITION_HEAD_POD_READY
            and condition.get("status") == "False"
        ):
            return _time(condition.get("lastTransitionTime")) or now
    return None


def cluster_view(
    job: RLHFJob,
    body: dict[str, Any] | None,
    pods: list[Any],
    now: datetime,
    *,
    pods_read: bool = True,
    dashboard_from_annotation: bool = False,
) -> ClusterView | None:
    """The RayCluster `body` (None: there is none) and its pods, as the policy needs them;
    `pods_read` false: the pods were not read this time, so no role view is given. The
    dashboard is the head Service's, or with `dashboard_from_annotation` (a test hook) the
    address the RayCluster's annotation names."""
    if body is None:
        return None
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    metadata = metadata or {}
    annotations = metadata.get("annotations")
    annotations = annotations if isinstance(annotations, dict) else {}
    status = body.get("status") if isinstance(body.get("status"), dict) else {}
    dashboard = annotations.get(DASHBOARD_ANNOTATION) if dashboard_from_annotation else None
    return ClusterView(
        name=str(metadata.get("name") or names.ray_cluster_name(job)),
        created=_time(metadata.get("creationTimestamp")) or now,
        ready=(status or {}).get("state") == ray.STATE_READY,
        uid=metadata.get("uid") if isinstance(metadata.get("uid"), str) else None,
        deleting=bool(metadata.get("deletionTimestamp")),
        dashboard=(dashboard if isinstance(dashboard, str) else None) or names.dashboard_url(job),
        head_not_ready_since=head_not_ready_since(body, now),
        head_created=head_created(pods),
        roles=role_views(body, pods) if pods_read else {},
        pods_read=pods_read,
        head_pods=head_pod_count(pods),
    )


def ray_job_view(submission_id: str, body: dict[str, Any]) -> RayJobView:
    """A job as the Job Submission API's `GET /api/jobs/<id>` describes it.

    The head runs the job's code, which may answer anything: a field of the wrong type raises
    ValueError naming it, and Ray's message keeps no control characters but line breaks."""
    status, message = body.get("status"), body.get("message") or ""
    if status not in _RAY_JOB_STATES:
        raise ValueError(f"status is not one of {', '.join(_RAY_JOB_STATES)}")
    if not isinstance(message, str):
        raise ValueError("message is not a string")
    message = _CONTROL.sub(" ", message[:MESSAGE_LIMIT])
    exit_code = body.get("driver_exit_code")
    if exit_code is not None and (not isinstance(exit_code, int) or isinstance(exit_code, bool)):
        raise ValueError("driver_exit_code is not an integer")
    if exit_code is None and (match := _EXIT_CODE.search(message)):
        exit_code = int(match.group(1))
    end_ms = body.get("end_time")
    try:
        ended = datetime.fromtimestamp(end_ms / 1000, UTC) if end_ms else None
    except (TypeError, OverflowError, OSError, ValueError):
        raise ValueError("end_time is not a time in milliseconds") from None
    return RayJobView(
        submission_id=submission_id,
        status=status,
        message=message,
        exit_code=exit_code,
        ended=ended,
    )
