"""Drains: the trainer checkpoints its step and stops before its cluster goes (a `DrainCause`
says why), and the rungs a drain serves directly: suspension and moving off a drained node.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from rlhf_operator.lifecycle import shared
from rlhf_operator.lifecycle.builder import PlanBuilder
from rlhf_operator.lifecycle.plan import (
    CLUSTER_READY,
    DRAINING,
    SUSPENDED,
    TRAINER_RUNNING,
    ClearStopRequest,
    DeleteCluster,
    RequestStop,
    StopRayJob,
)
from rlhfjob.api import Phase
from rlhfjob.contract import DrainCause, EventReason

DRAIN_POLL_SECONDS = 2.0
"""How often a draining job looks whether its trainer has stopped (it checkpoints meanwhile)."""


def drain(b: PlanBuilder, cause: str, why: DrainCause = DrainCause.SUSPEND) -> bool:
    """Before a cluster is released under a training driver: ask the driver, through its
    Lease, to finish its step, checkpoint it and exit, and wait for that up to
    `checkpoint.stopGracePeriodSeconds`. True while the cluster must stay.

    Only a trainer that heartbeats can hear the request; one that has not acknowledged it
    within `liveness.heartbeatTimeoutSeconds` is not listening (hung), and is not waited for.
    The drain ends when Ray says the driver exited; while Ray's answer is unknown (a silent
    dashboard), when the trainer's Lease says it saved its checkpoint or has not been renewed
    for the heartbeat timeout, and never on the silence alone: that would release a trainer
    in the middle of its step.
    """
    grace = b.job.spec.checkpoint.stop_grace_period_seconds
    ray_job = b.seen.ray_job
    cluster = b.seen.cluster
    beat = b.current_heartbeat()
    if ray_job is not None and ray_job.submission_id != b.attempt_id():
        ray_job = None  # an earlier attempt, already stopped
    asked_at = b.since(DRAINING, "True")
    # The answer to this request, not an earlier drain's (it stays on the Lease); a second
    # of slack for the time's round trip through text.
    answered = beat.checkpoint_requested_at if beat is not None else None
    heard = answered is not None and answered >= asked_at - timedelta(seconds=1)
    saved = heard and beat is not None and beat.checkpoint_saved_step is not None
    deaf = b.job.spec.liveness.heartbeat_timeout_seconds
    if b.seen.ray_job_read:
        stopped = ray_job is None or not ray_job.active
    else:  # Ray did not answer: the Lease says the step is saved, or the driver went quiet
        quiet = beat is None or b.waited(beat.renewed) >= deaf
        stopped = b.draining() is not None and (saved or quiet)
    if stopped or cluster is None or cluster.deleting:
        if b.draining() is not None:
            done = "the trainer stopped"
            if saved and beat is not None:
                done += f" after checkpointing step {beat.checkpoint_saved_step}"
            end_drain(b, EventReason.DRAINED, "Normal", f"{cause}: {done}")
        return False
    if b.draining() is None:
        # Under way: Ray says so, or (Ray's answer unknown) this attempt's driver heartbeats.
        training = ray_job is None or ray_job.status == "RUNNING"
        if grace == 0 or not training or beat is None:
            return False  # no step under way, no grace to save it in, or nobody listening
        b.act(RequestStop(b.seen.now))
        asked = (
            f"{cause}: the trainer finishes step {(b.status.current_step or 0) + 1} and "
            f"checkpoints it before its cluster is released (up to {grace}s)"
        )
        b.condition(DRAINING, True, why, asked)
        b.event("Normal", why, asked)
        b.status.message = asked
        b.requeue(DRAIN_POLL_SECONDS)
        return True
    waited = b.waited(asked_at)
    if not heard and waited >= deaf:
        late = f"{cause}: the trainer did not acknowledge the stop request in {deaf}s"
    elif waited >= grace:
        late = f"{cause}: the trainer did not stop within {grace}s"
    else:
        b.requeue(DRAIN_POLL_SECONDS)
        return True
    end_drain(b, EventReason.DRAIN_TIMED_OUT, "Warning", f"{late}; releasing its cluster")
    return False


def end_drain(
    b: PlanBuilder, reason: str, kind: Literal["Normal", "Warning"], message: str
) -> None:
    """The drain is over (the trainer stopped, or it was not waited for): say how it ended."""
    b.act(ClearStopRequest())
    b.condition(DRAINING, False, reason, message)
    b.event(kind, reason, message)


def suspend(b: PlanBuilder) -> None:
    """`spec.suspend` (or a suspension's drain): drain, then release the cluster and the quota."""
    if drain(b, "suspended"):
        return
    if b.seen.ray_job and b.seen.ray_job.active:
        b.act(StopRayJob(b.seen.ray_job.submission_id))
    if b.seen.cluster and not b.seen.cluster.deleting:
        b.act(DeleteCluster("suspended"))
    b.status.submission_id = None
    shared.release_quota(b)
    b.enter(Phase.SUSPENDED, "suspended: cluster released, checkpoints kept")
    why = "spec.suspend is true" if b.job.spec.suspend else "released after a drain"
    b.condition(SUSPENDED, True, EventReason.SUSPENDED, why)
    b.condition(TRAINER_RUNNING, False, EventReason.SUSPENDED)
    b.condition(CLUSTER_READY, False, EventReason.SUSPENDED)


def leave_suspension(b: PlanBuilder) -> None:
    """`spec.suspend` went false: Pending again, a new provisioning with its own deadline."""
    if b.status.phase == Phase.SUSPENDED:
        b.condition(SUSPENDED, False, EventReason.RESUMED, "spec.suspend is false")
        b.enter(Phase.PENDING, "resuming from the latest checkpoint", reason=EventReason.RESUMED)
        b.forget_condition(CLUSTER_READY)  # a new provisioning, with its own deadline


def move_off_drained_nodes(b: PlanBuilder) -> None:
    """The head's or a trainer pod's node is being drained (its PodDisruptionBudget holds the
    eviction back), in whatever state the job is: a trainer checkpoints its step, then the
    cluster goes, and a new one (off the cordoned node) resumes from that checkpoint. Not a
    failure: no restart is counted."""
    nodes = ", ".join(b.seen.drained_nodes) or "a trainer's node"
    if drain(b, f"{nodes} is being drained", DrainCause.NODE_DRAIN):
        return
    moving = f"moving the job off {nodes} (being drained); it resumes from its checkpoint"
    if b.seen.cluster and not b.seen.cluster.deleting:
        if b.seen.ray_job and b.seen.ray_job.active:
            b.act(StopRayJob(b.seen.ray_job.submission_id))
        b.act(DeleteCluster(f"moving off {nodes}"))
        if b.status.phase == Phase.PROVISIONING:  # a cluster not ready yet: no phase change
            b.event("Normal", EventReason.NODE_DRAINED, moving)
    b.status.submission_id = None  # the next cluster gets this attempt again
    b.enter(Phase.PROVISIONING, moving, reason=EventReason.NODE_DRAINED)
    exited = b.seen.ray_job is not None and b.seen.ray_job.failed_retryably
    b.condition(
        TRAINER_RUNNING,
        False,
        EventReason.NODE_DRAINED,
        "the trainer exited while its node was being drained" if exited else "",
    )
    b.condition(CLUSTER_READY, False, EventReason.NODE_DRAINED, f"moving off {nodes}")
