"""Bring the RayCluster up and keep it healthy: apply it, wait for its pods within a deadline
and quote what keeps them, notice a lost or replaced head, wait out a silent dashboard.
"""

from __future__ import annotations

from datetime import datetime

from rlhf_operator.lifecycle import drain, shared, training
from rlhf_operator.lifecycle.builder import PlanBuilder
from rlhf_operator.lifecycle.plan import (
    APPLY_REFUSED,
    CLUSTER_READY,
    CLUSTER_REJECTED,
    CONTAINERS_NOT_STARTING,
    CREATING,
    DASHBOARD_REACHABLE,
    POD_CREATION_FAILED,
    PODS_NOT_READY,
    TRAINER_RUNNING,
    UNSCHEDULABLE,
    ApplyCluster,
)
from rlhf_operator.lifecycle.shared import after
from rlhf_operator.views import ApplyRefusal, ClusterView
from rlhfjob.api import Phase
from rlhfjob.contract import EventReason, FailureReason, RestartReason

DASHBOARD_RETRY_SECONDS = (5.0, 60.0)
"""The wait between asking a dashboard that does not answer, first and at most: it doubles from
the first to the second, counted from when it stopped answering (`dashboard_retry_at`)."""
PERMANENT_FAILURE_GRACE_SECONDS = 60.0
"""How long a pod refusal that retrying cannot fix (Pod Security, an invalid pod) may persist
before the job fails: time for a quick fix of the namespace, short enough to see it fail."""


def drive(b: PlanBuilder) -> None:
    """The job should run: apply the RayCluster, wait for it, then follow the trainer."""
    drain.leave_suspension(b)
    b.status.start_time = b.status.start_time or b.seen.now
    refused = b.seen.apply_error
    if refused is not None and refused.permanent:
        shared.cluster_rejected(b, refused.text)
        return
    cluster = b.seen.cluster
    if cluster is None or cluster.deleting:
        if b.status.submission_id == b.attempt_id():
            # Gone under this attempt's trainer, and not by the operator's doing (it moves
            # to the next attempt, or forgets the submission, first): someone deleted it.
            gone = "the RayCluster was deleted under the running trainer"
            shared.restart(b, RestartReason.HEAD_LOST, gone, b.status.last_heartbeat_time)
            if b.status.phase.terminal:
                return
            b.condition(TRAINER_RUNNING, False, RestartReason.HEAD_LOST, gone)
        b.status.submission_id = None  # no Ray job outlives its cluster
        if refused is not None:
            wait_for_apply(b, refused)
            return
        b.act(ApplyCluster())
        if b.status.phase in (Phase.PENDING, Phase.PROVISIONING):
            b.enter(Phase.PROVISIONING, "creating the RayCluster", reason=EventReason.PROVISIONING)
        b.condition(CLUSTER_READY, False, CREATING, "the RayCluster is being created")
        return
    if b.spec_changed and refused is None:
        b.act(ApplyCluster())  # e.g. new replica counts of an elastic role
    b.status.ray_cluster_name = cluster.name
    if not cluster.ready:
        wait_for_cluster(b, cluster)
    else:
        drive_ready(b, cluster)
    if refused is not None and not b.status.phase.terminal:
        # The cluster runs as it was; the timer's next reconcile applies the change again.
        note = f"the change of the spec is not applied yet: {refused.text}"
        if note not in b.status.message:
            b.status.message = f"{b.status.message}; {note}".lstrip("; ")


def drive_ready(b: PlanBuilder, cluster: ClusterView) -> None:
    """KubeRay calls the cluster ready: check its head and dashboard, then the trainer."""
    if cluster.head_not_ready_since is not None:
        wait_for_head(b, cluster.head_not_ready_since)
        return
    if head_replaced(b, cluster):
        return
    b.condition(CLUSTER_READY, True, "Ready", "the Ray head pod is ready")
    if b.seen.dashboard_error is not None:
        dashboard_unreachable(b, b.seen.dashboard_error)
        return
    b.condition(DASHBOARD_REACHABLE, True, "Reachable")
    b.status.dashboard_url = cluster.dashboard
    training.follow_ray_job(b)


