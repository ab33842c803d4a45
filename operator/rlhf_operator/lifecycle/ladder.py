"""`decide`: the ladder of rungs, in priority order; the first that applies builds the plan.

Before the ladder the status takes in what the trainer reported; after it, a queued job's
Workload follows. Each rung is one situation of the job and the module whose step handles it:

1. finished: a terminal phase (`ending`): release what is left, finish the Workload, the TTL;
2. to queue: a Kueue job with no Workload yet (`admission`);
3. suspending: `spec.suspend`, or a suspension's drain under way (`drain`);
4. not admitted: Kueue has not admitted it, or evicted it (`admission`, draining first);
5. off a drained node: a trainer's node is being drained (`drain`);
6. growing back: an elastic trainer's every pod is back (`scaling`);
7. past its deadline: `activeDeadlineSeconds` ran out (`ending`);
8. driving: bring the cluster up and follow the trainer (`provisioning`, `training`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlhf_operator.lifecycle import admission, drain, ending, provisioning, reports, scaling
from rlhf_operator.lifecycle.builder import PlanBuilder, aware
from rlhf_operator.lifecycle.plan import Plan
from rlhf_operator.texts import MESSAGE_LIMIT, trim
from rlhf_operator.views import Observed
from rlhfjob.contract import DrainCause


@dataclass(frozen=True)
class Rung:
    name: str
    applies: Callable[[PlanBuilder], bool]
    step: Callable[[PlanBuilder], None]


def _finished(b: PlanBuilder) -> bool:
    return b.status.phase.terminal


def _to_queue(b: PlanBuilder) -> bool:
    return b.queue is not None and b.seen.workload is None


def _suspending(b: PlanBuilder) -> bool:
    return b.job.spec.suspend or b.draining() is DrainCause.SUSPEND


def _not_admitted(b: PlanBuilder) -> bool:
    workload = b.seen.workload
    return workload is not None and (
        b.draining() is DrainCause.PREEMPTION or not workload.running_allowed
    )


def _on_a_drained_node(b: PlanBuilder) -> bool:
    return b.draining() is DrainCause.NODE_DRAIN or bool(b.seen.drained_nodes)


def _growing_back(b: PlanBuilder) -> bool:
    return b.draining() is DrainCause.RESIZE


def _always(b: PlanBuilder) -> bool:
    return True


def _drive(b: PlanBuilder) -> None:
    ending.wake_at_deadline(b)
    provisioning.drive(b)


LADDER: tuple[Rung, ...] = (
    Rung("finished", _finished, ending.after_finish),
    Rung("breaking the job policy", ending.breaks_policy, ending.fail_policy),
    Rung("to queue", _to_queue, admission.enqueue),
    Rung("suspending", _suspending, drain.suspend),
    Rung("not admitted", _not_admitted, admission.wait_for_admission),
    Rung("off a drained node", _on_a_drained_node, drain.move_off_drained_nodes),
    Rung("growing back", _growing_back, scaling.grow_back),
    Rung("past its deadline", ending.deadline_passed, ending.fail_past_deadline),
    Rung("driving", _always, _drive),
)


def decide(seen: Observed) -> Plan:
    """The next status and actions for one job."""
    b = PlanBuilder(aware(seen))
    refused = b.seen.apply_error
    if refused is None or refused.permanent:
        # A refused change is not observed yet: the spec still differs, so it is retried.
        b.status.observed_generation = b.job.metadata.generation
    b.status.total_steps = b.job.spec.algorithm.total_steps or b.status.total_steps
    reports.record_heartbeat(b)
    reports.note_trainer_pods(b)
    rung = next(rung for rung in LADDER if rung.applies(b))
    rung.step(b)
    if b.seen.workload is not None and not b.status.phase.terminal:
        admission.follow_workload(b)
    b.status.message = trim(b.status.message, MESSAGE_LIMIT)
    return b.plan
