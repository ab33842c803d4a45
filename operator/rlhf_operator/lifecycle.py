"""The lifecycle policy: what was observed in, the next phase and actions out (decision 2).

A pure function, so every transition is a row in a table-driven test. The reconciler gathers an
`Observed` snapshot (`views`), calls `decide`, and carries out the `Plan`: server-side applies,
Ray job submissions, status patches and Events. What happens while carrying it out (a submission
that fails) is observed and decided again, never patched into a plan. Running it twice on the
same world plans the same thing; that, with idempotent actions, is what makes reconciliation
level-triggered.

The phases, in order of a healthy job: Pending → Provisioning → Running → Succeeded. Failures of
the trainer lead to Recovering (the recovery ladder of decision 5) and, when retrying cannot help
or the restart budget is spent, to Failed. Suspended releases the cluster and keeps checkpoints.
Succeeded and Failed are terminal: nothing brings a job back from them.

What keeps a cluster from coming up shows on the job one way, whoever says it: the ClusterReady
condition's reason names the kind of cause (`ApplyRefused`, `ClusterRejected`,
`PodCreationFailed`, `Unschedulable`, `ContainersNotStarting`) and its message, like the job's,
quotes the cause in its source's own words. A cause retrying cannot fix fails the job at once
(an object the API server or KubeRay refused) or after `PERMANENT_FAILURE_GRACE_SECONDS` (pods
refused by Pod Security or validation); any other cause, the kubelet's included (it retries a
missing Secret itself), is waited out until `provisioningTimeoutSeconds`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel

from rlhf_operator import progress
from rlhf_operator.names import submission_id
from rlhf_operator.queueing import queue_name
from rlhf_operator.views import ApplyRefusal, ClusterView, HeartbeatView, Observed, RayJobView
from rlhfjob.api import (
    MAX_RESTART_HISTORY,
    CheckpointRef,
    Condition,
    ConditionType,
    ElasticRoleSpec,
    Phase,
    RestartRecord,
    RLHFJob,
    RLHFJobStatus,
)
from rlhfjob.contract import (
    EXIT_GRACE_SECONDS,
    PHASE_EXITING,
    EventReason,
    ExitCode,
    FailureReason,
    FinalStatus,
    RestartReason,
)

TRAINER = "trainer"
"""The trainer's role (its worker group's name)."""

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
    trainer_replicas: int | None = None
    """An elastic trainer started on fewer replicas than the spec's; None: all."""


@dataclass(frozen=True)
class StopRayJob:
    submission_id: str


@dataclass(frozen=True)
class DeleteJob:
    """ttlSecondsAfterFinished has passed: delete the RLHFJob (checkpoints stay)."""


@dataclass(frozen=True)
class RequestStop:
    """Ask the trainer, through its Lease, to checkpoint its step and exit (a drain)."""

    at: datetime


@dataclass(frozen=True)
class ClearStopRequest:
    """The drain is over: take the request off the Lease, so no later driver obeys it."""


@dataclass(frozen=True)
class ApplyWorkload:
    """Create the queued job's Kueue Workload: its pod sets, queue and priority."""


@dataclass(frozen=True)
class SetWorkloadActive:
    """`spec.suspend` changed: Kueue keeps an inactive Workload out of its queue."""

    active: bool


@dataclass(frozen=True)
class ReleaseQuota:
    """Every pod of the job is gone: clear the Workload's quota reservation (Kueue requeues an
    evicted Workload, so the job runs again when it fits)."""


@dataclass(frozen=True)
class SetPodsReady:
    """Tell Kueue whether every group of the admitted job is ready (its `waitForPodsReady`)."""

    ready: bool


@dataclass(frozen=True)
class FinishWorkload:
    """The job ended and its pods are gone: Kueue frees the quota for good."""

    succeeded: bool
    message: str


Action = (
    ApplyCluster
    | DeleteCluster
    | SubmitRayJob
    | StopRayJob
    | DeleteJob
    | RequestStop
    | ClearStopRequest
    | ApplyWorkload
    | SetWorkloadActive
    | ReleaseQuota
    | SetPodsReady
    | FinishWorkload
)


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
    dashboard_retry_at: datetime | None = None
    """Set while the dashboard does not answer: before then, the reconciler does not ask it
    again (it reuses the last answer); None: ask on every reconcile."""


# Condition types the operator maintains (the API lists them: `api.ConditionType`).
CLUSTER_READY = ConditionType.CLUSTER_READY.value
TRAINER_RUNNING = ConditionType.TRAINER_RUNNING.value
DASHBOARD_REACHABLE = ConditionType.DASHBOARD_REACHABLE.value
HEALTHY = ConditionType.HEALTHY.value
SUSPENDED = ConditionType.SUSPENDED.value
COMPLETE = ConditionType.COMPLETE.value
FAILED = ConditionType.FAILED.value
DEGRADED = ConditionType.DEGRADED.value
DRAINING = ConditionType.DRAINING.value
ADMITTED = ConditionType.ADMITTED.value

DRAIN_POLL_SECONDS = 2.0
"""How often a draining job looks whether its trainer has stopped (it checkpoints meanwhile)."""

# ClusterReady reasons while the cluster is not ready: the kind of cause the message quotes.
CREATING = "Creating"
APPLY_REFUSED = "ApplyRefused"
"""The API server refused an object for now (403: RBAC or a quota; 409): retried."""
CLUSTER_REJECTED = FailureReason.CLUSTER_REJECTED.value
"""The API server (400, 422) or KubeRay's validation refused the RayCluster or an object of
the job: the job fails."""
POD_CREATION_FAILED = FailureReason.POD_CREATION_FAILED.value
"""KubeRay could not create a pod (its Warning Event on the RayCluster)."""
UNSCHEDULABLE = "Unschedulable"
"""A pod exists but the scheduler cannot place it."""
CONTAINERS_NOT_STARTING = "ContainersNotStarting"
"""A pod is placed but the kubelet cannot start a container (a missing Secret, an image pull)."""
PODS_NOT_READY = "PodsNotReady"
"""No cause known: the pods are starting."""