def pod_cause(b: PlanBuilder) -> tuple[str, str | None]:
    """Why the pods of an existing cluster are not ready: (ClusterReady reason, the cause)."""
    warning = b.seen.cluster_warning
    if warning is not None:
        return (CLUSTER_REJECTED if warning.spec_rejected else POD_CREATION_FAILED), warning.text
    if b.seen.scheduling_problem:
        return UNSCHEDULABLE, b.seen.scheduling_problem
    if b.seen.startup_problem:
        return CONTAINERS_NOT_STARTING, b.seen.startup_problem
    return PODS_NOT_READY, None


def wait_for_apply(b: PlanBuilder, refused: ApplyRefusal) -> None:
    """An object was refused for now (RBAC, a quota, a conflict): show it, apply it again
    soon, and give up like a cluster that never became ready."""
    waiting = f"waiting for the RayCluster: {refused.text}"
    await_cluster(b, APPLY_REFUSED, waiting, refused.text, created=None)
    if not b.status.phase.terminal:
        shared.retry_refused(b, CLUSTER_READY)


def wait_for_cluster(b: PlanBuilder, cluster: ClusterView) -> None:
    """The cluster exists but is not ready: say why, fail on what retrying cannot fix."""
    if cluster.head_pods > 1:
        # KubeRay's pod cache missed the head it had made (it lags after an API-server
        # restart), so it made another; with two heads it stops reconciling the cluster
        # ("Multiple head pods found") and would wait forever: a new RayCluster at once.
        message = (
            f"KubeRay made {cluster.head_pods} head pods for the RayCluster and stopped "
            "reconciling it (its pod cache lagged, as after an API-server restart)"
        )
        shared.recreate_cluster(
            b, RestartReason.CLUSTER_UNHEALTHY, message, b.status.last_heartbeat_time
        )
        return
    reason, cause = pod_cause(b)
    warning = b.seen.cluster_warning
    if warning is not None and warning.spec_rejected:
        shared.cluster_rejected(b, warning.text)
        return
    if warning is not None and warning.permanent:
        persisted = b.waited(warning.first_seen)
        if persisted >= PERMANENT_FAILURE_GRACE_SECONDS:
            b.condition(CLUSTER_READY, False, reason, warning.text)
            shared.finish(
                b,
                Phase.FAILED,
                FailureReason.POD_CREATION_FAILED,
                f"the Ray pods cannot be created ({persisted:.0f}s): {warning.text}",
            )
            return
        b.requeue(PERMANENT_FAILURE_GRACE_SECONDS - persisted)
    waiting = f"waiting for Ray pods: {cause}" if cause else "waiting for Ray pods"
    await_cluster(b, reason, waiting, cause, created=cluster.created)


def await_cluster(
    b: PlanBuilder, reason: str, waiting: str, cause: str | None, created: datetime | None
) -> None:
    """Wait for a cluster that is not ready (or not created) within its deadline:
    `provisioningTimeoutSeconds` for a new one, the recovery timeout for a recreated one."""
    detail = f": {cause}" if cause else ""
    unhealthy_since = b.since(CLUSTER_READY, "False")
    b.condition(CLUSTER_READY, False, reason, waiting)
    if b.status.phase in (Phase.PENDING, Phase.PROVISIONING):
        limit = b.job.spec.provisioning_timeout_seconds
        waited = b.waited(created or unhealthy_since)
        if waited >= limit:
            shared.finish(
                b,
                Phase.FAILED,
                FailureReason.PROVISIONING_TIMEOUT,
                f"the RayCluster was not ready after {limit}s{detail}",
            )
            return
        b.enter(Phase.PROVISIONING, waiting, reason=EventReason.PROVISIONING)
        b.requeue(limit - waited)
        return
    # A recreated cluster: give it the recovery deadline (from when it was asked for), then
    # climb the ladder again.
    history = b.status.restart_history
    started = created or (history[-1].time if history else unhealthy_since)
    limit = b.job.spec.recovery.cluster_recovery_timeout_seconds
    since = max(unhealthy_since, started)
    waited = b.waited(since)
    if waited >= limit:
        message = f"the RayCluster stayed unhealthy for {limit}s{detail}"
        if created is None:  # nothing to delete: try again after the restart's backoff
            shared.restart(b, RestartReason.CLUSTER_UNHEALTHY, message, last_alive=since)
            b.condition(TRAINER_RUNNING, False, RestartReason.CLUSTER_UNHEALTHY, message)
        else:
            shared.recreate_cluster(b, RestartReason.CLUSTER_UNHEALTHY, message, last_alive=since)
        return
    b.enter(Phase.RECOVERING, waiting)
    b.requeue(limit - waited)


