"""A job's end: what follows a terminal phase (release, Kueue, the TTL), and the active deadline."""

from __future__ import annotations

from datetime import datetime

from rlhf_operator.lifecycle import shared
from rlhf_operator.lifecycle.builder import PlanBuilder
from rlhf_operator.lifecycle.plan import (
    DeleteCluster,
    DeleteJob,
    FinishWorkload,
)
from rlhf_operator.lifecycle.shared import after
from rlhfjob.api import Phase
from rlhfjob.contract import FailureReason


def after_finish(b: PlanBuilder) -> None:
    """A terminal phase stays: release what is left, finish the Workload, delete after the TTL."""
    if b.seen.cluster and not b.seen.cluster.deleting:
        b.act(DeleteCluster(f"job {b.status.phase.value.lower()}"))
    workload = b.seen.workload
    if workload is not None and not workload.finished and b.cluster_gone():
        succeeded = b.status.phase == Phase.SUCCEEDED
        b.act(FinishWorkload(succeeded, b.status.message))
    ttl = b.job.spec.ttl_seconds_after_finished
    if ttl is None or b.status.completion_time is None:
        return
    due = after(b.status.completion_time, ttl)
    if b.seen.now >= due:
        b.act(DeleteJob())
    else:
        b.requeue((due - b.seen.now).total_seconds())


def deadline(b: PlanBuilder) -> datetime | None:
    """When `activeDeadlineSeconds` runs out (counted from the first start); None: never."""
    seconds, started = b.job.spec.active_deadline_seconds, b.status.start_time
    return None if seconds is None or started is None else shared.after(started, seconds)


def deadline_passed(b: PlanBuilder) -> bool:
    """`activeDeadlineSeconds` has run out."""
    due = deadline(b)
    return due is not None and b.seen.now >= due


def fail_past_deadline(b: PlanBuilder) -> None:
    """The job ran too long: Failed, its cluster released, its checkpoints kept."""
    seconds = b.job.spec.active_deadline_seconds
    shared.finish(
        b,
        Phase.FAILED,
        FailureReason.DEADLINE_EXCEEDED,
        f"the job ran longer than activeDeadlineSeconds ({seconds}s)",
    )


def wake_at_deadline(b: PlanBuilder) -> None:
    """A running job is looked at again when its deadline comes, not at the next timer tick."""
    due = deadline(b)
    if due is not None:
        b.requeue((due - b.seen.now).total_seconds())


def breaks_policy(b: PlanBuilder) -> bool:
    """The job breaks the installation's job policy (checked at every reconcile)."""
    return bool(b.seen.policy_problems)


def fail_policy(b: PlanBuilder) -> None:
    """A running job that breaks the policy stops now, its cluster deleted, checkpoints kept:
    the pods would keep the power the policy refuses for as long as they run."""
    message = "the job breaks the job policy: " + "; ".join(b.seen.policy_problems)
    shared.finish(b, Phase.FAILED, FailureReason.INVALID_SPEC, message)
