"""Kueue: a job with a queue-name label runs only while its Workload is admitted; the
Workload follows `spec.suspend`, the pods' readiness and the job's end.
"""

from __future__ import annotations

from rlhf_operator.lifecycle import drain, scaling, shared
from rlhf_operator.lifecycle.builder import PlanBuilder
from rlhf_operator.lifecycle.drain import DRAIN_POLL_SECONDS
from rlhf_operator.lifecycle.plan import (
    ADMITTED,
    APPLY_REFUSED,
    CLUSTER_READY,
    TRAINER_RUNNING,
    ApplyWorkload,
    DeleteCluster,
    SetPodsReady,
    SetWorkloadActive,
    StopRayJob,
)
from rlhfjob.api import Phase
from rlhfjob.contract import DrainCause, EventReason


def enqueue(b: PlanBuilder) -> None:
    """Put the job in its queue: a Workload Kueue admits as a whole, before any pod."""
    refused = b.seen.workload_error
    if refused is not None and refused.permanent:
        shared.cluster_rejected(b, refused.text)
        return
    if refused is not None:
        b.enter(Phase.PENDING, f"could not queue the job: {refused.text}")
        b.condition(ADMITTED, False, APPLY_REFUSED, refused.text)
        shared.retry_refused(b, ADMITTED)
        return
    b.act(ApplyWorkload())
    waiting = f"queued in LocalQueue {b.queue}: waiting for Kueue to admit the job"
    b.enter(Phase.PENDING, waiting, reason=EventReason.QUEUED)
    if b.condition(ADMITTED, False, EventReason.QUEUED, waiting):
        b.event("Normal", EventReason.QUEUED, waiting)  # a new job is Pending already


def follow_workload(b: PlanBuilder) -> None:
    """Keep the Workload's `active` in step with `spec.suspend`, and say when Kueue admitted
    the job."""
    workload = b.seen.workload
    assert workload is not None
    if workload.active == b.job.spec.suspend:
        b.act(SetWorkloadActive(not b.job.spec.suspend))
    if not workload.running_allowed or b.job.spec.suspend or b.draining() is not None:
        return
    admitted = f"admitted by ClusterQueue {workload.cluster_queue}"
    if b.condition(ADMITTED, True, EventReason.ADMITTED, admitted):
        b.event("Normal", EventReason.ADMITTED, admitted)
    cluster = b.seen.cluster
    ready = (
        cluster is not None
        and cluster.ready
        and not cluster.deleting
        and cluster.head_not_ready_since is None
        and not scaling.roles_below_minimum(b)
    )
    if workload.pods_ready != ready:
        b.act(SetPodsReady(ready))


def wait_for_admission(b: PlanBuilder) -> None:
    """Not admitted (yet, or any more): no cluster may run. An evicted job (a preemption)
    drains like a suspended one, its cluster goes, and only when its last pod is gone does
    it give the quota back, so the preemptor never shares its GPUs; Kueue then queues it
    again, and once admitted it resumes from the drain's checkpoint."""
    workload = b.seen.workload
    assert workload is not None
    drain.leave_suspension(b)
    eviction = workload.eviction
    if eviction is not None:
        cause = f"evicted by Kueue ({eviction.reason}): {eviction.message}".rstrip(": ")
    else:
        cause = "not admitted by Kueue"
    if drain.drain(b, cause, DrainCause.PREEMPTION):
        return
    cluster = b.seen.cluster
    if cluster is not None and not cluster.deleting:
        if b.seen.ray_job and b.seen.ray_job.active:
            b.act(StopRayJob(b.seen.ray_job.submission_id))
        b.act(DeleteCluster(cause))
    b.status.submission_id = None  # the next cluster gets this attempt again
    if cluster is not None or not b.cluster_gone():
        b.enter(Phase.PENDING, f"{cause}; releasing its cluster", reason=EventReason.PREEMPTED)
        b.condition(ADMITTED, False, eviction.reason if eviction else "Pending", cause)
        b.condition(TRAINER_RUNNING, False, EventReason.PREEMPTED)
        b.condition(CLUSTER_READY, False, EventReason.PREEMPTED, cause)
        b.requeue(DRAIN_POLL_SECONDS)
        return
    if shared.release_quota(b):
        waiting = f"{cause}; quota given back, queued again in LocalQueue {b.queue}"
    else:
        told = workload.waiting_message or "waiting for Kueue to admit the job"
        waiting = f"queued in LocalQueue {b.queue}: {told}"
    b.enter(Phase.PENDING, waiting, reason=EventReason.QUEUED)
    b.condition(ADMITTED, False, workload.waiting_reason or EventReason.QUEUED, waiting)
