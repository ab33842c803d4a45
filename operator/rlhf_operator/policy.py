"""The lifecycle policy: what was observed in, the next phase and actions out (decision 2).

A pure function, so every transition is a row in a table-driven test. The reconciler gathers an
`Observed` snapshot, calls `decide`, and carries out the `Plan`: server-side applies, Ray job
submissions, status patches and Events. Running it twice on the same world plans the same thing;
that, with idempotent actions, is what makes reconciliation level-triggered.

The phases, in order of a healthy job: Pending → Provisioning → Running → Succeeded. Failures of
the trainer lead to Recovering (the recovery ladder of decision 5) and, when retrying cannot help
or the restart budget is spent, to Failed. Suspended releases the cluster and keeps checkpoints.
Succeeded and Failed are terminal: nothing brings a job back from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from rlhfjob.api import (
    MAX_RESTART_HISTORY,
    CheckpointRef,
    Condition,
    Phase,
    RestartRecord,
    RLHFJob,
    RLHFJobStatus,
)
from rlhfjob.contract import ExitCode

# ---------------------------------------------------------------------------------------------
# What the reconciler saw


@dataclass(frozen=True)
class ClusterView:
    """The job's RayCluster as KubeRay reports it."""

    name: str
    created: datetime
    ready: bool
    """KubeRay's `status.state == ready` (all pods running and ready)."""
    deleting: bool = False
    dashboard: str | None = None
    """Where the operator reaches the Ray dashboard (head Service, or the local stand-in)."""


@dataclass(frozen=True)
class RayJobView:
    """The current attempt's Ray job, from the Job Submission API."""

    submission_id: str
    status: Literal["PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED"]
    message: str = ""
    exit_code: int | None = None


@dataclass(frozen=True)
class HeartbeatView:
    """The trainer's Lease: when it last renewed and what it reported."""

    renewed: datetime
    step: int | None = None
    total_steps: int | None = None
    checkpoint_step: int | None = None
    checkpoint_path: str | None = None
    attempt: int | None = None
    step_changed: datetime | None = None
    """When `step` last advanced (the trainer reports it), to tell stalled from slow."""


@dataclass(frozen=True)
class Observed:
    job: RLHFJob
    now: datetime
    created: datetime
    cluster: ClusterView | None = None
    ray_job: RayJobView | None = None
    """None: this attempt has not been submitted (the dashboard answered 404)."""
    dashboard_error: str | None = None
    """Set when the dashboard did not answer; `ray_job` is then unknown, not absent."""
    heartbeat: HeartbeatView | None = None
    scheduling_problem: str | None = None
    """The scheduler's latest FailedScheduling message for the cluster's pods."""


# ---------------------------------------------------------------------------------------------
# What to do


@dataclass(frozen=True)
class ApplyCluster:
    """Server-side apply the RayCluster, its ConfigMap and the trainer's RBAC."""


@dataclass(frozen=True)
class DeleteCluster:
    reason: str


@dataclass(frozen=True)
class SubmitRayJob:
    submission_id: str
    resume: bool


@dataclass(frozen=True)
class StopRayJob:
    submission_id: str


@dataclass(frozen=True)
class DeleteJob:
    """ttlSecondsAfterFinished has passed: delete the RLHFJob (checkpoints stay)."""


Action = ApplyCluster | DeleteCluster | SubmitRayJob | StopRayJob | DeleteJob


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class Plan:
    status: RLHFJobStatus
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    """Seconds until something time-based is due (a deadline, a backoff); None: the timer."""


# Condition types the operator maintains.
CLUSTER_READY = "ClusterReady"
TRAINER_RUNNING = "TrainerRunning"
DASHBOARD_REACHABLE = "DashboardReachable"
HEALTHY = "Healthy"
SUSPENDED = "Suspended"
COMPLETE = "Complete"
FAILED = "Failed"


def submission_id(job: RLHFJob, attempt: int) -> str:
    """Stable per (job, attempt): a retried reconcile resubmits the same id, never a duplicate."""
    uid = (job.metadata.uid or "local")[:8]
    return f"{job.metadata.name}-{uid}-{attempt}"


def backoff_seconds(job: RLHFJob, restarts: int) -> float:
    """Exponential backoff before restart number `restarts` (1-based), capped."""
    recovery = job.spec.recovery
    if restarts <= 0:
        return 0.0
    return float(min(recovery.backoff_seconds * 2 ** (restarts - 1), recovery.max_backoff_seconds))