def wait_for_head(b: PlanBuilder, since: datetime) -> None:
    """KubeRay reports the head pod not Ready: a probe blip, or the head (and Ray) is gone.

    Without GCS fault tolerance a new head is a new Ray cluster that has lost the trainer's
    job and every actor, so past a short grace the operator recreates the RayCluster.
    """
    waited = (b.seen.now - since).total_seconds()
    grace = b.job.spec.liveness.heartbeat_timeout_seconds
    if waited < grace:
        # The time it went, not how long ago: the same words on every reconcile, no write.
        message = f"the Ray head pod has not been ready since {since:%H:%M:%S}Z"
        b.condition(CLUSTER_READY, False, "HeadPodNotReady", message)
        b.status.message = message
        b.requeue(grace - waited)
        return
    message = f"the Ray head pod has not been ready for {waited:.0f}s"
    b.condition(CLUSTER_READY, False, "HeadPodNotReady", message)
    shared.recreate_cluster(b, RestartReason.HEAD_LOST, message, last_alive=since)


def head_replaced(b: PlanBuilder, cluster: ClusterView) -> bool:
    """A head pod created after the trainer started running is a new, empty Ray cluster."""
    running = b.current(TRAINER_RUNNING)
    if running is None or running.status != "True" or running.last_transition_time is None:
        return False
    if cluster.head_created is None or cluster.head_created <= running.last_transition_time:
        return False
    shared.recreate_cluster(
        b,
        RestartReason.HEAD_LOST,
        f"the Ray head pod was replaced at {cluster.head_created:%H:%M:%S} while the "
        "trainer ran on the old one",
        last_alive=b.status.last_heartbeat_time,
    )
    return True


def dashboard_unreachable(b: PlanBuilder, error: str) -> None:
    """Wait for a dashboard that does not answer, asking it less and less often (5 s, then
    up to 60 s apart: `dashboard_retry_at`); the timer's reconciles in between reuse the
    last answer. Once the trainer was submitted, a dashboard still silent at
    `clusterRecoveryTimeoutSeconds` is asked at that moment, and recreated if it is."""
    since = b.since(DASHBOARD_REACHABLE, "False")
    b.condition(DASHBOARD_REACHABLE, False, "Unreachable", error)
    retry = dashboard_retry_at(since, b.seen.now)
    if b.status.submission_id is not None:
        limit = b.job.spec.recovery.cluster_recovery_timeout_seconds
        waited = (b.seen.now - since).total_seconds()
        if waited >= limit:
            message = f"the Ray dashboard has not answered for {waited:.0f}s: {error}"
            shared.recreate_cluster(b, RestartReason.CLUSTER_UNHEALTHY, message, last_alive=since)
            return
        deadline = after(since, limit)
        retry = min(retry, deadline)
        b.requeue(limit - waited)  # a kick at the deadline, not the next timer tick
    b.plan.dashboard_retry_at = retry


def dashboard_retry_at(since: datetime, now: datetime) -> datetime:
    """When to ask a dashboard silent since `since` again: the first point after `now` of the
    schedule since + 5, + 15, + 35, + 75, + 135, ... s (waits doubling to 60 s, then 60 s).

    A function of `since` alone, so every reconcile between two asks finds the same next one.
    """
    low, high = DASHBOARD_RETRY_SECONDS
    elapsed = (now - since).total_seconds()
    offset, step = 0.0, low
    while step < high:
        offset += step
        if offset > elapsed:
            return after(since, offset)
        step *= 2
    capped = max(0, int((elapsed - offset) // high) + 1)
    return after(since, offset + capped * high)
