"""The trainer's Ray job: submit it (after its backoff, with every rank it needs), follow
it, and tell a hung or stalled trainer from a slow one.
"""

from __future__ import annotations

from rlhf_operator.lifecycle import scaling, shared
from rlhf_operator.lifecycle.builder import PlanBuilder
from rlhf_operator.lifecycle.plan import (
    DASHBOARD_REACHABLE,
    DRAINING,
    HEALTHY,
    TRAINER,
    TRAINER_RUNNING,
    ClearStopRequest,
    StopRayJob,
    SubmitRayJob,
)
from rlhf_operator.lifecycle.shared import after, restart_delay
from rlhf_operator.views import RayJobView
from rlhfjob.api import Phase
from rlhfjob.contract import (
    EXIT_GRACE_SECONDS,
    PHASE_EXITING,
    EventReason,
    ExitCode,
    FailureReason,
    FinalStatus,
    RestartReason,
)

SUBMIT_RETRY_SECONDS = 5.0


def follow_ray_job(b: PlanBuilder) -> None:
    """Judge this attempt's Ray job: submit it, watch it run, end or restart on its verdict."""
    ray_job = b.seen.ray_job
    if ray_job is not None and ray_job.submission_id != b.attempt_id():
        ray_job = None  # an earlier attempt's job: not this attempt's business
    if ray_job is None and b.status.submission_id == b.attempt_id():
        # Submitted, yet Ray has never heard of it: the head restarted with a fresh GCS.
        shared.recreate_cluster(
            b,
            RestartReason.HEAD_LOST,
            f"the Ray head no longer knows the trainer's job {b.attempt_id()} (the head restarted)",
            last_alive=b.status.last_heartbeat_time,
        )
        return
    if ray_job is None:
        submit(b)
        return
    if ray_job.status == "PENDING":
        # Ray is still setting the driver up: nothing of the trainer's to judge yet.
        b.enter(Phase.RUNNING, "trainer starting", reason=EventReason.RUNNING)
        b.condition(TRAINER_RUNNING, False, "Pending", ray_job.message)
        return
    if ray_job.status == "RUNNING":
        # Set first, so that a new condition's transition time marks when the driver started.
        b.condition(TRAINER_RUNNING, True, EventReason.RUNNING)
        if trainer_unresponsive(b, ray_job):
            return
        if scaling.trainer_pods_back(b):
            scaling.grow_back(b)
            return
        shortfall = scaling.elastic_shortfall(b)
        scaling.show_degraded(b, shortfall)
        message = progress_message(b)
        if shortfall:
            message += f" (degraded: {shortfall})"
        b.enter(Phase.RUNNING, message, reason=EventReason.RUNNING)
        return
    if ray_job.status == "SUCCEEDED":
        shared.finish(b, Phase.SUCCEEDED, EventReason.SUCCEEDED, "training finished")
        return
    # FAILED, or STOPPED by someone else: the trainer is gone.
    summary = trainer_failure_summary(ray_job.message) or f"the Ray job is {ray_job.status}"
    b.condition(TRAINER_RUNNING, False, "TrainerExited", summary)
    if ray_job.exit_code == ExitCode.NON_RETRYABLE:
        shared.finish(b, Phase.FAILED, FailureReason.NON_RETRYABLE, summary)
        return
    lost = scaling.roles_below_minimum(b, include_elastic=False)
    if lost:
        shared.restart(
            b, RestartReason.TRAINER_POD_LOST, f"{lost}; {summary}", last_alive=ray_job.ended
        )
    else:
        shared.restart(b, RestartReason.TRAINER_FAILED, summary, last_alive=ray_job.ended)