class _Planner:
    """Builds one Plan; a class only so the steps below can share the status being edited."""

    def __init__(self, seen: Observed) -> None:
        self.seen = seen
        self.job = seen.job
        previous = seen.job.status or RLHFJobStatus()
        self.previous_phase = previous.phase
        self.spec_changed = previous.observed_generation != seen.job.metadata.generation
        self.plan = Plan(status=previous.model_copy(deep=True))

    # -- helpers -----------------------------------------------------------------------------

    @property
    def status(self) -> RLHFJobStatus:
        return self.plan.status

    def act(self, *actions: Action) -> None:
        self.plan.actions.extend(actions)

    def event(self, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.plan.events.append(Event(type_, reason, message))

    def requeue(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        if self.plan.requeue_after is None or seconds < self.plan.requeue_after:
            self.plan.requeue_after = seconds

    def condition(self, type_: str, ok: bool | None, reason: str, message: str = "") -> None:
        value: Literal["True", "False", "Unknown"] = (
            "Unknown" if ok is None else ("True" if ok else "False")
        )
        existing = next((c for c in self.status.conditions if c.type == type_), None)
        changed = existing is None or existing.status != value
        when = self.seen.now if changed or existing is None else existing.last_transition_time
        updated = Condition(
            type=type_,
            status=value,
            reason=reason,
            message=message,
            last_transition_time=when,
            observed_generation=self.job.metadata.generation,
        )
        others = [c for c in self.status.conditions if c.type != type_]
        self.status.conditions = sorted([*others, updated], key=lambda c: c.type)

    def enter(self, phase: Phase, message: str, *, reason: str | None = None) -> None:
        if phase != self.status.phase:
            warning = phase in (Phase.FAILED, Phase.RECOVERING)
            self.event("Warning" if warning else "Normal", reason or phase.value, message)
        self.status.phase = phase
        self.status.message = message

    def finish(self, phase: Phase, reason: str, message: str) -> None:
        """Enter a terminal phase: release the cluster, keep checkpoints."""
        self.enter(phase, message, reason=reason)
        self.status.completion_time = self.status.completion_time or self.seen.now
        self.condition(COMPLETE if phase == Phase.SUCCEEDED else FAILED, True, reason, message)
        self.condition(TRAINER_RUNNING, False, reason)
        if self.seen.ray_job and self.seen.ray_job.status in ("PENDING", "RUNNING"):
            self.act(StopRayJob(self.seen.ray_job.submission_id))
        if self.seen.cluster and not self.seen.cluster.deleting:
            self.act(DeleteCluster(reason))

    def attempt_id(self) -> str:
        return submission_id(self.job, self.status.restart_count)

    # -- the steps, in priority order --------------------------------------------------------

    def run(self) -> Plan:
        self.status.observed_generation = self.job.metadata.generation
        self.status.total_steps = self.job.spec.algorithm.total_steps or self.status.total_steps
        self.record_heartbeat()
        if self.status.phase.terminal:
            self.after_finish()
        elif self.job.spec.suspend:
            self.suspend()
        elif self.deadline_passed():
            pass
        else:
            self.drive()
        return self.plan

    def record_heartbeat(self) -> None:
        beat = self.seen.heartbeat
        if beat is None or (beat.attempt is not None and beat.attempt != self.status.restart_count):
            return
        self.status.last_heartbeat_time = beat.renewed
        if beat.step is not None:
            self.status.current_step = beat.step
        if beat.total_steps is not None:
            self.status.total_steps = beat.total_steps
        if beat.checkpoint_step is not None and beat.checkpoint_path:
            known = self.status.last_checkpoint
            if known is None or known.step != beat.checkpoint_step:
                self.status.last_checkpoint = CheckpointRef(
                    step=beat.checkpoint_step, path=beat.checkpoint_path, time=beat.renewed
                )

    def after_finish(self) -> None:
        if self.seen.cluster and not self.seen.cluster.deleting:
            self.act(DeleteCluster(f"job {self.status.phase.value.lower()}"))
        ttl = self.job.spec.ttl_seconds_after_finished
        if ttl is None or self.status.completion_time is None:
            return
        due = self.status.completion_time + timedelta(seconds=ttl)
        if self.seen.now >= due:
            self.act(DeleteJob())
        else:
            self.requeue((due - self.seen.now).total_seconds())

    def suspend(self) -> None:
        if self.seen.ray_job and self.seen.ray_job.status in ("PENDING", "RUNNING"):
            self.act(StopRayJob(self.seen.ray_job.submission_id))
        if self.seen.cluster and not self.seen.cluster.deleting:
            self.act(DeleteCluster("suspended"))
        self.enter(Phase.SUSPENDED, "suspended: cluster released, checkpoints kept")
        self.condition(SUSPENDED, True, "Suspended", "spec.suspend is true")
        self.condition(TRAINER_RUNNING, False, "Suspended")
        self.condition(CLUSTER_READY, False, "Suspended")

    def deadline_passed(self) -> bool:
        deadline = self.job.spec.active_deadline_seconds
        started = self.status.start_time
        if deadline is None or started is None:
            return False
        due = started + timedelta(seconds=deadline)
        if self.seen.now < due:
            self.requeue((due - self.seen.now).total_seconds())
            return False
        self.finish(
            Phase.FAILED,
            "DeadlineExceeded",
            f"the job ran longer than activeDeadlineSeconds ({deadline}s)",
        )
        return True

    def drive(self) -> None:
        if self.status.phase == Phase.SUSPENDED:
            self.condition(SUSPENDED, False, "Resumed", "spec.suspend is false")
            self.enter(Phase.PENDING, "resuming from the latest checkpoint", reason="Resumed")
        self.status.start_time = self.status.start_time or self.seen.now
        cluster = self.seen.cluster
        if cluster is None or cluster.deleting:
            self.act(ApplyCluster())
            if self.status.phase in (Phase.PENDING, Phase.PROVISIONING):
                self.enter(Phase.PROVISIONING, "creating the RayCluster", reason="Provisioning")
            self.condition(CLUSTER_READY, False, "Creating", "the RayCluster is being created")
            return
        if self.spec_changed:
            self.act(ApplyCluster())  # e.g. new replica counts of an elastic role
        self.status.ray_cluster_name = cluster.name
        if not cluster.ready:
            self.wait_for_cluster(cluster)
            return
        self.condition(CLUSTER_READY, True, "Ready", "all Ray pods are ready")
        if self.seen.dashboard_error is not None:
            self.condition(DASHBOARD_REACHABLE, False, "Unreachable", self.seen.dashboard_error)
            self.requeue(5)
            return
        self.condition(DASHBOARD_REACHABLE, True, "Reachable")
        self.status.dashboard_url = cluster.dashboard
        self.follow_ray_job()

    def wait_for_cluster(self, cluster: ClusterView) -> None:
        problem = self.seen.scheduling_problem
        detail = f": {problem}" if problem else ""
        was = next((c for c in self.status.conditions if c.type == CLUSTER_READY), None)
        unhealthy_since = (
            was.last_transition_time
            if was is not None and was.status == "False" and was.last_transition_time
            else self.seen.now
        )
        self.condition(CLUSTER_READY, False, "PodsNotReady", f"waiting for Ray pods{detail}")
        if self.status.phase in (Phase.PENDING, Phase.PROVISIONING):
            limit = self.job.spec.provisioning_timeout_seconds
            waited = (self.seen.now - cluster.created).total_seconds()
            if waited >= limit:
                self.finish(
                    Phase.FAILED,
                    "ProvisioningTimeout",
                    f"the RayCluster was not ready after {limit}s{detail}",
                )
                return
            self.enter(Phase.PROVISIONING, f"waiting for Ray pods{detail}", reason="Provisioning")
            self.requeue(limit - waited)
            return
        # It was running: KubeRay is replacing pods. Wait, then recreate the cluster.
        limit = self.job.spec.recovery.cluster_recovery_timeout_seconds
        waited = (self.seen.now - unhealthy_since).total_seconds()
        if waited >= limit:
            self.restart("ClusterUnhealthy", f"the RayCluster stayed unhealthy for {limit}s")
            self.act(DeleteCluster("cluster unhealthy past its recovery deadline"))
            return
        self.enter(Phase.RECOVERING, f"waiting for KubeRay to replace Ray pods{detail}")
        self.requeue(limit - waited)

    def follow_ray_job(self) -> None:
        ray_job = self.seen.ray_job
        if ray_job is None or ray_job.submission_id != self.attempt_id():
            self.submit()
            return
        if ray_job.status == "PENDING":
            # Ray is still setting the driver up: nothing of the trainer's to judge yet.
            self.enter(Phase.RUNNING, "trainer starting", reason="Running")
            self.condition(TRAINER_RUNNING, False, "Pending", ray_job.message)
            return
        if ray_job.status == "RUNNING":
            # Set first, so that a new condition's transition time marks when the driver started.
            self.condition(TRAINER_RUNNING, True, "Running")
            if self.trainer_unresponsive(ray_job):
                return
            self.enter(Phase.RUNNING, self.progress_message(), reason="Running")
            return
        if ray_job.status == "SUCCEEDED":
            self.finish(Phase.SUCCEEDED, "Succeeded", "training finished")
            return
        # FAILED, or STOPPED by someone else: the trainer is gone.
        self.condition(TRAINER_RUNNING, False, "TrainerExited", ray_job.message)
        if ray_job.exit_code == ExitCode.NON_RETRYABLE:
            self.finish(Phase.FAILED, "NonRetryableError", ray_job.message or "see the Ray job")
            return
        self.restart("TrainerFailed", ray_job.message or f"the Ray job is {ray_job.status}")

    def trainer_unresponsive(self, ray_job: RayJobView) -> bool:
        """Hung (no heartbeat) or stalled (heartbeats, no progress): stop it and restart."""
        liveness = self.job.spec.liveness
        beat = self.seen.heartbeat
        current = beat is not None and beat.attempt in (None, self.status.restart_count)
        if not current or beat is None:
            # No heartbeat yet: model loading may take a while, so allow the progress timeout
            # from when the driver started running.
            running = next((c for c in self.status.conditions if c.type == TRAINER_RUNNING), None)
            since = running.last_transition_time if running and running.status == "True" else None
            if since is None:
                return False
            silent = (self.seen.now - since).total_seconds()
            if silent < liveness.progress_timeout_seconds:
                self.requeue(liveness.progress_timeout_seconds - silent)
                return False
            self.condition(HEALTHY, False, "NoHeartbeat", f"no heartbeat for {silent:.0f}s")
            self.act(StopRayJob(ray_job.submission_id))
            self.restart("TrainerHung", f"no heartbeat since it was submitted {silent:.0f}s ago")
            return True
        stale = (self.seen.now - beat.renewed).total_seconds()
        if stale > liveness.heartbeat_timeout_seconds:
            evidence = f"last heartbeat {stale:.0f}s ago at step {beat.step}"
            self.condition(HEALTHY, False, "HeartbeatTimeout", evidence)
            self.act(StopRayJob(ray_job.submission_id))
            self.restart("TrainerHung", evidence)
            return True
        if beat.step_changed is not None:
            idle = (self.seen.now - beat.step_changed).total_seconds()
            if idle > liveness.progress_timeout_seconds:
                evidence = (
                    f"heartbeats continue but step {beat.step} has not advanced for {idle:.0f}s"
                )
                self.condition(HEALTHY, False, "ProgressTimeout", evidence)
                self.act(StopRayJob(ray_job.submission_id))
                self.restart("TrainerStalled", evidence)
                return True
        self.condition(HEALTHY, True, "Heartbeating", f"step {beat.step}, renewed {stale:.0f}s ago")
        self.requeue(liveness.heartbeat_timeout_seconds - stale + 0.5)
        return False

    def submit(self) -> None:
        restarts = self.status.restart_count
        if restarts and self.status.restart_history:
            due = self.status.restart_history[-1].time + timedelta(
                seconds=backoff_seconds(self.job, restarts)
            )
            if self.seen.now < due:
                self.requeue((due - self.seen.now).total_seconds())
                return
        resume = self.status.last_checkpoint is not None
        self.act(SubmitRayJob(self.attempt_id(), resume=resume))
        if self.status.phase != Phase.RUNNING:
            self.enter(Phase.RUNNING, "trainer submitted", reason="Submitted")
        self.condition(TRAINER_RUNNING, False, "Submitted", self.attempt_id())

    def restart(self, reason: str, message: str) -> None:
        """Climb the recovery ladder one rung, or fail when the budget is spent."""
        budget = self.job.spec.recovery.max_restarts
        if self.status.restart_count >= budget:
            self.finish(Phase.FAILED, "RestartsExhausted", f"{message} (after {budget} restarts)")
            return
        checkpoint = self.status.last_checkpoint
        record = RestartRecord(
            time=self.seen.now,
            reason=reason,
            message=message[:1000],
            resumed_from_step=checkpoint.step if checkpoint else None,
        )
        self.status.restart_count += 1
        self.status.restart_history = [*self.status.restart_history, record][-MAX_RESTART_HISTORY:]
        resumed = f"step {checkpoint.step}" if checkpoint else "the start"
        self.enter(
            Phase.RECOVERING,
            f"restart {self.status.restart_count}/{budget} from {resumed}: {message}",
            reason=reason,
        )
        self.requeue(backoff_seconds(self.job, self.status.restart_count))

    def progress_message(self) -> str:
        step, total = self.status.current_step, self.status.total_steps
        if step is None:
            return "training"
        return f"training: step {step}/{total}" if total else f"training: step {step}"


def decide(seen: Observed) -> Plan:
    """The next status and actions for one job."""
    return _Planner(seen).run()
