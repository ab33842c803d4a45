"""What the trainer reported through its Lease, into the status: step, progress, checkpoint,
when a recovery ended; and since when the trainer has been short of pods.
"""

from __future__ import annotations

from rlhf_operator import progress
from rlhf_operator.lifecycle.builder import PlanBuilder
from rlhf_operator.lifecycle.plan import (
    TRAINER,
)
from rlhf_operator.views import HeartbeatView
from rlhfjob import contract
from rlhfjob.api import CheckpointRef, EvaluationResult, ExportRef
from rlhfjob.contract import EventReason


def record_heartbeat(b: PlanBuilder) -> None:
    """This attempt's Lease report into the status: step, progress, the newest checkpoint."""
    beat = b.seen.heartbeat
    if beat is None or (beat.attempt is not None and beat.attempt != b.status.restart_count):
        return
    b.status.last_heartbeat_time = beat.renewed
    previous_step = b.status.current_step
    if beat.step is not None:
        b.status.current_step = beat.step
    if beat.total_steps is not None:
        b.status.total_steps = beat.total_steps
    b.status.progress = progress.advance(
        b.status.progress, previous_step, beat, b.status.total_steps
    )
    note_resumed(b, beat)
    if beat.checkpoint_step is not None and beat.checkpoint_path:
        known = b.status.last_checkpoint
        if known is None or known.step != beat.checkpoint_step:
            b.status.last_checkpoint = CheckpointRef(
                step=beat.checkpoint_step, path=beat.checkpoint_path, time=beat.renewed
            )
    record_research(b, beat)


def record_research(b: PlanBuilder, beat: HeartbeatView) -> None:
    """The latest held-out evaluation, the export, and trackers that lost metrics: into the
    status and Events. An export path outside the job's own places is not believed (a job's
    pods write its Lease)."""
    known = b.status.evaluation
    if beat.eval_step is not None and (known is None or known.step != beat.eval_step):
        b.status.evaluation = EvaluationResult(
            step=beat.eval_step,
            score=beat.eval_score,
            accuracy=beat.eval_accuracy,
            pass_at_k=beat.eval_pass_at_k,
            time=beat.renewed,
        )
        figures = ", ".join(
            f"{name} {value:.3f}"
            for name, value in (
                ("score", beat.eval_score),
                ("accuracy", beat.eval_accuracy),
                ("pass@k", beat.eval_pass_at_k),
            )
            if value is not None
        )
        b.event("Normal", EventReason.EVALUATED, f"held-out at step {beat.eval_step}: {figures}")
    exported = b.status.export
    if (
        beat.export_step is not None
        and beat.export_path
        and contract.is_job_output(b.job, beat.export_path)
        and (
            exported is None
            or (exported.step, exported.path) != (beat.export_step, beat.export_path)
        )
    ):
        b.status.export = ExportRef(step=beat.export_step, path=beat.export_path, time=beat.renewed)
        b.event("Normal", EventReason.EXPORTED, f"step {beat.export_step} at {beat.export_path}")
    failures = beat.tracking_failures or 0
    if failures > b.status.tracking_failures:
        b.status.tracking_failures = failures
        b.event(
            "Warning",
            EventReason.TRACKING_UNAVAILABLE,
            f"{failures} calls to experiment trackers given up so far; training goes on "
            "(the step log and TensorBoard files keep every metric)",
        )


def note_trainer_pods(b: PlanBuilder) -> None:
    """Since when the trainer has had fewer Ready pods than replicas: an elastic trainer's
    replacement timeout counts from then."""
    cluster = b.seen.cluster
    if cluster is not None and not cluster.pods_read:
        return  # unknown this time: keep what the last reading said
    view = cluster.roles.get(TRAINER) if cluster is not None else None
    if view is None or view.ready >= view.desired:
        b.status.trainer_short_since = None
    elif b.status.trainer_short_since is None:
        b.status.trainer_short_since = b.seen.now


def note_resumed(b: PlanBuilder, beat: HeartbeatView) -> None:
    """The first step the restarted trainer finishes past its checkpoint ends a recovery."""
    history = b.status.restart_history
    if not history or history[-1].resumed_time is not None or beat.step is None:
        return
    last = history[-1]
    if beat.step <= (last.resumed_from_step or 0):
        return
    resumed = beat.step_changed or beat.renewed
    history[-1] = last.model_copy(update={"resumed_time": resumed})
    took = (resumed - last.failure_time).total_seconds()
    message = f"training resumed: step {beat.step}, {took:.0f}s after the {last.reason} failure"
    b.event("Normal", EventReason.RESUMED, message)