SUBMIT_RETRY_SECONDS = 5.0
DASHBOARD_RETRY_SECONDS = (5.0, 60.0)
"""The wait between asking a dashboard that does not answer, first and at most: it doubles from
the first to the second, counted from when it stopped answering (`dashboard_retry_at`)."""
APPLY_RETRY_SECONDS = (2.0, 60.0)
"""The wait before applying a refused object again grows with how long it has been refused,
within these bounds (the operator's timer re-reads the world meanwhile anyway)."""
PERMANENT_FAILURE_GRACE_SECONDS = 60.0
"""How long a pod refusal that retrying cannot fix (Pod Security, an invalid pod) may persist
before the job fails: time for a quick fix of the namespace, short enough to see it fail."""
_LATEST = datetime.max.replace(tzinfo=UTC)
MESSAGE_LIMIT = 4096
"""The most of a message the status keeps (of a condition or the job): the API's limits are
higher, but what says why fits here."""
REASON_LIMIT = 1024
"""A condition reason's limit in the API."""


def _trim(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _after(when: datetime, seconds: float) -> datetime:
    """`when` plus `seconds`, however large the number a spec asks for."""
    try:
        return when + timedelta(seconds=seconds)
    except OverflowError:
        return _LATEST


def _aware(value: Any) -> Any:
    """`value` with every naive datetime in it read as UTC (what the client sometimes returns):
    comparing naive with aware times raises, and `decide` must not."""
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    if isinstance(value, BaseModel):
        changes = {}
        for name in type(value).model_fields:
            old = getattr(value, name, None)
            if (new := _aware(old)) is not old:
                changes[name] = new
        return value.model_copy(update=changes) if changes else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for item in dataclasses.fields(value):
            old = getattr(value, item.name)
            if (new := _aware(old)) is not old:
                changes[item.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    if isinstance(value, list):
        items = [_aware(item) for item in value]
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    if isinstance(value, dict):
        entries = {key: _aware(item) for key, item in value.items()}
        changed = any(entries[key] is not item for key, item in value.items())
        return entries if changed else value
    return value


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
            return _after(since, offset)
        step *= 2
    capped = max(0, int((elapsed - offset) // high) + 1)
    return _after(since, offset + capped * high)


def backoff_seconds(job: RLHFJob, restarts: int) -> float:
    """Exponential backoff before restart number `restarts` (1-based), capped."""
    recovery = job.spec.recovery
    if restarts <= 0:
        return 0.0
    doubled = recovery.backoff_seconds * 2 ** min(restarts - 1, 64)
    return float(min(doubled, recovery.max_backoff_seconds))


class _Planner:
    """Builds one Plan; a class only so the steps below can share the status being edited."""

    def __init__(self, seen: Observed) -> None:
        self.seen = seen
        self.job = seen.job
        previous = seen.job.status or RLHFJobStatus()
        self.previous_phase = previous.phase
        self.spec_changed = previous.observed_generation != seen.job.metadata.generation
        self.plan = Plan(status=previous.model_copy(deep=True))
        self.queue = queue_name(seen.job)
        """The LocalQueue of a job Kueue admits; None: the job runs without asking."""
        self.observed_conditions = {c.type: c for c in previous.conditions}
        """The conditions as the status held them before this plan: a condition that ends the
        plan with the status it had keeps its transition time, even if a step in between set
        it otherwise (e.g. DashboardReachable True, then False again for a refused submission),
        so an unchanged world writes nothing."""

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

    def condition(self, type_: str, ok: bool | None, reason: str, message: str = "") -> bool:
        """Set a condition; True when its status changed (or it is new)."""
        value: Literal["True", "False", "Unknown"] = (
            "Unknown" if ok is None else ("True" if ok else "False")
        )
        existing = self.current(type_)
        changed = existing is None or existing.status != value
        when = self.seen.now if changed or existing is None else existing.last_transition_time
        observed = self.observed_conditions.get(type_)
        if observed is not None and observed.status == value and observed.last_transition_time:
            when = observed.last_transition_time
        updated = Condition(
            type=type_,
            status=value,
            reason=_trim(reason, REASON_LIMIT),
            message=_trim(message, MESSAGE_LIMIT),
            last_transition_time=when,
            observed_generation=self.job.metadata.generation,
        )
        others = [c for c in self.status.conditions if c.type != type_]
        self.status.conditions = sorted([*others, updated], key=lambda c: c.type)
        return changed

    def current(self, type_: str) -> Condition | None:
        """The condition of that type as this plan has it so far, if any."""
        return next((c for c in self.status.conditions if c.type == type_), None)

    def forget_condition(self, type_: str) -> None:
        """Drop a condition, so that the next `condition` of that type starts its own clock."""
        self.status.conditions = [c for c in self.status.conditions if c.type != type_]
        self.observed_conditions.pop(type_, None)

    def waited(self, since: datetime) -> float:
        """Seconds from `since` to now (0 when `since` is in the future)."""
        return max(0.0, (self.seen.now - since).total_seconds())

    def since(self, type_: str, status: str) -> datetime:
        """When condition `type_` took `status`; now when it does not have it (yet)."""
        found = self.current(type_)
        if found is None or found.status != status or found.last_transition_time is None:
            return self.seen.now
        return found.last_transition_time

    def enter(self, phase: Phase, message: str, *, reason: str | None = None) -> None:
        message = _trim(message, MESSAGE_LIMIT)
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
        if self.current(DEGRADED) is not None:
            self.condition(DEGRADED, False, reason)
        if self.seen.ray_job and self.seen.ray_job.active:
            self.act(StopRayJob(self.seen.ray_job.submission_id))
        if self.seen.cluster and not self.seen.cluster.deleting:
            self.act(DeleteCluster(reason))

    def attempt_id(self) -> str:
        return submission_id(self.job, self.status.restart_count)

    def current_heartbeat(self) -> HeartbeatView | None:
        """The Lease's report if this attempt's live driver wrote it: not an earlier attempt's,
        and not the last renewal of a driver a drain stopped (the same attempt runs again after
        a suspend, and the Lease keeps what the stopped driver wrote)."""
        beat = self.seen.heartbeat
        if beat is None or beat.attempt not in (None, self.status.restart_count):
            return None
        drain = self.current(DRAINING)
        ended = drain.last_transition_time if drain and drain.status == "False" else None
        if ended is not None and beat.renewed <= ended:
            return None
        return beat

    # -- the steps, in priority order --------------------------------------------------------

    def run(self) -> Plan:
        refused = self.seen.apply_error
        if refused is None or refused.permanent:
            # A refused change is not observed yet: the spec still differs, so it is retried.
            self.status.observed_generation = self.job.metadata.generation
        self.status.total_steps = self.job.spec.algorithm.total_steps or self.status.total_steps
        self.record_heartbeat()
        self.note_trainer_pods()
        workload = self.seen.workload
        if self.status.phase.terminal:
            self.after_finish()
        elif self.queue is not None and workload is None:
            self.enqueue()
        elif self.job.spec.suspend or self.draining() == EventReason.DRAINING:
            self.suspend()
        elif workload is not None and (
            self.draining() == EventReason.PREEMPTED or not workload.running_allowed
        ):
            self.wait_for_admission()
        elif self.draining() == EventReason.NODE_DRAINED or self.seen.drained_nodes:
            self.move_off_drained_nodes()
        elif self.draining() == EventReason.RESIZING:
            self.grow_back()
        elif self.deadline_passed():
            pass
        else:
            self.drive()
        if workload is not None and not self.status.phase.terminal:
            self.follow_workload()
        self.status.message = _trim(self.status.message, MESSAGE_LIMIT)
        return self.plan

    def record_heartbeat(self) -> None:
        beat = self.seen.heartbeat
        if beat is None or (beat.attempt is not None and beat.attempt != self.status.restart_count):
            return
        self.status.last_heartbeat_time = beat.renewed
        previous_step = self.status.current_step
        if beat.step is not None:
            self.status.current_step = beat.step
        if beat.total_steps is not None:
            self.status.total_steps = beat.total_steps
        self.status.progress = progress.advance(
            self.status.progress, previous_step, beat, self.status.total_steps
        )
        self.note_resumed(beat)
        if beat.checkpoint_step is not None and beat.checkpoint_path:
            known = self.status.last_checkpoint
            if known is None or known.step != beat.checkpoint_step:
                self.status.last_checkpoint = CheckpointRef(
                    step=beat.checkpoint_step, path=beat.checkpoint_path, time=beat.renewed
                )

    def note_trainer_pods(self) -> None:
        """Since when the trainer has had fewer Ready pods than replicas: an elastic trainer's
        replacement timeout counts from then."""
        cluster = self.seen.cluster
        if cluster is not None and not cluster.pods_read:
            return  # unknown this time: keep what the last reading said
        view = cluster.roles.get(TRAINER) if cluster is not None else None
        if view is None or view.ready >= view.desired:
            self.status.trainer_short_since = None
        elif self.status.trainer_short_since is None:
            self.status.trainer_short_since = self.seen.now

    def note_resumed(self, beat: HeartbeatView) -> None:
        """The first step the restarted trainer finishes past its checkpoint ends a recovery."""
        history = self.status.restart_history
        if not history or history[-1].resumed_time is not None or beat.step is None:
            return
        last = history[-1]
        if beat.step <= (last.resumed_from_step or 0):
            return
        resumed = beat.step_changed or beat.renewed
        history[-1] = last.model_copy(update={"resumed_time": resumed})
        took = (resumed - last.failure_time).total_seconds()
        message = f"training resumed: step {beat.step}, {took:.0f}s after the {last.reason} failure"
        self.event("Normal", EventReason.RESUMED, message)

    def after_finish(self) -> None:
        if self.seen.cluster and not self.seen.cluster.deleting:
            self.act(DeleteCluster(f"job {self.status.phase.value.lower()}"))
        workload = self.seen.workload
        if workload is not None and not workload.finished and self.cluster_gone():
            succeeded = self.status.phase == Phase.SUCCEEDED
            self.act(FinishWorkload(succeeded, self.status.message))
        ttl = self.job.spec.ttl_seconds_after_finished
        if ttl is None or self.status.completion_time is None:
            return
        due = _after(self.status.completion_time, ttl)
        if self.seen.now >= due:
            self.act(DeleteJob())
        else:
            self.requeue((due - self.seen.now).total_seconds())

    def suspend(self) -> None:
        if self.drain("suspended"):
            return
        if self.seen.ray_job and self.seen.ray_job.active:
            self.act(StopRayJob(self.seen.ray_job.submission_id))
        if self.seen.cluster and not self.seen.cluster.deleting:
            self.act(DeleteCluster("suspended"))
        self.status.submission_id = None
        self.release_quota()
        self.enter(Phase.SUSPENDED, "suspended: cluster released, checkpoints kept")
        why = "spec.suspend is true" if self.job.spec.suspend else "released after a drain"
        self.condition(SUSPENDED, True, EventReason.SUSPENDED, why)
        self.condition(TRAINER_RUNNING, False, EventReason.SUSPENDED)
        self.condition(CLUSTER_READY, False, EventReason.SUSPENDED)

    def draining(self) -> str | None:
        """Why the job drains (the Draining condition's reason), while it does. A drain, once
        begun, ends with the cluster released even if its cause went away meanwhile (the
        trainer was asked to stop): the job then starts again from the drain's checkpoint."""
        found = self.current(DRAINING)
        return found.reason if found is not None and found.status == "True" else None

    def drain(self, cause: str, why: str = EventReason.DRAINING) -> bool:
        """Before a cluster is released under a training driver: ask the driver, through its
        Lease, to finish its step, checkpoint it and exit, and wait for that up to
        `checkpoint.stopGracePeriodSeconds`. True while the cluster must stay.

        Only a trainer that heartbeats can hear the request; one that has not acknowledged it
        within `liveness.heartbeatTimeoutSeconds` is not listening (hung), and is not waited for.
        """
        grace = self.job.spec.checkpoint.stop_grace_period_seconds
        ray_job = self.seen.ray_job
        cluster = self.seen.cluster
        beat = self.current_heartbeat()
        if ray_job is not None and ray_job.submission_id != self.attempt_id():
            ray_job = None  # an earlier attempt, already stopped
        asked_at = self.since(DRAINING, "True")
        # The answer to this request, not an earlier drain's (it stays on the Lease); a second
        # of slack for the time's round trip through text.
        answered = beat.checkpoint_requested_at if beat is not None else None
        heard = answered is not None and answered >= asked_at - timedelta(seconds=1)
        if ray_job is None or not ray_job.active or cluster is None or cluster.deleting:
            if self.draining():
                done = "the trainer stopped"
                if heard and beat is not None and beat.checkpoint_saved_step is not None:
                    done += f" after checkpointing step {beat.checkpoint_saved_step}"
                self.end_drain(EventReason.DRAINED, "Normal", f"{cause}: {done}")
            return False
        if not self.draining():
            if grace == 0 or ray_job.status != "RUNNING" or beat is None:
                return False  # no step under way, no grace to save it in, or nobody listening
            self.act(RequestStop(self.seen.now))
            asked = (
                f"{cause}: the trainer finishes step {(self.status.current_step or 0) + 1} and "
                f"checkpoints it before its cluster is released (up to {grace}s)"
            )
            self.condition(DRAINING, True, why, asked)
            self.event("Normal", why, asked)
            self.status.message = asked
            self.requeue(DRAIN_POLL_SECONDS)
            return True
        waited = self.waited(asked_at)
        deaf = self.job.spec.liveness.heartbeat_timeout_seconds
        if not heard and waited >= deaf:
            late = f"{cause}: the trainer did not acknowledge the stop request in {deaf}s"
        elif waited >= grace:
            late = f"{cause}: the trainer did not stop within {grace}s"
        else:
            self.requeue(DRAIN_POLL_SECONDS)
            return True
        self.end_drain(EventReason.DRAIN_TIMED_OUT, "Warning", f"{late}; releasing its cluster")
        return False

    def end_drain(self, reason: str, kind: Literal["Normal", "Warning"], message: str) -> None:
        self.act(ClearStopRequest())
        self.condition(DRAINING, False, reason, message)
        self.event(kind, reason, message)

    def move_off_drained_nodes(self) -> None:
        """A trainer pod's node is being drained (its PodDisruptionBudget holds the eviction
        back): the trainer checkpoints its step, then the cluster goes, and a new one (off the
        cordoned node) resumes from that checkpoint. Not a failure: no restart is counted."""
        nodes = ", ".join(self.seen.drained_nodes) or "a trainer's node"
        if self.drain(f"{nodes} is being drained", EventReason.NODE_DRAINED):
            return
        if self.seen.cluster and not self.seen.cluster.deleting:
            if self.seen.ray_job and self.seen.ray_job.active:
                self.act(StopRayJob(self.seen.ray_job.submission_id))
            self.act(DeleteCluster(f"moving off {nodes}"))
        self.status.submission_id = None  # the next cluster gets this attempt again
        self.enter(
            Phase.PROVISIONING,
            f"moving the job off {nodes} (being drained); it resumes from its checkpoint",
            reason=EventReason.NODE_DRAINED,
        )
        self.condition(TRAINER_RUNNING, False, EventReason.NODE_DRAINED)
        self.condition(CLUSTER_READY, False, EventReason.NODE_DRAINED, f"moving off {nodes}")

    def deadline_passed(self) -> bool:
        deadline = self.job.spec.active_deadline_seconds
        started = self.status.start_time
        if deadline is None or started is None:
            return False
        due = _after(started, deadline)
        if self.seen.now < due:
            self.requeue((due - self.seen.now).total_seconds())
            return False
        self.finish(
            Phase.FAILED,
            FailureReason.DEADLINE_EXCEEDED,
            f"the job ran longer than activeDeadlineSeconds ({deadline}s)",
        )
        return True

    def leave_suspension(self) -> None:
        if self.status.phase == Phase.SUSPENDED:
            self.condition(SUSPENDED, False, EventReason.RESUMED, "spec.suspend is false")
            self.enter(
                Phase.PENDING, "resuming from the latest checkpoint", reason=EventReason.RESUMED
            )
            self.forget_condition(CLUSTER_READY)  # a new provisioning, with its own deadline

    # -- Kueue (a job with the queue-name label) ---------------------------------------------

    def cluster_gone(self) -> bool:
        """No RayCluster and none of its pods left: the job holds no node's resources."""
        return self.seen.cluster is None and self.seen.pods_left == 0

    def enqueue(self) -> None:
        """Put the job in its queue: a Workload Kueue admits as a whole, before any pod."""
        refused = self.seen.workload_error
        if refused is not None and refused.permanent:
            self.cluster_rejected(refused.text)
            return
        if refused is not None:
            self.enter(Phase.PENDING, f"could not queue the job: {refused.text}")
            self.condition(ADMITTED, False, APPLY_REFUSED, refused.text)
            waited = self.waited(self.since(ADMITTED, "False"))
            low, high = APPLY_RETRY_SECONDS
            self.requeue(min(high, max(low, waited / 2)))
            return
        self.act(ApplyWorkload())
        waiting = f"queued in LocalQueue {self.queue}: waiting for Kueue to admit the job"
        self.enter(Phase.PENDING, waiting, reason=EventReason.QUEUED)
        if self.condition(ADMITTED, False, EventReason.QUEUED, waiting):
            self.event("Normal", EventReason.QUEUED, waiting)  # a new job is Pending already

    def follow_workload(self) -> None:
        """Keep the Workload's `active` in step with `spec.suspend`, and say when Kueue admitted
        the job."""
        workload = self.seen.workload
        assert workload is not None
        if workload.active == self.job.spec.suspend:
            self.act(SetWorkloadActive(not self.job.spec.suspend))
        if not workload.running_allowed or self.job.spec.suspend or self.draining():
            return
        admitted = f"admitted by ClusterQueue {workload.cluster_queue}"
        if self.condition(ADMITTED, True, EventReason.ADMITTED, admitted):
            self.event("Normal", EventReason.ADMITTED, admitted)
        cluster = self.seen.cluster
        ready = (
            cluster is not None
            and cluster.ready
            and not cluster.deleting
            and cluster.head_not_ready_since is None
            and not self.roles_below_minimum()
        )
        if workload.pods_ready != ready:
            self.act(SetPodsReady(ready))

    def wait_for_admission(self) -> None:
        """Not admitted (yet, or any more): no cluster may run. An evicted job (a preemption)
        drains like a suspended one, its cluster goes, and only when its last pod is gone does
        it give the quota back, so the preemptor never shares its GPUs; Kueue then queues it
        again, and once admitted it resumes from the drain's checkpoint."""
        workload = self.seen.workload
        assert workload is not None
        self.leave_suspension()
        eviction = workload.eviction
        if eviction is not None:
            cause = f"evicted by Kueue ({eviction.reason}): {eviction.message}".rstrip(": ")
        else:
            cause = "not admitted by Kueue"
        if self.drain(cause, EventReason.PREEMPTED):
            return
        cluster = self.seen.cluster
        if cluster is not None and not cluster.deleting:
            if self.seen.ray_job and self.seen.ray_job.active:
                self.act(StopRayJob(self.seen.ray_job.submission_id))
            self.act(DeleteCluster(cause))
        self.status.submission_id = None  # the next cluster gets this attempt again
        if cluster is not None or not self.cluster_gone():
            self.enter(
                Phase.PENDING, f"{cause}; releasing its cluster", reason=EventReason.PREEMPTED
            )
            self.condition(ADMITTED, False, eviction.reason if eviction else "Pending", cause)
            self.condition(TRAINER_RUNNING, False, EventReason.PREEMPTED)
            self.condition(CLUSTER_READY, False, EventReason.PREEMPTED, cause)
            self.requeue(DRAIN_POLL_SECONDS)
            return
        if self.release_quota():
            waiting = f"{cause}; quota given back, queued again in LocalQueue {self.queue}"
        else:
            told = workload.waiting_message or "waiting for Kueue to admit the job"
            waiting = f"queued in LocalQueue {self.queue}: {told}"
        self.enter(Phase.PENDING, waiting, reason=EventReason.QUEUED)
        self.condition(ADMITTED, False, workload.waiting_reason or EventReason.QUEUED, waiting)

    def release_quota(self) -> bool:
        """Give a stopped job's quota back, once every pod is gone; True when it does now."""
        workload = self.seen.workload
        if workload is None or not workload.quota_reserved or not self.cluster_gone():
            return False
        self.act(ReleaseQuota())
        self.event("Normal", EventReason.QUOTA_RELEASED, "every pod is gone: quota given back")
        return True

    def drive(self) -> None:
        self.leave_suspension()
        self.status.start_time = self.status.start_time or self.seen.now
        refused = self.seen.apply_error
        if refused is not None and refused.permanent:
            self.cluster_rejected(refused.text)
            return
        cluster = self.seen.cluster
        if cluster is None or cluster.deleting:
            if self.status.submission_id == self.attempt_id():
                # Gone under this attempt's trainer, and not by the operator's doing (it moves
                # to the next attempt, or forgets the submission, first): someone deleted it.
                gone = "the RayCluster was deleted under the running trainer"
                self.restart(RestartReason.HEAD_LOST, gone, self.status.last_heartbeat_time)
                if self.status.phase.terminal:
                    return
                self.condition(TRAINER_RUNNING, False, RestartReason.HEAD_LOST, gone)
            self.status.submission_id = None  # no Ray job outlives its cluster
            if refused is not None:
                self.wait_for_apply(refused)
                return
            self.act(ApplyCluster())
            if self.status.phase in (Phase.PENDING, Phase.PROVISIONING):
                self.enter(
                    Phase.PROVISIONING, "creating the RayCluster", reason=EventReason.PROVISIONING
                )
            self.condition(CLUSTER_READY, False, CREATING, "the RayCluster is being created")
            return
        if self.spec_changed and refused is None:
            self.act(ApplyCluster())  # e.g. new replica counts of an elastic role
        self.status.ray_cluster_name = cluster.name
        if not cluster.ready:
            self.wait_for_cluster(cluster)
        else:
            self.drive_ready(cluster)
        if refused is not None and not self.status.phase.terminal:
            # The cluster runs as it was; the timer's next reconcile applies the change again.
            note = f"the change of the spec is not applied yet: {refused.text}"
            if note not in self.status.message:
                self.status.message = f"{self.status.message}; {note}".lstrip("; ")

    def drive_ready(self, cluster: ClusterView) -> None:
        if cluster.head_not_ready_since is not None:
            self.wait_for_head(cluster.head_not_ready_since)
            return
        if self.head_replaced(cluster):
            return
        self.condition(CLUSTER_READY, True, "Ready", "the Ray head pod is ready")
        if self.seen.dashboard_error is not None:
            self.dashboard_unreachable(self.seen.dashboard_error)
            return
        self.condition(DASHBOARD_REACHABLE, True, "Reachable")
        self.status.dashboard_url = cluster.dashboard
        self.follow_ray_job()

    def cluster_rejected(self, cause: str) -> None:
        """The API server or KubeRay refused what the job needs: the same spec would be refused
        again, so the job fails now, quoting the refusal (no retry loop)."""
        self.condition(CLUSTER_READY, False, CLUSTER_REJECTED, cause)
        self.finish(Phase.FAILED, FailureReason.CLUSTER_REJECTED, cause)

    def pod_cause(self) -> tuple[str, str | None]:
        """Why the pods of an existing cluster are not ready: (ClusterReady reason, the cause)."""
        warning = self.seen.cluster_warning
        if warning is not None:
            return (
                CLUSTER_REJECTED if warning.spec_rejected else POD_CREATION_FAILED
            ), warning.text
        if self.seen.scheduling_problem:
            return UNSCHEDULABLE, self.seen.scheduling_problem
        if self.seen.startup_problem:
            return CONTAINERS_NOT_STARTING, self.seen.startup_problem
        return PODS_NOT_READY, None

    def wait_for_apply(self, refused: ApplyRefusal) -> None:
        """An object was refused for now (RBAC, a quota, a conflict): show it, apply it again
        soon, and give up like a cluster that never became ready."""
        waiting = f"waiting for the RayCluster: {refused.text}"
        self.await_cluster(APPLY_REFUSED, waiting, refused.text, created=None)
        if not self.status.phase.terminal:
            waited = self.waited(self.since(CLUSTER_READY, "False"))
            low, high = APPLY_RETRY_SECONDS
            self.requeue(min(high, max(low, waited / 2)))

    def wait_for_cluster(self, cluster: ClusterView) -> None:
        if cluster.head_pods > 1:
            # KubeRay's pod cache missed the head it had made (it lags after an API-server
            # restart), so it made another; with two heads it stops reconciling the cluster
            # ("Multiple head pods found") and would wait forever: a new RayCluster at once.
            message = (
                f"KubeRay made {cluster.head_pods} head pods for the RayCluster and stopped "
                "reconciling it (its pod cache lagged, as after an API-server restart)"
            )
            self.recreate_cluster(
                RestartReason.CLUSTER_UNHEALTHY, message, self.status.last_heartbeat_time
            )
            return
        reason, cause = self.pod_cause()
        warning = self.seen.cluster_warning
        if warning is not None and warning.spec_rejected:
            self.cluster_rejected(warning.text)
            return
        if warning is not None and warning.permanent:
            persisted = self.waited(warning.first_seen)
            if persisted >= PERMANENT_FAILURE_GRACE_SECONDS:
                self.condition(CLUSTER_READY, False, reason, warning.text)
                self.finish(
                    Phase.FAILED,
                    FailureReason.POD_CREATION_FAILED,
                    f"the Ray pods cannot be created ({persisted:.0f}s): {warning.text}",
                )
                return
            self.requeue(PERMANENT_FAILURE_GRACE_SECONDS - persisted)
        waiting = f"waiting for Ray pods: {cause}" if cause else "waiting for Ray pods"
        self.await_cluster(reason, waiting, cause, created=cluster.created)

    def await_cluster(
        self, reason: str, waiting: str, cause: str | None, created: datetime | None
    ) -> None:
        """Wait for a cluster that is not ready (or not created) within its deadline:
        `provisioningTimeoutSeconds` for a new one, the recovery timeout for a recreated one."""
        detail = f": {cause}" if cause else ""
        unhealthy_since = self.since(CLUSTER_READY, "False")
        self.condition(CLUSTER_READY, False, reason, waiting)
        if self.status.phase in (Phase.PENDING, Phase.PROVISIONING):
            limit = self.job.spec.provisioning_timeout_seconds
            waited = self.waited(created or unhealthy_since)
            if waited >= limit:
                self.finish(
                    Phase.FAILED,
                    FailureReason.PROVISIONING_TIMEOUT,
                    f"the RayCluster was not ready after {limit}s{detail}",
                )
                return
            self.enter(Phase.PROVISIONING, waiting, reason=EventReason.PROVISIONING)
            self.requeue(limit - waited)
            return
        # A recreated cluster: give it the recovery deadline (from when it was asked for), then
        # climb the ladder again.
        history = self.status.restart_history
        started = created or (history[-1].time if history else unhealthy_since)
        limit = self.job.spec.recovery.cluster_recovery_timeout_seconds
        since = max(unhealthy_since, started)
        waited = self.waited(since)
        if waited >= limit:
            message = f"the RayCluster stayed unhealthy for {limit}s{detail}"
            if created is None:  # nothing to delete: try again after the restart's backoff
                self.restart(RestartReason.CLUSTER_UNHEALTHY, message, last_alive=since)
                self.condition(TRAINER_RUNNING, False, RestartReason.CLUSTER_UNHEALTHY, message)
            else:
                self.recreate_cluster(RestartReason.CLUSTER_UNHEALTHY, message, last_alive=since)
            return
        self.enter(Phase.RECOVERING, waiting)
        self.requeue(limit - waited)

    def wait_for_head(self, since: datetime) -> None:
        """KubeRay reports the head pod not Ready: a probe blip, or the head (and Ray) is gone.

        Without GCS fault tolerance a new head is a new Ray cluster that has lost the trainer's
        job and every actor, so past a short grace the operator recreates the RayCluster.
        """
        waited = (self.seen.now - since).total_seconds()
        grace = self.job.spec.liveness.heartbeat_timeout_seconds
        if waited < grace:
            # The time it went, not how long ago: the same words on every reconcile, no write.
            message = f"the Ray head pod has not been ready since {since:%H:%M:%S}Z"
            self.condition(CLUSTER_READY, False, "HeadPodNotReady", message)
            self.status.message = message
            self.requeue(grace - waited)
            return
        message = f"the Ray head pod has not been ready for {waited:.0f}s"
        self.condition(CLUSTER_READY, False, "HeadPodNotReady", message)
        self.recreate_cluster(RestartReason.HEAD_LOST, message, last_alive=since)

    def head_replaced(self, cluster: ClusterView) -> bool:
        """A head pod created after the trainer started running is a new, empty Ray cluster."""
        running = self.current(TRAINER_RUNNING)
        if running is None or running.status != "True" or running.last_transition_time is None:
            return False
        if cluster.head_created is None or cluster.head_created <= running.last_transition_time:
            return False
        self.recreate_cluster(
            RestartReason.HEAD_LOST,
            f"the Ray head pod was replaced at {cluster.head_created:%H:%M:%S} while the "
            "trainer ran on the old one",
            last_alive=self.status.last_heartbeat_time,
        )
        return True

    def dashboard_unreachable(self, error: str) -> None:
        """Wait for a dashboard that does not answer, asking it less and less often (5 s, then
        up to 60 s apart: `dashboard_retry_at`); the timer's reconciles in between reuse the
        last answer. Once the trainer was submitted, a dashboard still silent at
        `clusterRecoveryTimeoutSeconds` is asked at that moment, and recreated if it is."""
        since = self.since(DASHBOARD_REACHABLE, "False")
        self.condition(DASHBOARD_REACHABLE, False, "Unreachable", error)
        retry = dashboard_retry_at(since, self.seen.now)
        if self.status.submission_id is not None:
            limit = self.job.spec.recovery.cluster_recovery_timeout_seconds
            waited = (self.seen.now - since).total_seconds()
            if waited >= limit:
                message = f"the Ray dashboard has not answered for {waited:.0f}s: {error}"
                self.recreate_cluster(RestartReason.CLUSTER_UNHEALTHY, message, last_alive=since)
                return
            deadline = _after(since, limit)
            retry = min(retry, deadline)
            self.requeue(limit - waited)  # a kick at the deadline, not the next timer tick
        self.plan.dashboard_retry_at = retry

    def follow_ray_job(self) -> None:
        ray_job = self.seen.ray_job
        if ray_job is not None and ray_job.submission_id != self.attempt_id():
            ray_job = None  # an earlier attempt's job: not this attempt's business
        if ray_job is None and self.status.submission_id == self.attempt_id():
            # Submitted, yet Ray has never heard of it: the head restarted with a fresh GCS.
            self.recreate_cluster(
                RestartReason.HEAD_LOST,
                f"the Ray head no longer knows the trainer's job {self.attempt_id()} "
                "(the head restarted)",
                last_alive=self.status.last_heartbeat_time,
            )
            return
        if ray_job is None:
            self.submit()
            return
        if ray_job.status == "PENDING":
            # Ray is still setting the driver up: nothing of the trainer's to judge yet.
            self.enter(Phase.RUNNING, "trainer starting", reason=EventReason.RUNNING)
            self.condition(TRAINER_RUNNING, False, "Pending", ray_job.message)
            return
        if ray_job.status == "RUNNING":
            # Set first, so that a new condition's transition time marks when the driver started.
            self.condition(TRAINER_RUNNING, True, EventReason.RUNNING)
            if self.trainer_unresponsive(ray_job):
                return
            if self.trainer_pods_back():
                self.grow_back()
                return
            shortfall = self.elastic_shortfall()
            self.show_degraded(shortfall)
            message = self.progress_message()
            if shortfall:
                message += f" (degraded: {shortfall})"
            self.enter(Phase.RUNNING, message, reason=EventReason.RUNNING)
            return
        if ray_job.status == "SUCCEEDED":
            self.finish(Phase.SUCCEEDED, EventReason.SUCCEEDED, "training finished")
            return
        # FAILED, or STOPPED by someone else: the trainer is gone.
        summary = trainer_failure_summary(ray_job.message) or f"the Ray job is {ray_job.status}"
        self.condition(TRAINER_RUNNING, False, "TrainerExited", summary)
        if ray_job.exit_code == ExitCode.NON_RETRYABLE:
            self.finish(Phase.FAILED, FailureReason.NON_RETRYABLE, summary)
            return
        lost = self.roles_below_minimum(include_elastic=False)
        if lost:
            self.restart(
                RestartReason.TRAINER_POD_LOST, f"{lost}; {summary}", last_alive=ray_job.ended
            )
        else:
            self.restart(RestartReason.TRAINER_FAILED, summary, last_alive=ray_job.ended)

    def roles_below_minimum(self, *, include_elastic: bool = True, skip: str = "") -> str:
        """Roles with fewer Ready pods than training needs, e.g. ``trainer 1/2 pods ready``
        (the trainer needs all: an elastic one goes on with fewer only by `elastic_trainer`)."""
        cluster = self.seen.cluster
        if cluster is None:
            return ""
        short = []
        for role, spec in self.job.spec.roles.enabled().items():
            view = cluster.roles.get(role)
            elastic = isinstance(spec, ElasticRoleSpec)
            if view is None or (elastic and not include_elastic) or role == skip:
                continue
            minimum = view.desired
            if isinstance(spec, ElasticRoleSpec):
                minimum = min(spec.effective_min_replicas, view.desired)
            if view.ready < minimum:
                short.append(f"{role} {view.ready}/{view.desired} pods ready")
        return ", ".join(short)

    def elastic_trainer(self) -> int | None:
        """Replicas an elastic trainer short of Ready pods starts on now: the Ready ones, once
        the lost pods have had `replacementTimeoutSeconds` to come back, never fewer than
        `minReplicas`. None: wait for every pod (not elastic, too few, or not yet)."""
        trainer = self.job.spec.roles.trainer
        cluster, since = self.seen.cluster, self.status.trainer_short_since
        view = cluster.roles.get(TRAINER) if cluster is not None else None
        if view is None or since is None or view.ready < trainer.effective_min_replicas:
            return None
        left = trainer.replacement_timeout_seconds - self.waited(since)
        if left > 0:
            self.requeue(left)
            return None
        return view.ready

    def trainer_pods_back(self) -> bool:
        """An elastic trainer running on fewer replicas has every pod Ready again."""
        cluster, running = self.seen.cluster, self.status.trainer_replicas
        view = cluster.roles.get(TRAINER) if cluster is not None else None
        return running is not None and view is not None and view.ready >= view.desired > running

    def grow_back(self) -> None:
        """Every trainer pod is back: the trainer checkpoints its step and stops (a drain that
        keeps the cluster), then restarts on all its replicas from that checkpoint. A resize,
        not a failure: it counts against no restart budget and waits for no backoff."""
        desired = self.job.spec.roles.trainer.replicas
        running = self.status.trainer_replicas
        if self.drain(f"every trainer pod is back ({desired}/{desired})", EventReason.RESIZING):
            return
        self.status.trainer_replicas = None
        self.status.resizes += 1
        self.restart(
            RestartReason.TRAINER_RESIZED,
            f"the trainer grows from {running} to {desired} replicas",
            last_alive=self.seen.now,
        )

    def elastic_shortfall(self) -> str:
        """Elastic roles running below their replica count, from the pods and the trainer."""
        short: list[str] = []
        running, desired = self.status.trainer_replicas, self.job.spec.roles.trainer.replicas
        if running is not None and running < desired:
            short.append(f"trainer {running}/{desired} replicas")
        cluster = self.seen.cluster
        elastic = {
            r for r, s in self.job.spec.roles.enabled().items() if isinstance(s, ElasticRoleSpec)
        }
        for role, view in sorted((cluster.roles if cluster else {}).items()):
            if role in elastic and view.ready < view.desired:
                short.append(f"{role} {view.ready}/{view.desired} pods ready")
        beat = self.current_heartbeat()
        for count, what in (
            (beat.rollout_engines if beat else None, "rollout engines"),
            (beat.reward_models if beat else None, "reward models"),
        ):
            if count is not None and count.live < count.desired:
                short.append(f"{count} {what}")
        return ", ".join(short)

    def show_degraded(self, shortfall: str) -> None:
        if shortfall:
            if self.condition(DEGRADED, True, EventReason.BELOW_REPLICAS, shortfall):
                self.event(
                    "Warning",
                    EventReason.DEGRADED,
                    f"training goes on with fewer replicas: {shortfall}",
                )
        elif self.current(DEGRADED) is not None and self.condition(
            DEGRADED, False, EventReason.ALL_REPLICAS, "every role has all its replicas"
        ):
            self.event(
                "Normal", EventReason.REPLICAS_RESTORED, "every role has all its replicas again"
            )

    def trainer_unresponsive(self, ray_job: RayJobView) -> bool:
        """Hung (no heartbeat) or stalled (heartbeats, no progress): stop it and restart."""
        liveness = self.job.spec.liveness
        beat = self.current_heartbeat()
        if beat is None:
            # No heartbeat yet: model loading may take a while, so allow the progress timeout
            # from when the driver started running.
            running = self.current(TRAINER_RUNNING)
            since = running.last_transition_time if running and running.status == "True" else None
            if since is None:
                return False
            silent = (self.seen.now - since).total_seconds()
            if silent < liveness.progress_timeout_seconds:
                self.requeue(liveness.progress_timeout_seconds - silent)
                return False
            self.condition(HEALTHY, False, "NoHeartbeat", f"no heartbeat for {silent:.0f}s")
            self.act(StopRayJob(ray_job.submission_id))
            self.restart(RestartReason.TRAINER_HUNG,
                         f"no heartbeat since it was submitted {silent:.0f}s ago",
                         last_alive=since)  # fmt: skip
            return True
        stale = (self.seen.now - beat.renewed).total_seconds()
        # A driver that said it is leaving gets a grace for its exit and Ray's verdict.
        exiting = beat.phase == PHASE_EXITING
        allowed = liveness.heartbeat_timeout_seconds + (EXIT_GRACE_SECONDS if exiting else 0)
        if stale > allowed:
            evidence = f"last heartbeat {stale:.0f}s ago at step {beat.step}"
            if exiting:
                evidence += ", after it said it was exiting"
            self.condition(HEALTHY, False, "HeartbeatTimeout", evidence)
            self.act(StopRayJob(ray_job.submission_id))
            self.restart(RestartReason.TRAINER_HUNG, evidence, last_alive=beat.renewed)
            return True
        if beat.step_changed is not None:
            idle = (self.seen.now - beat.step_changed).total_seconds()
            if idle > liveness.progress_timeout_seconds:
                evidence = (
                    f"heartbeats continue but step {beat.step} has not advanced for {idle:.0f}s"
                )
                self.condition(HEALTHY, False, "ProgressTimeout", evidence)
                self.act(StopRayJob(ray_job.submission_id))
                self.restart(RestartReason.TRAINER_STALLED, evidence, last_alive=beat.step_changed)
                return True
        # Not "renewed Ns ago": a message that changes on every reconcile is a write each time
        # (the renewal itself is status.lastHeartbeatTime).
        self.condition(HEALTHY, True, "Heartbeating", f"step {beat.step}")
        self.requeue(allowed - stale + 0.5)
        return False

    def submit(self) -> None:
        previous = self.seen.previous_ray_job
        if previous is not None and previous.active:
            # Never two drivers at once: the stopped attempt must be gone first.
            self.act(StopRayJob(previous.submission_id))
            self.status.message = (
                f"waiting for the previous trainer {previous.submission_id} to stop"
            )
            self.requeue(1)
            return
        failures, history = self.failures(), self.status.restart_history
        if failures and history and history[-1].reason != RestartReason.TRAINER_RESIZED:
            due = _after(history[-1].time, backoff_seconds(self.job, failures))
            if self.seen.now < due:
                self.requeue((due - self.seen.now).total_seconds())
                return
        missing = self.roles_below_minimum()
        replicas = self.elastic_trainer() if missing else None
        if missing and (replicas is None or self.roles_below_minimum(skip=TRAINER)):
            # The ZeRO-3 group needs all its ranks; submitting now would only queue actors.
            self.status.message = f"waiting for Ray pods before starting the trainer: {missing}"
            self.status.message += self.elastic_hint()
            self.requeue(2)
            return
        if self.seen.submit_error is not None:
            # Ray refused it or did not answer: nothing was submitted. Say why, retry soon.
            self.status.message = f"could not submit the trainer: {self.seen.submit_error}"
            self.condition(DASHBOARD_REACHABLE, False, "SubmitFailed", self.seen.submit_error)
            self.requeue(SUBMIT_RETRY_SECONDS)
            return
        # The trainer's disk is the truth: any restart asks for the newest complete checkpoint,
        # even one the Lease never reported ("latest" starts from step 0 when there is none).
        drained = self.current(DRAINING) is not None
        resume = self.status.last_checkpoint is not None or self.status.restart_count > 0 or drained
        if self.seen.heartbeat is not None and self.seen.heartbeat.stop_requested_at is not None:
            self.act(ClearStopRequest())  # an old drain's request: the new driver must not obey
        self.act(SubmitRayJob(self.attempt_id(), resume=resume, trainer_replicas=replicas))
        self.status.submission_id = self.attempt_id()
        self.status.trainer_replicas = replicas
        if replicas is not None:
            desired = self.job.spec.roles.trainer.replicas
            self.event(
                "Warning",
                EventReason.DEGRADED,
                f"the trainer starts on {replicas} of {desired} replicas: its lost pods were not"
                f" replaced within {self.job.spec.roles.trainer.replacement_timeout_seconds}s",
            )
        if self.status.phase != Phase.RUNNING:
            self.enter(Phase.RUNNING, "trainer submitted", reason=EventReason.SUBMITTED)
        self.condition(TRAINER_RUNNING, False, EventReason.SUBMITTED, self.attempt_id())

    def recreate_cluster(
        self, reason: RestartReason, message: str, last_alive: datetime | None
    ) -> None:
        """The top rung of the ladder: a new RayCluster, then resume from the checkpoint."""
        self.restart(reason, message, last_alive=last_alive)
        self.condition(TRAINER_RUNNING, False, reason, message)
        if not self.status.phase.terminal:
            self.act(DeleteCluster(message))

    def restart(
        self, reason: RestartReason, message: str, last_alive: datetime | None = None
    ) -> None:
        """Climb the recovery ladder one rung, or fail when the budget is spent."""
        budget = self.job.spec.recovery.max_restarts
        resize = reason == RestartReason.TRAINER_RESIZED
        if not resize and self.failures() >= budget:
            self.finish(
                Phase.FAILED,
                FailureReason.RESTARTS_EXHAUSTED,
                f"{message} (after {budget} restarts)",
            )
            return
        checkpoint = self.status.last_checkpoint
        detection = None
        if last_alive is not None:
            detection = round(max(0.0, (self.seen.now - last_alive).total_seconds()), 3)
        record = RestartRecord(
            time=self.seen.now,
            reason=reason,
            message=message[:1000],
            resumed_from_step=checkpoint.step if checkpoint else None,
            detection_seconds=detection,
        )
        self.status.restart_count += 1
        self.status.restart_history = [*self.status.restart_history, record][-MAX_RESTART_HISTORY:]
        resumed = f"step {checkpoint.step}" if checkpoint else "the start"
        which = "a resize" if resize else f"restart {self.failures()}/{budget}"
        self.enter(Phase.RECOVERING, f"{which} from {resumed}: {message}", reason=reason)
        self.requeue(0 if resize else backoff_seconds(self.job, self.failures()))

    def failures(self) -> int:
        """Restarts that spend the budget: every one but an elastic trainer's resizes."""
        return self.status.restart_count - self.status.resizes

    def elastic_hint(self) -> str:
        """For a waiting elastic trainer: when it would start on the pods it has."""
        trainer, since = self.job.spec.roles.trainer, self.status.trainer_short_since
        if trainer.effective_min_replicas >= trainer.replicas or since is None:
            return ""
        left = trainer.replacement_timeout_seconds - self.waited(since)
        least = trainer.effective_min_replicas
        if left <= 0:
            return f" (the elastic trainer needs at least {least} Ready)"
        return f" (the elastic trainer starts on the Ready ones, at least {least}, in {left:.0f}s)"

    def progress_message(self) -> str:
        step, total = self.status.current_step, self.status.total_steps
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


def decide(seen: Observed) -> Plan:
    """The next status and actions for one job."""
    return _Planner(_aware(seen)).run()