def trainer_unresponsive(b: PlanBuilder, ray_job: RayJobView) -> bool:
    """Hung (no heartbeat) or stalled (heartbeats, no progress): stop it and restart."""
    liveness = b.job.spec.liveness
    beat = b.current_heartbeat()
    if beat is None:
        # No heartbeat yet: model loading may take a while, so allow the progress timeout
        # from when the driver started running.
        running = b.current(TRAINER_RUNNING)
        since = running.last_transition_time if running and running.status == "True" else None
        if since is None:
            return False
        silent = (b.seen.now - since).total_seconds()
        if silent < liveness.progress_timeout_seconds:
            b.requeue(liveness.progress_timeout_seconds - silent)
            return False
        b.condition(HEALTHY, False, "NoHeartbeat", f"no heartbeat for {silent:.0f}s")
        b.act(StopRayJob(ray_job.submission_id))
        shared.restart(b, RestartReason.TRAINER_HUNG,
                     f"no heartbeat since it was submitted {silent:.0f}s ago",
                     last_alive=since)  # fmt: skip
        return True
    stale = (b.seen.now - beat.renewed).total_seconds()
    # A driver that said it is leaving gets a grace for its exit and Ray's verdict.
    exiting = beat.phase == PHASE_EXITING
    allowed = liveness.heartbeat_timeout_seconds + (EXIT_GRACE_SECONDS if exiting else 0)
    if stale > allowed:
        evidence = f"last heartbeat {stale:.0f}s ago at step {beat.step}"
        if exiting:
            evidence += ", after it said it was exiting"
        b.condition(HEALTHY, False, "HeartbeatTimeout", evidence)
        b.act(StopRayJob(ray_job.submission_id))
        shared.restart(b, RestartReason.TRAINER_HUNG, evidence, last_alive=beat.renewed)
        return True
    if beat.step_changed is not None:
        idle = (b.seen.now - beat.step_changed).total_seconds()
        if idle > liveness.progress_timeout_seconds:
            evidence = f"heartbeats continue but step {beat.step} has not advanced for {idle:.0f}s"
            b.condition(HEALTHY, False, "ProgressTimeout", evidence)
            b.act(StopRayJob(ray_job.submission_id))
            shared.restart(b, RestartReason.TRAINER_STALLED, evidence, last_alive=beat.step_changed)
            return True
    # Not "renewed Ns ago": a message that changes on every reconcile is a write each time
    # (the renewal itself is status.lastHeartbeatTime).
    b.condition(HEALTHY, True, "Heartbeating", f"step {beat.step}")
    b.requeue(allowed - stale + 0.5)
    return False


def submit(b: PlanBuilder) -> None:
    """Submit this attempt's trainer, once the previous one is gone, its backoff has passed and
    every rank it needs has a Ready pod."""
    previous = b.seen.previous_ray_job
    if previous is not None and previous.active:
        # Never two drivers at once: the stopped attempt must be gone first.
        b.act(StopRayJob(previous.submission_id))
        b.status.message = f"waiting for the previous trainer {previous.submission_id} to stop"
        b.requeue(1)
        return
    history = b.status.restart_history
    if history and history[-1].reason != RestartReason.TRAINER_RESIZED:
        due = after(history[-1].time, restart_delay(b.job, b.status))
        if b.seen.now < due:
            b.requeue((due - b.seen.now).total_seconds())
            return
    missing = scaling.roles_below_minimum(b)
    replicas = scaling.elastic_trainer(b) if missing else None
    if missing and (replicas is None or scaling.roles_below_minimum(b, skip=TRAINER)):
        # The ZeRO-3 group needs all its ranks; submitting now would only queue actors.
        b.status.message = f"waiting for Ray pods before starting the trainer: {missing}"
        b.status.message += scaling.elastic_hint(b)
        b.requeue(2)
        return
    if b.seen.submit_error is not None:
        # Ray refused it or did not answer: nothing was submitted. Say why, retry soon.
        b.status.message = f"could not submit the trainer: {b.seen.submit_error}"
        b.condition(DASHBOARD_REACHABLE, False, "SubmitFailed", b.seen.submit_error)
        b.requeue(SUBMIT_RETRY_SECONDS)
        return
    # The trainer's disk is the truth: any restart asks for the newest complete checkpoint,
    # even one the Lease never reported ("latest" starts from step 0 when there is none).
    drained = b.current(DRAINING) is not None
    resume = b.status.last_checkpoint is not None or b.status.restart_count > 0 or drained
    if b.seen.heartbeat is not None and b.seen.heartbeat.stop_requested_at is not None:
        b.act(ClearStopRequest())  # an old drain's request: the new driver must not obey
    b.act(SubmitRayJob(b.attempt_id(), resume=resume, trainer_replicas=replicas))
    b.status.submission_id = b.attempt_id()
    b.status.trainer_replicas = replicas
    if replicas is not None:
        desired = b.job.spec.roles.trainer.replicas
        b.event(
            "Warning",
            EventReason.DEGRADED,
            f"the trainer starts on {replicas} of {desired} replicas: its lost pods were not"
            f" replaced within {b.job.spec.roles.trainer.replacement_timeout_seconds}s",
        )
    if b.status.phase != Phase.RUNNING:
        b.enter(Phase.RUNNING, "trainer submitted", reason=EventReason.SUBMITTED)
    b.condition(TRAINER_RUNNING, False, EventReason.SUBMITTED, b.attempt_id())


def progress_message(b: PlanBuilder) -> str:
    """`training: step N/M`, the phase message of a running job."""
    step, total = b.status.current_step, b.status.total_steps
    if step is None:
        return "training"
    return f"training: step {step}/{total}" if total else f"training: step {step}"


def trainer_failure_summary(message: str, limit: int = 300) -> str:
    """What a failed Ray job says about why, in a line: the driver's final status if present."""
    final = FinalStatus.parse(message)
    if final is not None:
        return f"{final.reason}: {final.message}"[:limit] if final.message else final.reason
    first = message.strip().splitlines()[0] if message.strip() else ""
    return first.split(", last available logs")[0][:limit]
