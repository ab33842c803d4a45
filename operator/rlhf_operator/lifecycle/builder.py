"""The plan builder: the status one `decide` edits, and the helpers every step shares.

A step reads the observed world (`seen`) and the job, and writes through these helpers only:
conditions keep their transition times, a phase change is an Event, requeues keep the soonest.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel

from rlhf_operator.lifecycle.plan import DRAINING, Action, Event, Plan
from rlhf_operator.names import submission_id
from rlhf_operator.queueing import queue_name
from rlhf_operator.texts import MESSAGE_LIMIT, REASON_LIMIT, trim
from rlhf_operator.views import HeartbeatView, Observed
from rlhfjob.api import Condition, Phase, RLHFJobStatus
from rlhfjob.contract import DrainCause


class PlanBuilder:
    """One plan being built: the observed world, the status as edited so far, the actions."""

    def __init__(self, seen: Observed) -> None:
        self.seen = seen
        self.job = seen.job
        previous = seen.job.status or RLHFJobStatus()
        self.spec_changed = previous.observed_generation != seen.job.metadata.generation
        self.plan = Plan(status=previous.model_copy(deep=True))
        self.queue = queue_name(seen.job)
        """The LocalQueue of a job Kueue admits; None: the job runs without asking."""
        self.observed_conditions = {c.type: c for c in previous.conditions}
        """The conditions as the status held them before this plan: a condition that ends the
        plan with the status it had keeps its transition time, even if a step in between set
        it otherwise (e.g. DashboardReachable True, then False again for a refused submission),
        so an unchanged world writes nothing."""

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
            reason=trim(reason, REASON_LIMIT),
            message=trim(message, MESSAGE_LIMIT),
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
        message = trim(message, MESSAGE_LIMIT)
        if phase != self.status.phase:
            warning = phase in (Phase.FAILED, Phase.RECOVERING)
            self.event("Warning" if warning else "Normal", reason or phase.value, message)
        self.status.phase = phase
        self.status.message = message

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

    def draining(self) -> DrainCause | None:
        """The cause of the drain under way, if one is. A drain, once begun, ends with the
        cluster released even if its cause went away meanwhile (the trainer was asked to
        stop): the job then starts again from the drain's checkpoint."""
        found = self.current(DRAINING)
        return DrainCause.of(found.reason) if found is not None and found.status == "True" else None

    def cluster_gone(self) -> bool:
        """No RayCluster and none of its pods left: the job holds no node's resources."""
        return self.seen.cluster is None and self.seen.pods_left == 0

    def failures(self) -> int:
        """Restarts that spend the budget: every one but an elastic trainer's resizes."""
        return self.status.restart_count - self.status.resizes


def aware(value: Any) -> Any:
    """`value` with every naive datetime in it read as UTC (what the client sometimes returns):
    comparing naive with aware times raises, and `decide` must not."""
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    if isinstance(value, BaseModel):
        changes = {}
        for name in type(value).model_fields:
            old = getattr(value, name, None)
            if (new := aware(old)) is not old:
                changes[name] = new
        return value.model_copy(update=changes) if changes else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for item in dataclasses.fields(value):
            old = getattr(value, item.name)
            if (new := aware(old)) is not old:
                changes[item.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    if isinstance(value, list):
        items = [aware(item) for item in value]
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    if isinstance(value, dict):
        entries = {key: aware(item) for key, item in value.items()}
        changed = any(entries[key] is not item for key, item in value.items())
        return entries if changed else value
    return value
