"""The steps every rung may take: finish the job, climb the recovery ladder, give up on a
refusal, give the quota back (decision 5).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from rlhf_operator.lifecycle.builder import PlanBuilder
from rlhf_operator.lifecycle.plan import (
    CLUSTER_READY,
    CLUSTER_REJECTED,
    COMPLETE,
    DEGRADED,
    FAILED,
    TRAINER_RUNNING,
    DeleteCluster,
    ReleaseQuota,
    StopRayJob,
)
from rlhf_operator.texts import RESTART_MESSAGE_LIMIT, trim
from rlhfjob.api import MAX_RESTART_HISTORY, Phase, RestartRecord, RLHFJob, RLHFJobStatus
from rlhfjob.contract import EventReason, FailureReason, RestartReason

LATEST = datetime.max.replace(tzinfo=UTC)
APPLY_RETRY_SECONDS = (2.0, 60.0)
"""The wait before applying a refused object again grows with how long it has been refused,
within these bounds (the operator's timer re-reads the world meanwhile anyway)."""


def finish(b: PlanBuilder, phase: Phase, reason: str, message: str) -> None:
    """Enter a terminal phase: release the cluster, keep checkpoints."""
    b.enter(phase, message, reason=reason)
    b.status.completion_time = b.status.completion_time or b.seen.now
    b.condition(COMPLETE if phase == Phase.SUCCEEDED else FAILED, True, reason, message)
    b.condition(TRAINER_RUNNING, False, reason)
    if b.current(DEGRADED) is not None:
        b.condition(DEGRADED, False, reason)
    if b.seen.ray_job and b.seen.ray_job.active:
        b.act(StopRayJob(b.seen.ray_job.submission_id))
    if b.seen.cluster and not b.seen.cluster.deleting:
        b.act(DeleteCluster(reason))


def restart(
    b: PlanBuilder, reason: RestartReason, message: str, last_alive: datetime | None = None
) -> None:
    """Climb the recovery ladder one rung, or fail when the budget is spent."""
    budget = b.job.spec.recovery.max_restarts
    resize = reason == RestartReason.TRAINER_RESIZED
    if not resize and b.failures() >= budget:
        finish(
            b,
            Phase.FAILED,
            FailureReason.RESTARTS_EXHAUSTED,
            f"{message} (after {budget} restarts)",
        )
        return
    checkpoint = b.status.last_checkpoint
    detection = None
    if last_alive is not None:
        detection = round(max(0.0, (b.seen.now - last_alive).total_seconds()), 3)
    record = RestartRecord(
        time=b.seen.now,
        reason=reason,
        message=trim(message, RESTART_MESSAGE_LIMIT),
        resumed_from_step=checkpoint.step if checkpoint else None,
        detection_seconds=detection,
    )
    b.status.restart_count += 1
    b.status.restart_history = [*b.status.restart_history, record][-MAX_RESTART_HISTORY:]
    resumed = f"step {checkpoint.step}" if checkpoint else "the start"
    which = "a resize" if resize else f"restart {b.failures()}/{budget}"
    b.enter(Phase.RECOVERING, f"{which} from {resumed}: {message}", reason=reason)
    b.requeue(0 if resize else restart_delay(b.job, b.status))


def recreate_cluster(
    b: PlanBuilder, reason: RestartReason, message: str, last_alive: datetime | None
) -> None:
    """The top rung of the ladder: a new RayCluster, then resume from the checkpoint."""
    restart(b, reason, message, last_alive=last_alive)
    b.condition(TRAINER_RUNNING, False, reason, message)
    if not b.status.phase.terminal:
        b.act(DeleteCluster(message))


def cluster_rejected(b: PlanBuilder, cause: str) -> None:
    """The API server or KubeRay refused what the job needs: the same spec would be refused
    again, so the job fails now, quoting the refusal (no retry loop)."""
    b.condition(CLUSTER_READY, False, CLUSTER_REJECTED, cause)
    finish(b, Phase.FAILED, FailureReason.CLUSTER_REJECTED, cause)


def release_quota(b: PlanBuilder) -> bool:
    """Give a stopped job's quota back, once every pod is gone; True when it does now."""
    workload = b.seen.workload
    if workload is None or not workload.quota_reserved or not b.cluster_gone():
        return False
    b.act(ReleaseQuota())
    b.event("Normal", EventReason.QUOTA_RELEASED, "every pod is gone: quota given back")
    return True


def retry_refused(b: PlanBuilder, condition: str) -> None:
    """Try a refused object again (RBAC, a quota, a conflict) after a wait that grows with how
    long `condition` has been False for it, within `APPLY_RETRY_SECONDS`."""
    low, high = APPLY_RETRY_SECONDS
    b.requeue(min(high, max(low, b.waited(b.since(condition, "False")) / 2)))


def after(when: datetime, seconds: float) -> datetime:
    """`when` plus `seconds`, however large the number a spec asks for."""
    try:
        return when + timedelta(seconds=seconds)
    except OverflowError:
        return LATEST


def failures_in_a_row(status: RLHFJobStatus) -> int:
    """Failed attempts since the trainer last trained a step, the newest failure included.

    The attempt that failed into restart record `i` is the one record `i - 1` started (the
    job's first attempt for `i == 0`); it trained if the operator saw it finish a step past its
    checkpoint (`resumedTime`; for the first attempt, any step). Resizes are not failures.
    """
    history = status.restart_history
    count = 0
    for index in range(len(history) - 1, -1, -1):
        if history[index].reason == RestartReason.TRAINER_RESIZED:
            continue
        if index > 0:
            trained = history[index - 1].resumed_time is not None
        else:
            trained = bool(status.current_step)
        if trained:
            break
        count += 1
    return count


def restart_delay(job: RLHFJob, status: RLHFJobStatus) -> float:
    """Seconds between a restart's decision and its submission: none after an attempt that
    trained (a killed driver, a lost node: its actors or checkpoint are waiting, and waiting
    helps nothing), the doubling backoff after attempts that failed before their first step (a
    start that keeps failing, where something outside may need time)."""
    return backoff_seconds(job, failures_in_a_row(status))


def backoff_seconds(job: RLHFJob, restarts: int) -> float:
    """Exponential backoff before the `restarts`-th failure in a row (1-based), capped."""
    recovery = job.spec.recovery
    if restarts <= 0:
        return 0.0
    doubled = recovery.backoff_seconds * 2 ** min(restarts - 1, 64)
    return float(min(doubled, recovery.max_backoff_seconds))
