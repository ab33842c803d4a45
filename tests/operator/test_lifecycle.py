"""The lifecycle policy, one observed world per row: what phase and actions follow."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rlhf_operator import builder, network
from rlhf_operator.lifecycle import (
    DRAIN_POLL_SECONDS,
    MESSAGE_LIMIT,
    ApplyCluster,
    ClearStopRequest,
    DeleteCluster,
    DeleteJob,
    RequestStop,
    StopRayJob,
    SubmitRayJob,
    backoff_seconds,
    dashboard_retry_at,
    decide,
    trainer_failure_summary,
)
from rlhf_operator.names import submission_id
from rlhf_operator.views import (
    ApplyRefusal,
    ClusterView,
    ClusterWarning,
    HeartbeatView,
    Observed,
    RayJobView,
    RoleView,
)
from rlhfjob import contract
from rlhfjob.api import MLFLOW_SECRET_KEYS, WANDB_SECRET_KEY, Condition, Phase, RLHFJob
from rlhfjob.config import parse_job
from rlhfjob.contract import EXIT_GRACE_SECONDS, PHASE_EXITING, PHASE_STARTING, EngineCount
from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import valid_job

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def make_job(status: dict[str, Any] | None = None, **spec: Any) -> RLHFJob:
    document = merge_patch(valid_job("job"), {"spec": spec})
    document["metadata"].update(uid="12345678-abcd", generation=1)
    if status is not None:
        document["status"] = status
    return parse_job(document)


def ready_cluster(created: float = 0, **overrides: Any) -> ClusterView:
    fields = dict(name="job", created=at(created), ready=True, dashboard="http://head:8265")
    return ClusterView(**{**fields, **overrides})


def running(attempt: int = 0, **status: Any) -> dict[str, Any]:
    return {"phase": "Running", "restartCount": attempt, "startTime": T0.isoformat(), **status}


def ray_job(state: str, attempt: int = 0, **fields: Any) -> RayJobView:
    return RayJobView(submission_id=f"job-12345678-{attempt}", status=state, **fields)  # type: ignore[arg-type]


def kinds(plan) -> list[type]:
    return [type(action) for action in plan.actions]


def test_new_job_creates_its_cluster() -> None:
    plan = decide(Observed(job=make_job(), now=at(0), created=at(0)))
    assert kinds(plan) == [ApplyCluster]
    assert plan.status.phase == Phase.PROVISIONING
    assert plan.status.start_time == at(0)
    assert [e.reason for e in plan.events] == ["Provisioning"]


def test_cluster_not_ready_waits_until_the_provisioning_deadline() -> None:
    job = make_job({"phase": "Provisioning"}, provisioningTimeoutSeconds=100)
    seen = Observed(job=job, now=at(40), created=at(0), cluster=ready_cluster(10, ready=False))
    plan = decide(seen)
    assert kinds(plan) == [ApplyCluster]
    assert plan.status.phase == Phase.PROVISIONING
    assert plan.requeue_after == pytest.approx(70)


@pytest.mark.parametrize("phase", ["Provisioning", "Recovering"])
def test_a_cluster_kuberay_gave_two_heads_is_recreated_at_once(phase: str) -> None:
    """KubeRay stops reconciling a RayCluster with two head pods: no deadline would help."""
    job = make_job({"phase": phase, "restartCount": 0}, provisioningTimeoutSeconds=600)
    cluster = ready_cluster(10, ready=False, head_pods=2)
    plan = decide(Observed(job=job, now=at(40), created=at(0), cluster=cluster))
    assert DeleteCluster in kinds(plan)
    assert plan.status.phase == Phase.RECOVERING
    assert plan.status.restart_count == 1
    (record,) = plan.status.restart_history
    assert record.reason == "ClusterUnhealthy" and "2 head pods" in record.message
    one_head = decide(Observed(job=job, now=at(40), created=at(0),
                               cluster=replace(cluster, head_pods=1)))  # fmt: skip
    assert DeleteCluster not in kinds(one_head)


def test_provisioning_timeout_fails_quoting_the_scheduler() -> None:
    job = make_job({"phase": "Provisioning"}, provisioningTimeoutSeconds=100)
    problem = "0/6 nodes are available: 6 Insufficient nvidia.com/gpu."
    seen = Observed(
        job=job,
        now=at(111),
        created=at(0),
        cluster=ready_cluster(10, ready=False),
        scheduling_problem=problem,
    )
    plan = decide(seen)
    assert plan.status.phase == Phase.FAILED
    assert problem in plan.status.message
    assert DeleteCluster in kinds(plan)
    assert plan.events[-1].reason == "ProvisioningTimeout"
    assert plan.status.completion_time == at(111)


def test_ready_cluster_gets_the_trainer_submitted_once() -> None:
    job = make_job({"phase": "Provisioning"})
    plan = decide(Observed(job=job, now=at(5), created=at(0), cluster=ready_cluster()))
    submits = [a for a in plan.actions if isinstance(a, SubmitRayJob)]
    assert submits == [SubmitRayJob(submission_id="job-12345678-0", resume=False)]
    assert plan.status.phase == Phase.RUNNING
    assert plan.status.dashboard_url == "http://head:8265"


def test_unreachable_dashboard_is_a_condition_and_a_retry_not_a_failure() -> None:
    job = make_job({"phase": "Provisioning"})
    seen = Observed(
        job=job, now=at(5), created=at(0), cluster=ready_cluster(), dashboard_error="refused"
    )
    plan = decide(seen)
    assert SubmitRayJob not in kinds(plan)
    assert plan.status.phase == Phase.PROVISIONING
    reachable = next(c for c in plan.status.conditions if c.type == "DashboardReachable")
    assert (reachable.status, reachable.message) == ("False", "refused")
    # Asked again at the first timer tick 5 s on (no kick of its own: nothing is due).
    assert plan.requeue_after is None
    assert plan.dashboard_retry_at == at(10)


def test_running_job_reports_progress_from_the_heartbeat() -> None:
    beat = HeartbeatView(
        renewed=at(99), step=7, total_steps=10, checkpoint_step=5, checkpoint_path="/c/5", attempt=0
    )
    seen = Observed(
        job=make_job(running()),
        now=at(100),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("RUNNING"),
        heartbeat=beat,
    )
    plan = decide(seen)
    assert kinds(plan) == [ApplyCluster]
    assert plan.status.phase == Phase.RUNNING
    assert (plan.status.current_step, plan.status.total_steps) == (7, 10)
    assert plan.status.last_checkpoint is not None
    assert plan.status.last_checkpoint.step == 5
    assert plan.status.message == "training: step 7/10"


def test_running_job_shows_its_rate_eta_and_reward() -> None:
    earlier = {"stepTime": "2026-01-01T00:00:50Z"}
    beat = HeartbeatView(renewed=at(99), step=7, step_changed=at(90), total_steps=10, attempt=0,
                         reward_mean=0.5, tokens_per_second=800.0)  # fmt: skip
    seen = Observed(
        job=make_job(running(currentStep=3, progress=earlier)),
        now=at(100),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("RUNNING"),
        heartbeat=beat,
    )
    shown = decide(seen).status.progress
    assert shown is not None
    assert shown.steps_per_second == pytest.approx(4 / 40), "4 steps between the step times"
    assert shown.eta == at(90 + 3 / (4 / 40))
    assert (shown.reward_mean, shown.tokens_per_second) == (0.5, 800.0)


def test_existing_cluster_is_reapplied_only_when_the_spec_changed() -> None:
    seen = Observed(
        job=make_job(running(observedGeneration=1)),
        now=at(100),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("RUNNING"),
    )
    assert ApplyCluster not in kinds(decide(seen))
    job = make_job(running(observedGeneration=1))
    job.metadata.generation = 2
    assert ApplyCluster in kinds(decide(Observed(**{**seen.__dict__, "job": job})))


def test_heartbeat_of_an_older_attempt_is_ignored() -> None:
    beat = HeartbeatView(renewed=at(99), step=99, attempt=0)
    seen = Observed(
        job=make_job(running(attempt=1, currentStep=3)),
        now=at(100),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("RUNNING", attempt=1),
        heartbeat=beat,
    )
    assert decide(seen).status.current_step == 3


def test_success_is_terminal_and_releases_the_cluster() -> None:
    seen = Observed(
        job=make_job(running()),
        now=at(200),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("SUCCEEDED"),
    )
    plan = decide(seen)
    assert plan.status.phase == Phase.SUCCEEDED
    assert DeleteCluster in kinds(plan)
    assert plan.status.completion_time == at(200)


def test_terminal_phase_stays_terminal_whatever_is_observed() -> None:
    job = make_job({"phase": "Succeeded", "completionTime": at(10).isoformat()})
    seen = Observed(
        job=job, now=at(20), created=at(0), cluster=ready_cluster(), ray_job=ray_job("FAILED")
    )
    plan = decide(seen)
    assert plan.status.phase == Phase.SUCCEEDED
    assert kinds(plan) == [DeleteCluster]


def test_failed_trainer_restarts_from_the_last_checkpoint_after_backoff() -> None:
    checkpoint = {"step": 20, "path": "/ckpt/step-20"}
    job = make_job(running(lastCheckpoint=checkpoint), recovery={"backoffSeconds": 10})
    failed = Observed(
        job=job,
        now=at(100),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("FAILED", exit_code=1, message="exit code 1"),
    )
    plan = decide(failed)
    assert plan.status.phase == Phase.RECOVERING
    assert plan.status.restart_count == 1
    (record,) = plan.status.restart_history
    assert (record.reason, record.resumed_from_step) == ("TrainerFailed", 20)
    assert plan.requeue_after == 10
    assert plan.events[-1].type == "Warning"

    # Within the backoff nothing is submitted; after it, attempt 1 resumes.
    job = make_job(plan.status.wire(), recovery={"backoffSeconds": 10})
    waiting = decide(
        Observed(
            job=job, now=at(105), created=at(0), cluster=ready_cluster(), ray_job=ray_job("FAILED")
        )
    )
    assert SubmitRayJob not in kinds(waiting)
    assert waiting.requeue_after == pytest.approx(5)
    resumed = decide(
        Observed(
            job=job, now=at(111), created=at(0), cluster=ready_cluster(), ray_job=ray_job("FAILED")
        )
    )
    assert SubmitRayJob("job-12345678-1", resume=True) in resumed.actions
    assert resumed.status.phase == Phase.RUNNING


def test_non_retryable_failure_fails_at_once() -> None:
    seen = Observed(
        job=make_job(running()),
        now=at(50),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("FAILED", exit_code=3, message="reward function 'x:y': module not found"),
    )
    plan = decide(seen)
    assert plan.status.phase == Phase.FAILED
    assert plan.status.restart_count == 0
    assert "module not found" in plan.status.message
    assert plan.events[-1].reason == "NonRetryableError"


def test_restart_budget_exhausted_fails_with_the_reason() -> None:
    job = make_job(running(attempt=2), recovery={"maxRestarts": 2})
    seen = Observed(
        job=job,
        now=at(50),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("FAILED", attempt=2, message="boom"),
    )
    plan = decide(seen)
    assert plan.status.phase == Phase.FAILED
    assert "boom" in plan.status.message and "after 2 restarts" in plan.status.message
    assert plan.events[-1].reason == "RestartsExhausted"


def test_suspend_stops_the_trainer_and_releases_the_cluster() -> None:
    seen = Observed(
        job=make_job(running(), suspend=True),
        now=at(50),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("RUNNING"),
    )
    plan = decide(seen)
    assert kinds(plan) == [StopRayJob, DeleteCluster]
    assert plan.status.phase == Phase.SUSPENDED


# -- drains: a checkpoint of the step under way before the cluster goes --------------------------

LISTENING = HeartbeatView(renewed=at(45), step=12, attempt=0)
"""A trainer of this attempt that heartbeats: it can hear a stop request."""


def draining(since: float, **status: Any) -> dict[str, Any]:
    asked = {"type": "Draining", "status": "True", "reason": "Draining",
             "lastTransitionTime": at(since).isoformat()}  # fmt: skip
    return running(conditions=[asked], currentStep=12, **status)


def suspended_world(status: dict[str, Any], now: float, **seen: Any) -> Observed:
    fields: dict[str, Any] = dict(cluster=ready_cluster(), ray_job=ray_job("RUNNING"))
    return Observed(job=make_job(status, suspend=True), now=at(now), created=at(0),
                    **{**fields, **seen})  # fmt: skip


def condition(plan: Any, type_: str) -> Condition:
    return next(c for c in plan.status.conditions if c.type == type_)


def test_suspend_asks_a_heartbeating_trainer_to_checkpoint_before_the_cluster_goes() -> None:
    plan = decide(suspended_world(running(currentStep=12), 50, heartbeat=LISTENING))
    assert plan.actions == [RequestStop(at(50))]
    assert plan.status.phase == Phase.RUNNING  # the cluster stays until the trainer is done
    draining_ = condition(plan, "Draining")
    assert draining_.status == "True" and "step 13" in draining_.message
    assert "600s" in draining_.message  # checkpoint.stopGracePeriodSeconds' default
    assert [e.reason for e in plan.events] == ["Draining"]
    assert plan.requeue_after == pytest.approx(DRAIN_POLL_SECONDS)


def test_a_draining_job_waits_for_its_trainer_and_asks_only_once() -> None:
    heard = replace(LISTENING, renewed=at(60), checkpoint_requested_at=at(50))
    plan = decide(suspended_world(draining(50), 120, heartbeat=heard))
    assert plan.actions == []
    assert plan.status.phase == Phase.RUNNING
    assert plan.events == []


def test_the_trainer_exiting_ends_the_drain_and_releases_the_cluster() -> None:
    answered = replace(LISTENING, checkpoint_requested_at=at(50), checkpoint_saved_step=13)
    world = suspended_world(
        draining(50), 80, heartbeat=answered, ray_job=ray_job("FAILED", exit_code=4)
    )
    plan = decide(world)
    assert kinds(plan) == [ClearStopRequest, DeleteCluster]
    assert plan.status.phase == Phase.SUSPENDED
    assert condition(plan, "Draining").reason == "Drained"
    assert plan.events[0].reason == "Drained" and "step 13" in plan.events[0].message


@pytest.mark.parametrize(
    ("beat", "now", "why"),
    [
        (LISTENING, 50 + 60, "did not acknowledge the stop request in 60s"),  # heartbeatTimeout
        # An earlier drain's answer, still on the Lease, is no answer to this one.
        (replace(LISTENING, checkpoint_requested_at=at(10)), 50 + 60, "did not acknowledge"),
        (replace(LISTENING, checkpoint_requested_at=at(50)), 50 + 600, "did not stop within 600s"),
    ],
)
def test_a_trainer_that_does_not_answer_in_time_loses_its_cluster_anyway(
    beat: HeartbeatView, now: float, why: str
) -> None:
    plan = decide(suspended_world(draining(50), now, heartbeat=beat))
    assert kinds(plan) == [ClearStopRequest, StopRayJob, DeleteCluster]
    assert plan.status.phase == Phase.SUSPENDED
    assert condition(plan, "Draining").reason == "DrainTimedOut"
    assert plan.events[0].type == "Warning" and why in plan.events[0].message


@pytest.mark.parametrize(
    ("spec", "seen"),
    [
        ({"checkpoint": {"stopGracePeriodSeconds": 0}}, {"heartbeat": LISTENING}),
        ({}, {}),  # no heartbeat: a driver that cannot hear the request (a custom entrypoint)
        ({}, {"heartbeat": LISTENING, "ray_job": ray_job("PENDING")}),  # no step under way
        ({}, {"heartbeat": replace(LISTENING, attempt=1)}),  # another attempt wrote it
    ],
)
def test_without_a_trainer_to_save_a_step_the_cluster_goes_at_once(
    spec: dict[str, Any], seen: dict[str, Any]
) -> None:
    world = suspended_world(running(), 50, **seen)
    world = replace(world, job=make_job(running(), suspend=True, **spec))
    plan = decide(world)
    assert kinds(plan) == [StopRayJob, DeleteCluster]
    assert plan.status.phase == Phase.SUSPENDED
    assert not any(c.type == "Draining" for c in plan.status.conditions)


def test_while_the_dashboard_is_silent_a_drain_goes_by_the_trainers_lease() -> None:
    silent: dict[str, Any] = dict(ray_job=None, ray_job_read=False, dashboard_error="timed out")
    # Begun: the request goes through the Lease, which needs no dashboard.
    plan = decide(suspended_world(running(currentStep=12), 50, heartbeat=LISTENING, **silent))
    assert plan.actions == [RequestStop(at(50))]
    assert condition(plan, "Draining").status == "True"
    # Under way, heard: the silence is no exit; the cluster stays.
    heard = replace(LISTENING, renewed=at(60), checkpoint_requested_at=at(50))
    plan = decide(suspended_world(draining(50), 70, heartbeat=heard, **silent))
    assert plan.actions == [] and plan.status.phase == Phase.RUNNING
    # Saved, by the Lease's word: the cluster goes, the step kept.
    saved = replace(heard, checkpoint_saved_step=13)
    plan = decide(suspended_world(draining(50), 80, heartbeat=saved, **silent))
    assert kinds(plan) == [ClearStopRequest, DeleteCluster]
    assert "after checkpointing step 13" in condition(plan, "Draining").message
    # Heard, then quiet for the heartbeat timeout (60 s): gone with its head, not waited for
    # to the end of the grace period.
    plan = decide(suspended_world(draining(50), 60 + 60, heartbeat=heard, **silent))
    assert kinds(plan) == [ClearStopRequest, DeleteCluster]
    assert condition(plan, "Draining").reason == "Drained"


def test_a_drain_resumed_meanwhile_finishes_then_the_job_resumes_from_its_checkpoint() -> None:
    world = suspended_world(draining(50), 80, ray_job=ray_job("FAILED", exit_code=4))
    world = replace(world, job=make_job(draining(50), suspend=False))
    plan = decide(world)
    assert plan.status.phase == Phase.SUSPENDED
    assert condition(plan, "Suspended").message == "released after a drain"
    # The next reconcile resumes; the stop request left on the Lease is cleared first.
    status = plan.status.model_dump(by_alias=True, mode="json", exclude_none=True)
    stale = HeartbeatView(renewed=at(70), step=13, attempt=0, stop_requested_at=at(50))
    again = decide(Observed(job=make_job(status), now=at(90), created=at(0)))
    assert kinds(again) == [ApplyCluster]
    ready = make_job(again.status.model_dump(by_alias=True, mode="json", exclude_none=True))
    submit = decide(Observed(job=ready, now=at(95), created=at(0), cluster=ready_cluster(),
                             heartbeat=stale))  # fmt: skip
    assert kinds(submit) == [ClearStopRequest, SubmitRayJob]
    assert submit.actions[1] == SubmitRayJob(submission_id="job-12345678-0", resume=True)


def test_the_last_renewal_before_a_suspend_is_not_the_resumed_drivers_heartbeat() -> None:
    # The same attempt runs again after a suspend; the Lease still holds the stopped driver's
    # renewal. The new driver is judged by the no-heartbeat-yet rule, not found hung.
    drained = {"type": "Draining", "status": "False", "reason": "Drained",
               "lastTransitionTime": at(45).isoformat()}  # fmt: skip
    old = HeartbeatView(renewed=at(40), step=10, attempt=0)
    seen = Observed(job=make_job(running(conditions=[drained])), now=at(330), created=at(0),
                    cluster=ready_cluster(), ray_job=ray_job("RUNNING"), heartbeat=old)  # fmt: skip
    plan = decide(seen)
    assert StopRayJob not in kinds(plan) and plan.status.phase == Phase.RUNNING
    assert plan.status.restart_count == 0


def test_unsuspend_recreates_the_cluster() -> None:
    job = make_job({"phase": "Suspended", "lastCheckpoint": {"step": 4, "path": "/c"}})
    plan = decide(Observed(job=job, now=at(60), created=at(0)))
    assert kinds(plan) == [ApplyCluster]
    assert plan.status.phase == Phase.PROVISIONING
    assert [e.reason for e in plan.events] == ["Resumed", "Provisioning"]


def test_active_deadline_fails_the_job() -> None:
    seen = Observed(
        job=make_job(running(), activeDeadlineSeconds=30),
        now=at(31),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("RUNNING"),
    )
    plan = decide(seen)
    assert plan.status.phase == Phase.FAILED
    assert kinds(plan) == [StopRayJob, DeleteCluster]
    assert plan.events[-1].reason == "DeadlineExceeded"


@pytest.mark.parametrize(
    ("now", "expected"), [(at(109), [DeleteCluster]), (at(111), [DeleteCluster, DeleteJob])]
)
def test_ttl_after_finished_deletes_the_job(now: datetime, expected: list[type]) -> None:
    job = make_job(
        {"phase": "Failed", "completionTime": at(10).isoformat()}, ttlSecondsAfterFinished=100
    )
    plan = decide(Observed(job=job, now=now, created=at(0), cluster=ready_cluster()))
    assert kinds(plan) == expected


def test_stale_heartbeat_means_hung_and_restarts() -> None:
    job = make_job(running(), liveness={"heartbeatTimeoutSeconds": 30})
    beat = HeartbeatView(renewed=at(60), step=12, attempt=0)
    seen = Observed(
        job=job,
        now=at(100),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("RUNNING"),
        heartbeat=beat,
    )
    plan = decide(seen)
    assert StopRayJob("job-12345678-0") in plan.actions
    assert plan.status.phase == Phase.RECOVERING
    assert plan.status.restart_history[-1].reason == "TrainerHung"
    healthy = next(c for c in plan.status.conditions if c.type == "Healthy")
    assert "40s ago at step 12" in healthy.message


def test_a_driver_that_said_it_is_exiting_gets_a_grace_before_it_is_called_hung() -> None:
    """Its last renewal says `exiting` (curve drawn, actors going): Ray's verdict follows."""
    job = make_job(running(), liveness={"heartbeatTimeoutSeconds": 30})
    beat = HeartbeatView(renewed=at(60), step=24, attempt=0, phase="exiting")

    def at_time(seconds: float) -> Any:
        return decide(Observed(job=job, now=at(seconds), created=at(0), cluster=ready_cluster(),
                               ray_job=ray_job("RUNNING"), heartbeat=beat))  # fmt: skip

    waiting = at_time(100)  # 40 s stale: hung for a training driver, not for a leaving one
    assert waiting.status.phase == Phase.RUNNING and StopRayJob not in kinds(waiting)
    assert waiting.requeue_after == pytest.approx(30 + EXIT_GRACE_SECONDS - 40 + 0.5)
    hung = at_time(60 + 30 + EXIT_GRACE_SECONDS + 1)  # never leaving after all
    assert hung.status.restart_history[-1].reason == "TrainerHung"
    healthy = next(c for c in hung.status.conditions if c.type == "Healthy")
    assert healthy.message.endswith("at step 24, after it said it was exiting")


def test_heartbeats_without_progress_mean_stalled() -> None:
    job = make_job(running(), liveness={"progressTimeoutSeconds": 120})
    beat = HeartbeatView(renewed=at(299), step=12, attempt=0, step_changed=at(100))
    seen = Observed(
        job=job,
        now=at(300),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("RUNNING"),
        heartbeat=beat,
    )
    plan = decide(seen)
    assert plan.status.restart_history[-1].reason == "TrainerStalled"


def test_cluster_unhealthy_past_its_deadline_is_recreated() -> None:
    job = make_job(running(), recovery={"clusterRecoveryTimeoutSeconds": 60})
    sick = ready_cluster(ready=False)
    first = decide(Observed(job=job, now=at(100), created=at(0), cluster=sick))
    assert first.status.phase == Phase.RECOVERING
    assert DeleteCluster not in kinds(first)
    job = make_job(first.status.wire(), recovery={"clusterRecoveryTimeoutSeconds": 60})
    later = decide(Observed(job=job, now=at(161), created=at(0), cluster=sick))
    assert DeleteCluster in kinds(later)
    assert later.status.restart_history[-1].reason == "ClusterUnhealthy"


def test_same_world_same_plan() -> None:
    seen = Observed(
        job=make_job(running()),
        now=at(9),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("RUNNING"),
    )
    assert decide(seen) == decide(seen)


def test_a_trainer_that_trained_restarts_at_once_and_a_failing_start_backs_off() -> None:
    """The backoff is for starts that keep failing: a trainer killed mid-run is resubmitted
    at once, however many restarts came before; failures before a first step double it."""
    checkpoint = {"step": 20, "path": "/ckpt/step-20"}
    recovery = {"backoffSeconds": 10, "maxRestarts": 9}

    def fail(status: dict, now: int, attempt: int):
        job = make_job(status, recovery=recovery)
        seen = Observed(job=job, now=at(now), created=at(0), cluster=ready_cluster(),
                        ray_job=ray_job("FAILED", attempt=attempt, exit_code=1))  # fmt: skip
        return decide(seen)

    trained = fail(running(lastCheckpoint=checkpoint, currentStep=23), 100, 0)
    assert trained.requeue_after == 0
    job = make_job(trained.status.wire(), recovery=recovery)
    again = decide(
        Observed(
            job=job, now=at(100), created=at(0), cluster=ready_cluster(), ray_job=ray_job("FAILED")
        )
    )
    assert SubmitRayJob("job-12345678-1", resume=True) in again.actions, "no backoff"
    # Attempt 1 dies before its first step: 10 s; attempt 2 too: 20 s.
    first = fail(again.status.wire(), 110, 1)
    assert first.requeue_after == 10
    second = fail({**first.status.wire(), "phase": "Running"}, 130, 2)
    assert second.requeue_after == 20
    # Attempt 3 trains a step past its checkpoint, then dies: at once again.
    status = second.status.wire()
    status["restartHistory"][-1]["resumedTime"] = at(150).isoformat()
    third = fail({**status, "phase": "Running"}, 160, 3)
    assert third.requeue_after == 0
    assert third.status.restart_count == 4


def test_backoff_doubles_and_is_capped() -> None:
    job = make_job(recovery={"backoffSeconds": 10, "maxBackoffSeconds": 35})
    assert [backoff_seconds(job, n) for n in range(5)] == [0, 10, 20, 35, 35]


def test_restart_history_is_bounded() -> None:
    history = [{"time": at(i).isoformat(), "reason": "TrainerFailed"} for i in range(20)]
    job = make_job(running(attempt=20, restartHistory=history), recovery={"maxRestarts": 50})
    seen = Observed(
        job=job,
        now=at(500),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("FAILED", attempt=20),
    )
    plan = decide(seen)
    assert len(plan.status.restart_history) == 20
    assert plan.status.restart_history[-1].time == at(500)


def test_submission_ids_differ_per_attempt_and_job() -> None:
    job = make_job()
    assert submission_id(job, 0) != submission_id(job, 1)
    assert submission_id(job, 0) == "job-12345678-0"


def test_a_pending_driver_is_not_judged_by_liveness() -> None:
    job = make_job(running(), liveness={"progressTimeoutSeconds": 60})
    seen = Observed(
        job=job, now=at(10_000), created=at(0), cluster=ready_cluster(), ray_job=ray_job("PENDING")
    )
    plan = decide(seen)
    assert StopRayJob not in kinds(plan)
    assert plan.status.phase == Phase.RUNNING
    assert plan.status.message == "trainer starting"


def test_a_running_driver_without_any_heartbeat_is_hung_after_the_progress_timeout() -> None:
    job = make_job(running(), liveness={"progressTimeoutSeconds": 60})
    first = decide(
        Observed(
            job=job, now=at(100), created=at(0), cluster=ready_cluster(), ray_job=ray_job("RUNNING")
        )
    )
    assert StopRayJob not in kinds(first)
    assert first.requeue_after == pytest.approx(60)
    job = make_job(first.status.wire(), liveness={"progressTimeoutSeconds": 60})
    later = decide(
        Observed(
            job=job, now=at(161), created=at(0), cluster=ready_cluster(), ray_job=ray_job("RUNNING")
        )
    )
    assert StopRayJob("job-12345678-0") in later.actions
    assert later.status.restart_history[-1].reason == "TrainerHung"


# --- the recovery ladder and elastic roles (decision 5) ---------------------------------------


def submitted(attempt: int = 0, **status: Any) -> dict[str, Any]:
    """A running job whose current attempt the operator has submitted."""
    return running(attempt, submissionId=f"job-12345678-{attempt}", observedGeneration=1, **status)


def with_roles(**roles: tuple[int, int]) -> ClusterView:
    return ready_cluster(roles={name: RoleView(*counts) for name, counts in roles.items()})


def test_a_head_pod_not_ready_past_the_grace_recreates_the_cluster() -> None:
    job = make_job(submitted(), liveness={"heartbeatTimeoutSeconds": 30})
    blip = decide(
        Observed(job=job, now=at(110), created=at(0),
                 cluster=ready_cluster(head_not_ready_since=at(100)))
    )  # fmt: skip
    assert kinds(blip) == []
    assert blip.requeue_after == pytest.approx(20)
    lost = decide(
        Observed(job=job, now=at(131), created=at(0),
                 cluster=ready_cluster(head_not_ready_since=at(100)))
    )  # fmt: skip
    assert kinds(lost) == [DeleteCluster]
    record = lost.status.restart_history[-1]
    assert (record.reason, record.detection_seconds) == ("HeadLost", 31)
    assert lost.status.phase == Phase.RECOVERING


def test_a_submitted_job_ray_no_longer_knows_means_the_head_was_lost() -> None:
    job = make_job(submitted(lastHeartbeatTime=at(90).isoformat()))
    plan = decide(Observed(job=job, now=at(100), created=at(0), cluster=ready_cluster()))
    assert kinds(plan) == [DeleteCluster]
    assert plan.status.restart_history[-1].reason == "HeadLost"
    assert plan.status.restart_history[-1].detection_seconds == 10
    # Once the new cluster is up, attempt 1 is submitted, not the lost attempt 0 again.
    job = make_job(plan.status.wire(), recovery={"backoffSeconds": 0})
    again = decide(Observed(job=job, now=at(200), created=at(0), cluster=ready_cluster()))
    assert SubmitRayJob("job-12345678-1", resume=True) in again.actions
    assert again.status.submission_id == "job-12345678-1"


def test_a_dashboard_silent_past_the_recovery_deadline_recreates_the_cluster() -> None:
    job = make_job(submitted(), recovery={"clusterRecoveryTimeoutSeconds": 60})
    down = Observed(job=job, now=at(100), created=at(0), cluster=ready_cluster(),
                    dashboard_error="refused")  # fmt: skip
    first = decide(down)
    assert kinds(first) == []
    job = make_job(first.status.wire(), recovery={"clusterRecoveryTimeoutSeconds": 60})
    later = decide(replace(down, job=job, now=at(161)))
    assert kinds(later) == [DeleteCluster]
    assert later.status.restart_history[-1].reason == "ClusterUnhealthy"


def test_the_next_attempt_waits_until_the_previous_driver_stopped() -> None:
    job = make_job(
        running(1, phase="Recovering", observedGeneration=1), recovery={"backoffSeconds": 0}
    )
    seen = Observed(job=job, now=at(100), created=at(0), cluster=ready_cluster(),
                    previous_ray_job=ray_job("RUNNING", attempt=0))  # fmt: skip
    plan = decide(seen)
    assert plan.actions == [StopRayJob("job-12345678-0")]
    assert "previous trainer" in plan.status.message
    stopped = decide(replace(seen, previous_ray_job=ray_job("STOPPED", attempt=0)))
    assert SubmitRayJob("job-12345678-1", resume=True) in stopped.actions


def test_the_trainer_is_submitted_only_with_every_rank_and_enough_engines() -> None:
    recovering = running(1, phase="Recovering", observedGeneration=1)
    job = make_job(recovering, recovery={"backoffSeconds": 0},
                   roles={"rollout": {"replicas": 2, "minReplicas": 1}})  # fmt: skip
    short = decide(Observed(job=job, now=at(100), created=at(0),
                            cluster=with_roles(trainer=(1, 2), rollout=(1, 2))))  # fmt: skip
    assert SubmitRayJob not in kinds(short)
    assert "trainer 1/2 pods ready" in short.status.message
    enough = decide(Observed(job=job, now=at(100), created=at(0),
                             cluster=with_roles(trainer=(2, 2), rollout=(1, 2))))  # fmt: skip
    assert SubmitRayJob in kinds(enough)


def test_a_trainer_that_failed_with_its_pod_gone_restarts_as_trainer_pod_lost() -> None:
    job = make_job(submitted())
    final = "RLHFJOB_FINAL_STATUS code=1 reason=Failed message=ActorDiedError: rank 1 died"
    seen = Observed(
        job=job, now=at(100), created=at(0), cluster=with_roles(trainer=(1, 2)),
        ray_job=ray_job("FAILED", exit_code=1, ended=at(97),
                        message=f"Job entrypoint command failed with exit code 1, ...\n{final}\n"),
    )  # fmt: skip
    plan = decide(seen)
    record = plan.status.restart_history[-1]
    assert record.reason == "TrainerPodLost"
    assert record.message == "trainer 1/2 pods ready; Failed: ActorDiedError: rank 1 died"
    assert record.detection_seconds == 3


def test_a_reward_model_replica_lost_is_degraded_from_the_pods_and_the_trainer() -> None:
    roles = {"reward": {"replicas": 2, "minReplicas": 1}}
    job = make_job(submitted(), reward={"type": "model", "function": None},
                   model={"reward": "/models/rm"}, roles=roles)  # fmt: skip
    beat = HeartbeatView(renewed=at(99), step=7, attempt=0, reward_models=EngineCount(1, 2))
    seen = Observed(job=job, now=at(100), created=at(0), heartbeat=beat,
                    cluster=with_roles(trainer=(2, 2), reward=(1, 2)),
                    ray_job=ray_job("RUNNING"))  # fmt: skip
    plan = decide(seen)
    assert plan.status.phase == Phase.RUNNING
    degraded = next(c for c in plan.status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.message) == (
        "True",
        "reward 1/2 pods ready, 1/2 reward models",
    )

    # The replacement scores again: every replica back, Degraded clears.
    job = make_job(plan.status.wire(), reward={"type": "model", "function": None},
                   model={"reward": "/models/rm"}, roles=roles)  # fmt: skip
    back = decide(replace(seen, job=job, cluster=with_roles(trainer=(2, 2), reward=(2, 2)),
                          heartbeat=replace(beat, reward_models=EngineCount(2, 2))))  # fmt: skip
    assert [c.status for c in back.status.conditions if c.type == "Degraded"] == ["False"]
    assert [e.reason for e in back.events] == ["ReplicasRestored"]


def test_an_elastic_role_below_its_replicas_is_degraded_not_failed() -> None:
    job = make_job(submitted(), roles={"rollout": {"replicas": 2, "minReplicas": 1}})
    beat = HeartbeatView(renewed=at(99), step=7, attempt=0, rollout_engines=(1, 2))
    seen = Observed(job=job, now=at(100), created=at(0), heartbeat=beat,
                    cluster=with_roles(trainer=(2, 2), rollout=(1, 2)),
                    ray_job=ray_job("RUNNING"))  # fmt: skip
    plan = decide(seen)
    assert plan.status.phase == Phase.RUNNING
    degraded = next(c for c in plan.status.conditions if c.type == "Degraded")
    assert degraded.status == "True"
    assert degraded.message == "rollout 1/2 pods ready, 1/2 rollout engines"
    assert [e.reason for e in plan.events] == ["Degraded"]
    assert "degraded" in plan.status.message

    # The pod is back but the engine has not rejoined yet: still degraded, no new Event.
    job = make_job(plan.status.wire(), roles={"rollout": {"replicas": 2, "minReplicas": 1}})
    pod_back = decide(replace(seen, job=job, cluster=with_roles(trainer=(2, 2), rollout=(2, 2))))
    assert [c.status for c in pod_back.status.conditions if c.type == "Degraded"] == ["True"]
    assert pod_back.events == []
    job = make_job(pod_back.status.wire(), roles={"rollout": {"replicas": 2, "minReplicas": 1}})
    rejoined = decide(
        replace(seen, job=job, cluster=with_roles(trainer=(2, 2), rollout=(2, 2)),
                heartbeat=replace(beat, rollout_engines=(2, 2)))
    )  # fmt: skip
    assert [c.status for c in rejoined.status.conditions if c.type == "Degraded"] == ["False"]
    assert [e.reason for e in rejoined.events] == ["ReplicasRestored"]


@pytest.mark.parametrize("phase", [PHASE_STARTING, PHASE_EXITING])
def test_engines_booting_or_going_down_with_their_driver_are_not_degraded(phase: str) -> None:
    """A starting driver reports its engines as they come up (0/2 first) and an exiting one as
    it takes them down: neither is a lost replica, so a healthy job shows no Degraded flap at
    its start and end. A pod that is really missing still does."""
    roles = {"rollout": {"replicas": 2, "minReplicas": 1}}
    job = make_job(submitted(), roles=roles)
    beat = HeartbeatView(renewed=at(99), step=0, attempt=0, phase=phase,
                         rollout_engines=EngineCount(0, 2))  # fmt: skip
    seen = Observed(job=job, now=at(100), created=at(0), heartbeat=beat,
                    cluster=with_roles(trainer=(2, 2), rollout=(2, 2)),
                    ray_job=ray_job("RUNNING"))  # fmt: skip
    plan = decide(seen)
    assert [c for c in plan.status.conditions if c.type == "Degraded"] == []
    assert "Degraded" not in [e.reason for e in plan.events]

    lost_pod = decide(replace(seen, cluster=with_roles(trainer=(2, 2), rollout=(1, 2))))
    degraded = next(c for c in lost_pod.status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.message) == ("True", "rollout 1/2 pods ready")


def test_the_first_step_past_the_checkpoint_marks_the_restart_resumed() -> None:
    history = [{"time": at(100).isoformat(), "reason": "TrainerFailed", "resumedFromStep": 20,
                "detectionSeconds": 2.0}]  # fmt: skip
    job = make_job(submitted(1, restartHistory=history))
    seen = Observed(job=job, now=at(115), created=at(0), cluster=ready_cluster(),
                    ray_job=ray_job("RUNNING", attempt=1),
                    heartbeat=HeartbeatView(renewed=at(112), step=20, attempt=1))  # fmt: skip
    assert decide(seen).status.restart_history[-1].resumed_time is None  # restored, not trained
    beat = HeartbeatView(renewed=at(114), step=21, attempt=1, step_changed=at(113))
    plan = decide(replace(seen, heartbeat=beat))
    assert plan.status.restart_history[-1].resumed_time == at(113)
    resumed = [e for e in plan.events if e.reason == "Resumed"]
    assert resumed and "15s after the TrainerFailed failure" in resumed[0].message


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("Job entrypoint command failed with exit code 137, last available logs (truncated):\n"
         "step 3\nKilled\n", "Job entrypoint command failed with exit code 137"),
        ("failed\nRLHFJOB_FINAL_STATUS code=3 reason=InvalidJob message=no module named x\n",
         "InvalidJob: no module named x"),
        ("", ""),
    ],
)  # fmt: skip
def test_a_failed_ray_job_is_summed_up_in_one_line(message: str, expected: str) -> None:
    assert trainer_failure_summary(message) == expected


def test_a_job_resumed_from_suspension_is_submitted_again_not_taken_for_head_loss() -> None:
    job = make_job(submitted(), suspend=True)
    suspended = decide(Observed(job=job, now=at(100), created=at(0), cluster=ready_cluster()))
    assert suspended.status.submission_id is None
    job = make_job({**suspended.status.wire(), "observedGeneration": 2}, suspend=False)
    job.metadata.generation = 2
    back = decide(Observed(job=job, now=at(200), created=at(0), cluster=ready_cluster()))
    assert SubmitRayJob("job-12345678-0", resume=False) in back.actions
    assert back.status.restart_count == 0


def test_a_head_pod_newer_than_the_running_trainer_means_the_head_was_replaced() -> None:
    running_since = {"type": "TrainerRunning", "status": "True", "reason": "Running",
                     "lastTransitionTime": at(50).isoformat()}  # fmt: skip
    job = make_job(submitted(conditions=[running_since]))
    same_head = decide(Observed(job=job, now=at(100), created=at(0), ray_job=ray_job("RUNNING"),
                                cluster=ready_cluster(head_created=at(10))))  # fmt: skip
    assert DeleteCluster not in kinds(same_head)
    new_head = decide(Observed(job=job, now=at(100), created=at(0),
                               cluster=ready_cluster(head_created=at(95))))  # fmt: skip
    assert kinds(new_head) == [DeleteCluster]
    assert new_head.status.restart_history[-1].reason == "HeadLost"
    # The recreated cluster's new head is not taken for another replacement.
    job = make_job(new_head.status.wire())
    new_cluster = ready_cluster(created=150, head_created=at(160))
    recreated = decide(Observed(job=job, now=at(200), created=at(0), cluster=new_cluster))
    assert DeleteCluster not in kinds(recreated)
    assert SubmitRayJob in kinds(recreated)


# --- what only the cluster can tell: refusals, pods KubeRay cannot create, no node (issue 13) --

REJECTED = ApplyRefusal(
    "RayCluster", "job", 422, "Invalid",
    'RayCluster.ray.io "job" is invalid: spec.headGroupSpec.template.spec.volumes[1]'
    ".persistentVolumeClaim.claimName: Required value",
)  # fmt: skip
FORBIDDEN = ApplyRefusal(
    "Role", "job-trainer", 403, "Forbidden",
    'roles.rbac.authorization.k8s.io "job-trainer" is forbidden: user "rlhf-operator" is '
    "attempting to grant RBAC permissions not currently held",
)  # fmt: skip
QUOTA = (
    'Failed to create head Pod ns/job-head-x, pods "job-head-x" is forbidden: exceeded quota: '
    "pods, requested: pods=1, used: pods=0, limited: pods=0"
)
PSA = (
    'Failed to create worker Pod for the cluster ns/job, pods "job-trainer-worker-x" is '
    'forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false'
)


def cluster_ready(plan) -> Condition:
    return next(c for c in plan.status.conditions if c.type == "ClusterReady")


def warning(message: str = QUOTA, first: float = 10, reason: str = "FailedToCreateHeadPod"):
    return ClusterWarning(reason, message, first_seen=at(first), last_seen=at(first))


@pytest.mark.parametrize(
    ("status", "cluster"),
    [
        (None, None),  # a new job: its RayCluster is refused on creation
        ({"phase": "Provisioning"}, None),
        (submitted(), ready_cluster()),  # a running job whose change is refused
    ],
)
def test_an_object_the_api_server_refuses_fails_the_job_at_once_quoting_it(
    status: dict[str, Any] | None, cluster: ClusterView | None
) -> None:
    seen = Observed(job=make_job(status), now=at(5), created=at(0), cluster=cluster,
                    apply_error=REJECTED)  # fmt: skip
    plan = decide(seen)
    assert plan.status.phase == Phase.FAILED
    assert ApplyCluster not in kinds(plan)
    assert plan.status.message == REJECTED.text
    assert "claimName: Required value" in plan.status.message
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "ClusterRejected")]
    condition = cluster_ready(plan)
    assert (condition.status, condition.reason, condition.message) == (
        "False", "ClusterRejected", REJECTED.text
    )  # fmt: skip
    failed = next(c for c in plan.status.conditions if c.type == "Failed")
    assert failed.reason == "ClusterRejected"
    assert (DeleteCluster in kinds(plan)) is (cluster is not None)
    # And it stays that way: a terminal job applies nothing and says nothing more.
    later = decide(Observed(job=make_job(plan.status.wire()), now=at(60), created=at(0)))
    assert later.actions == [] and later.events == []


def test_an_object_refused_for_now_is_shown_retried_and_given_up_at_the_provisioning_deadline():
    job = make_job(provisioningTimeoutSeconds=100)
    first = decide(Observed(job=job, now=at(0), created=at(0), apply_error=FORBIDDEN))
    assert first.status.phase == Phase.PROVISIONING
    assert first.actions == []  # this reconcile's apply was refused: nothing more to do
    assert first.status.message == f"waiting for the RayCluster: {FORBIDDEN.text}"
    condition = cluster_ready(first)
    assert (condition.status, condition.reason) == ("False", "ApplyRefused")
    assert condition.message == first.status.message
    assert first.requeue_after == pytest.approx(2)
    assert [(e.type, e.reason) for e in first.events] == [("Normal", "Provisioning")]
    assert first.status.observed_generation is None  # not applied: not observed

    # The next reconcile applies again (the policy never remembers a refusal).
    job = make_job(first.status.wire(), provisioningTimeoutSeconds=100)
    retry = decide(Observed(job=job, now=at(40), created=at(0)))
    assert kinds(retry) == [ApplyCluster]
    still = decide(Observed(job=job, now=at(40), created=at(0), apply_error=FORBIDDEN))
    assert still.requeue_after == pytest.approx(20)  # backing off, within the deadline
    assert still.events == []
    job = make_job(still.status.wire(), provisioningTimeoutSeconds=100)
    late = decide(Observed(job=job, now=at(100), created=at(0), apply_error=FORBIDDEN))
    assert late.status.phase == Phase.FAILED
    assert late.status.message == f"the RayCluster was not ready after 100s: {FORBIDDEN.text}"
    assert [e.reason for e in late.events] == ["ProvisioningTimeout"]


def test_a_recreated_cluster_refused_for_now_climbs_the_ladder_after_the_recovery_timeout():
    history = [{"time": at(100).isoformat(), "reason": "HeadLost"}]
    down = {"type": "ClusterReady", "status": "False", "reason": "HeadPodNotReady",
            "lastTransitionTime": at(90).isoformat()}  # fmt: skip
    job = make_job(running(1, phase="Recovering", restartHistory=history, conditions=[down]),
                   recovery={"clusterRecoveryTimeoutSeconds": 60})  # fmt: skip
    waiting = decide(Observed(job=job, now=at(150), created=at(0), apply_error=FORBIDDEN))
    assert waiting.status.phase == Phase.RECOVERING
    assert FORBIDDEN.text in waiting.status.message
    job = make_job(waiting.status.wire(), recovery={"clusterRecoveryTimeoutSeconds": 60})
    climbed = decide(Observed(job=job, now=at(161), created=at(0), apply_error=FORBIDDEN))
    assert climbed.status.restart_count == 2
    assert climbed.status.restart_history[-1].reason == "ClusterUnhealthy"
    assert DeleteCluster not in kinds(climbed)  # there is none to delete


def test_a_change_refused_for_now_leaves_the_running_cluster_and_is_applied_again() -> None:
    job = make_job(submitted())
    job.metadata.generation = 2  # the user scaled a role
    seen = Observed(job=job, now=at(100), created=at(0), cluster=ready_cluster(),
                    ray_job=ray_job("RUNNING"), apply_error=FORBIDDEN)  # fmt: skip
    plan = decide(seen)
    assert plan.status.phase == Phase.RUNNING
    assert ApplyCluster not in kinds(plan)
    assert plan.status.observed_generation == 1  # so the next reconcile applies it again
    assert plan.status.message.endswith(f"not applied yet: {FORBIDDEN.text}")
    job = make_job(plan.status.wire())
    job.metadata.generation = 2
    assert ApplyCluster in kinds(decide(replace(seen, job=job, apply_error=None)))


@pytest.mark.parametrize(
    ("found", "now", "phase", "reason"),
    [
        # Quota may free up: shown at once, waited out until provisioningTimeoutSeconds.
        (warning(QUOTA, first=10), 20, Phase.PROVISIONING, None),
        (warning(QUOTA, first=10), 500, Phase.PROVISIONING, None),
        (warning(QUOTA, first=10), 611, Phase.FAILED, "ProvisioningTimeout"),
        # Pod Security never lets these pods in: failed after the grace.
        (warning(PSA, first=10, reason="FailedToCreateWorkerPod"), 69, Phase.PROVISIONING, None),
        (warning(PSA, first=10, reason="FailedToCreateWorkerPod"), 70, Phase.FAILED,
         "PodCreationFailed"),
        (warning('Pod "job-head-x" is invalid: spec.volumes[1]', first=10), 71, Phase.FAILED,
         "PodCreationFailed"),
        # KubeRay's own validation refused the spec: at once.
        (warning("bad spec", first=10, reason="InvalidRayClusterSpec"), 11, Phase.FAILED,
         "ClusterRejected"),
    ],
)  # fmt: skip
def test_pods_kuberay_cannot_create_show_at_once_and_fail_when_retrying_cannot_help(
    found: ClusterWarning, now: float, phase: Phase, reason: str | None
) -> None:
    job = make_job({"phase": "Provisioning"}, provisioningTimeoutSeconds=600)
    seen = Observed(job=job, now=at(now), created=at(0), cluster_warning=found,
                    cluster=ready_cluster(ready=False),
                    scheduling_problem="not this one")  # fmt: skip
    plan = decide(seen)
    assert plan.status.phase == phase
    assert found.text in plan.status.message
    assert found.message in cluster_ready(plan).message
    if reason is None:
        assert cluster_ready(plan).reason == "PodCreationFailed"
        assert plan.status.message == f"waiting for Ray pods: {found.text}"
        assert plan.events == [] and DeleteCluster not in kinds(plan)
        deadline = 600 - now if not found.permanent else min(600 - now, 70 - now)
        assert plan.requeue_after == pytest.approx(deadline)
    else:
        assert [(e.type, e.reason) for e in plan.events] == [("Warning", reason)]
        assert DeleteCluster in kinds(plan)


def causes() -> list[tuple[dict[str, Any], str, str]]:
    """One world per kind of cause: what it observed, the ClusterReady reason, the words."""
    unschedulable = "the scheduler cannot place pod job-head-x: 0/6 nodes are available"
    not_starting = (
        "container ray-head of pod job-head-x cannot start: CreateContainerConfigError: "
        'secret "hf-token" not found'
    )
    return [
        ({"apply_error": FORBIDDEN}, "ApplyRefused", FORBIDDEN.text),
        ({"cluster": ready_cluster(ready=False), "cluster_warning": warning()},
         "PodCreationFailed", warning().text),
        ({"cluster": ready_cluster(ready=False), "scheduling_problem": unschedulable},
         "Unschedulable", unschedulable),
        ({"cluster": ready_cluster(ready=False), "startup_problem": not_starting},
         "ContainersNotStarting", not_starting),
    ]  # fmt: skip


@pytest.mark.parametrize(("observed", "reason", "cause"), causes())
def test_every_kind_of_cause_shows_the_same_way_while_waiting_and_when_failing(
    observed: dict[str, Any], reason: str, cause: str
) -> None:
    job = make_job({"phase": "Provisioning"}, provisioningTimeoutSeconds=100)
    plan = decide(Observed(job=job, now=at(0), created=at(0), **observed))
    condition = cluster_ready(plan)
    assert (condition.status, condition.reason) == ("False", reason)
    assert condition.message == plan.status.message
    assert plan.status.message.endswith(f": {cause}")
    assert plan.status.message.startswith("waiting for ")
    job = make_job(plan.status.wire(), provisioningTimeoutSeconds=100)
    timed_out = decide(Observed(job=job, now=at(101), created=at(0), **observed))
    assert timed_out.status.message == f"the RayCluster was not ready after 100s: {cause}"
    assert [e.reason for e in timed_out.events] == ["ProvisioningTimeout"]
    assert cluster_ready(timed_out).reason == reason


def test_pods_with_no_known_cause_are_just_starting() -> None:
    job = make_job({"phase": "Provisioning"})
    plan = decide(Observed(job=job, now=at(5), created=at(0), cluster=ready_cluster(ready=False)))
    assert cluster_ready(plan).reason == "PodsNotReady"
    assert plan.status.message == "waiting for Ray pods"


def test_a_job_resumed_from_suspension_gets_a_fresh_provisioning_deadline() -> None:
    suspended = {"phase": "Suspended", "conditions": [
        {"type": "ClusterReady", "status": "False", "reason": "Suspended",
         "lastTransitionTime": at(0).isoformat()}]}  # fmt: skip
    job = make_job(suspended, provisioningTimeoutSeconds=100)
    resumed = decide(Observed(job=job, now=at(5000), created=at(0)))
    assert cluster_ready(resumed).last_transition_time == at(5000)
    job = make_job(resumed.status.wire(), provisioningTimeoutSeconds=100)
    refused = decide(Observed(job=job, now=at(5010), created=at(0), apply_error=FORBIDDEN))
    assert refused.status.phase == Phase.PROVISIONING  # 10s into its deadline, not 5010s


def test_a_recreated_cluster_gets_its_own_recovery_deadline() -> None:
    unhealthy = {"type": "ClusterReady", "status": "False", "reason": "HeadPodNotReady",
                 "lastTransitionTime": at(0).isoformat()}  # fmt: skip
    history = [{"time": at(100).isoformat(), "reason": "HeadLost"}]
    job = make_job(running(1, phase="Recovering", conditions=[unhealthy], restartHistory=history),
                   recovery={"clusterRecoveryTimeoutSeconds": 60})  # fmt: skip
    new = ready_cluster(created=110, ready=False)
    plan = decide(Observed(job=job, now=at(130), created=at(0), cluster=new))
    assert DeleteCluster not in kinds(plan)  # 20s old, not 130s unhealthy
    assert plan.requeue_after == pytest.approx(40)


# --- decide never raises ---------------------------------------------------------------------


def test_naive_times_anywhere_read_as_utc() -> None:
    naive = T0.replace(tzinfo=None)
    job = make_job(running(), activeDeadlineSeconds=1000)
    job.status.start_time = naive  # type: ignore[union-attr]
    seen = Observed(
        job=job,
        now=naive + timedelta(seconds=100),
        created=naive,
        cluster=ready_cluster(created=0, head_created=naive),
        ray_job=ray_job("RUNNING", ended=naive),
        heartbeat=HeartbeatView(renewed=naive + timedelta(seconds=99), step=3, attempt=0,
                                step_changed=naive),
        cluster_warning=ClusterWarning("FailedToCreateHeadPod", PSA, naive, naive),
    )  # fmt: skip
    plan = decide(seen)
    assert plan.status.phase == Phase.RUNNING
    assert plan.status.current_step == 3
    assert plan.requeue_after == pytest.approx(59.5)  # the heartbeat's timeout, renewed 1s ago


@pytest.mark.parametrize(
    "spec",
    [  # the longest the API allows (it bounds every duration a job sets)
        {"activeDeadlineSeconds": 31536000},
        {"ttlSecondsAfterFinished": 31536000},
        {"recovery": {"backoffSeconds": 3600, "maxBackoffSeconds": 86400}},
    ],
)
def test_huge_durations_are_far_away_not_a_crash(spec: dict[str, Any]) -> None:
    history = [{"time": at(0).isoformat(), "reason": "TrainerFailed"}]
    for status in (
        running(10**6, restartHistory=history),
        {"phase": "Failed", "completionTime": at(0).isoformat()},
    ):
        job = make_job(status, **{"recovery": {"maxRestarts": 1000}} | spec)
        decide(Observed(job=job, now=at(10), created=at(0), cluster=ready_cluster()))


def test_a_cause_of_any_length_fits_the_status() -> None:
    job = make_job({"phase": "Provisioning"})
    huge = "m" * 40_000
    seen = Observed(job=job, now=at(5), created=at(0), cluster=ready_cluster(ready=False),
                    scheduling_problem=huge)  # fmt: skip
    plan = decide(seen)
    assert len(plan.status.message) == MESSAGE_LIMIT and plan.status.message.endswith("...")
    assert len(cluster_ready(plan).message) == MESSAGE_LIMIT
    failed = decide(replace(seen, cluster=ready_cluster(ready=True), submit_error=huge))
    assert len(failed.status.message) == MESSAGE_LIMIT


# -- a dashboard that does not answer, and an unchanged world (issue 13, scale) ---------------


@pytest.mark.parametrize(
    ("now", "retry"),
    [(0, 5), (4.9, 5), (5, 15), (14, 15), (15, 35), (35, 75), (75, 135), (134, 135), (1000, 1035)],
)
def test_a_silent_dashboard_is_asked_ever_less_often_up_to_once_a_minute(
    now: float, retry: float
) -> None:
    assert dashboard_retry_at(at(0), at(now)) == at(retry)


def test_a_dashboard_that_never_answered_backs_off_without_a_deadline_or_a_hot_loop() -> None:
    # Nothing was submitted, so no recovery deadline: past clusterRecoveryTimeoutSeconds the
    # job still waits at the backoff's pace (it used to be kicked every 0.5 s from then on).
    down = {"type": "DashboardReachable", "status": "False", "reason": "Unreachable",
            "message": "refused", "lastTransitionTime": at(100).isoformat()}  # fmt: skip
    job = make_job({"phase": "Provisioning", "observedGeneration": 1, "conditions": [down]},
                   recovery={"clusterRecoveryTimeoutSeconds": 60})  # fmt: skip
    for now in (101, 150, 200, 1000):
        plan = decide(Observed(job=job, now=at(now), created=at(0), cluster=ready_cluster(),
                               dashboard_error="refused"))  # fmt: skip
        assert kinds(plan) == [] and plan.requeue_after is None
        assert plan.dashboard_retry_at == dashboard_retry_at(at(100), at(now))
        assert plan.status.phase == Phase.PROVISIONING


def test_backing_off_never_delays_the_cluster_recovery_deadline() -> None:
    down = {"type": "DashboardReachable", "status": "False", "reason": "Unreachable",
            "message": "refused", "lastTransitionTime": at(100).isoformat()}  # fmt: skip
    job = make_job(submitted(conditions=[down]), recovery={"clusterRecoveryTimeoutSeconds": 60})
    seen = Observed(job=job, now=at(140), created=at(0), cluster=ready_cluster(),
                    dashboard_error="refused")  # fmt: skip
    waiting = decide(seen)
    assert kinds(waiting) == []
    # The backoff's next ask would be at 175 s: it is asked at the deadline instead, and the
    # reconciler is kicked then rather than at the next timer tick.
    assert waiting.dashboard_retry_at == at(160)
    assert waiting.requeue_after == pytest.approx(20)
    late = decide(replace(seen, now=at(160)))
    assert kinds(late) == [DeleteCluster]
    assert late.status.restart_history[-1].reason == "ClusterUnhealthy"
    assert "has not answered for 60s" in late.status.restart_history[-1].message


def test_an_answering_dashboard_is_asked_on_every_reconcile() -> None:
    job = make_job(submitted())
    plan = decide(Observed(job=job, now=at(100), created=at(0), cluster=ready_cluster(),
                           ray_job=ray_job("RUNNING")))  # fmt: skip
    assert plan.dashboard_retry_at is None


def _settled(seen: Observed) -> tuple[Observed, Any]:
    """Decide, store the status as the API server would, and decide again 5 s later."""
    first = decide(seen)
    job = make_job(first.status.wire(), **seen.job.spec.model_dump(by_alias=True, mode="json"))
    return replace(seen, job=job), first


def _unchanged_after(seen: Observed, *later: float) -> None:
    """Reconciles at `later` seconds of a world that does not change write the same status."""
    stored, first = _settled(seen)
    for seconds in later:
        again = decide(replace(stored, now=at(seconds)))
        assert again.status.wire() == first.status.wire(), seconds
        assert again.events == []


def test_a_healthy_trainer_whose_lease_is_not_renewed_yet_changes_nothing() -> None:
    beat = HeartbeatView(renewed=at(99), step=7, total_steps=10, attempt=0)
    seen = Observed(job=make_job(submitted()), now=at(100), created=at(0),
                    cluster=ready_cluster(), ray_job=ray_job("RUNNING"),
                    heartbeat=beat)  # fmt: skip
    _unchanged_after(seen, 105, 110, 130)
    healthy = next(c for c in decide(seen).status.conditions if c.type == "Healthy")
    assert healthy.message == "step 7"  # no "renewed 1s ago": that would change every time


def test_a_head_pod_not_ready_within_its_grace_writes_once() -> None:
    job = make_job(submitted(), liveness={"heartbeatTimeoutSeconds": 60})
    seen = Observed(job=job, now=at(110), created=at(0),
                    cluster=ready_cluster(head_not_ready_since=at(100)))  # fmt: skip
    _unchanged_after(seen, 115, 120, 155)
    assert decide(seen).status.message == "the Ray head pod has not been ready since 00:01:40Z"


def test_a_submission_refused_again_keeps_its_transition_time() -> None:
    # Each reconcile finds the dashboard answering (Reachable) and then the submission refused
    # (SubmitFailed): the condition ends False both times, so nothing is written again.
    job = make_job({"phase": "Provisioning", "observedGeneration": 1})
    seen = Observed(job=job, now=at(10), created=at(0), cluster=ready_cluster(),
                    submit_error="HTTP 500: busy")  # fmt: skip
    _unchanged_after(seen, 15, 20)
    stored, _ = _settled(seen)
    reachable = next(
        c for c in decide(replace(stored, now=at(20))).status.conditions
        if c.type == "DashboardReachable"
    )  # fmt: skip
    assert (reachable.status, reachable.last_transition_time) == ("False", at(10))


def test_a_condition_forgotten_for_a_new_provisioning_still_starts_a_new_clock() -> None:
    suspended = decide(Observed(job=make_job(running(), suspend=True), now=at(50), created=at(0),
                                cluster=ready_cluster()))  # fmt: skip
    job = make_job(suspended.status.wire())
    resumed = decide(Observed(job=job, now=at(90), created=at(0)))
    ready = next(c for c in resumed.status.conditions if c.type == "ClusterReady")
    assert (ready.status, ready.last_transition_time) == ("False", at(90))


# -- an elastic trainer (roles.trainer.minReplicas): fewer ranks, then back to all ---------------

ELASTIC = {"trainer": {"replicas": 2, "minReplicas": 1, "replacementTimeoutSeconds": 60}}


def elastic_world(status: dict[str, Any], now: float, trainer: tuple[int, int], **seen: Any):
    job = make_job(status, recovery={"backoffSeconds": 30}, roles=ELASTIC)
    return Observed(job=job, now=at(now), created=at(0), cluster=with_roles(trainer=trainer),
                    **seen)  # fmt: skip


def test_an_elastic_trainer_waits_for_lost_pods_then_starts_on_the_ready_ones() -> None:
    lost = running(1, phase="Recovering", observedGeneration=1)
    waiting = decide(elastic_world(lost, 100, (1, 2)))
    assert SubmitRayJob not in kinds(waiting)
    assert "trainer 1/2 pods ready" in waiting.status.message
    assert "starts on the Ready ones, at least 1, in 60s" in waiting.status.message
    assert waiting.status.trainer_short_since == at(100)
    assert waiting.requeue_after is not None and waiting.requeue_after <= 60

    still = decide(elastic_world(waiting.status.wire(), 159, (1, 2)))
    assert SubmitRayJob not in kinds(still)
    started = decide(elastic_world(waiting.status.wire(), 160, (1, 2)))
    assert SubmitRayJob("job-12345678-1", resume=True, trainer_replicas=1) in started.actions
    assert started.status.trainer_replicas == 1
    (warning,) = [e for e in started.events if e.reason == "Degraded"]
    assert warning.type == "Warning" and "starts on 1 of 2 replicas" in warning.message

    # A pod that comes back in time: the trainer starts on all of them.
    back = decide(elastic_world(waiting.status.wire(), 130, (2, 2)))
    assert SubmitRayJob("job-12345678-1", resume=True) in back.actions
    assert back.status.trainer_short_since is None and back.status.trainer_replicas is None


@pytest.mark.parametrize(
    ("trainer", "ready", "words"),
    [
        ({"replicas": 2}, 1, "trainer 1/2 pods ready"),  # not elastic: waits for every pod
        ({"replicas": 3, "minReplicas": 2}, 1, "needs at least 2 Ready"),  # below the minimum
    ],
)
def test_a_trainer_never_starts_below_its_minimum(
    trainer: dict[str, Any], ready: int, words: str
) -> None:
    status = running(1, phase="Recovering", observedGeneration=1, trainerShortSince=at(0))
    job = make_job(status, recovery={"backoffSeconds": 0}, roles={"trainer": trainer})
    replicas = trainer["replicas"]
    plan = decide(Observed(job=job, now=at(10_000), created=at(0),
                           cluster=with_roles(trainer=(ready, replicas))))  # fmt: skip
    assert SubmitRayJob not in kinds(plan)
    assert words in plan.status.message


def test_a_trainer_on_fewer_replicas_is_degraded_and_grows_back_at_a_checkpoint() -> None:
    degraded = submitted(1, trainerReplicas=1, currentStep=12, restartHistory=[
        {"time": at(50).isoformat(), "reason": "TrainerPodLost"}])  # fmt: skip
    beat = HeartbeatView(renewed=at(99), step=12, attempt=1)
    job_running = ray_job("RUNNING", attempt=1)
    plan = decide(elastic_world(degraded, 100, (1, 2), ray_job=job_running, heartbeat=beat))
    assert plan.status.phase == Phase.RUNNING
    assert condition(plan, "Degraded").message == "trainer 1/2 replicas"
    assert "degraded: trainer 1/2 replicas" in plan.status.message

    # Every pod is back: the trainer is asked to checkpoint its step and stop; the cluster stays.
    asked = decide(elastic_world(plan.status.wire(), 200, (2, 2), ray_job=job_running,
                                 heartbeat=replace(beat, renewed=at(199))))  # fmt: skip
    assert asked.actions == [RequestStop(at(200))]
    assert (condition(asked, "Draining").status, condition(asked, "Draining").reason) == (
        "True",
        "Resizing",
    )
    # It did (exit code 4, its step checkpointed): a restart on every replica, at once.
    answered = replace(beat, renewed=at(210), checkpoint_requested_at=at(200),
                       checkpoint_saved_step=13)  # fmt: skip
    stopped = ray_job("FAILED", attempt=1, exit_code=4)
    resized = decide(elastic_world(asked.status.wire(), 211, (2, 2), ray_job=stopped,
                                   heartbeat=answered))  # fmt: skip
    assert ClearStopRequest in kinds(resized) and DeleteCluster not in kinds(resized)
    assert resized.status.restart_history[-1].reason == "TrainerResized"
    assert (resized.status.restart_count, resized.status.resizes) == (2, 1)
    assert resized.status.trainer_replicas is None
    assert "a resize from" in resized.status.message
    again = decide(elastic_world(resized.status.wire(), 212, (2, 2), previous_ray_job=stopped))
    assert SubmitRayJob("job-12345678-2", resume=True) in again.actions, "no backoff"


def test_resizes_spend_no_restart_budget() -> None:
    status = submitted(2, resizes=2, restartHistory=[
        {"time": at(50).isoformat(), "reason": "TrainerResized"}])  # fmt: skip
    job = make_job(status, recovery={"maxRestarts": 1, "backoffSeconds": 0}, roles=ELASTIC)
    failed = ray_job("FAILED", attempt=2, exit_code=1, ended=at(99), message="boom")
    plan = decide(Observed(job=job, now=at(100), created=at(0),
                           cluster=with_roles(trainer=(2, 2)), ray_job=failed))  # fmt: skip
    assert plan.status.phase == Phase.RECOVERING, plan.status.message
    assert "restart 1/1" in plan.status.message


def test_a_cluster_deleted_under_the_running_trainer_is_a_head_lost_restart() -> None:
    job = make_job(submitted(currentStep=9, lastCheckpoint={"step": 8, "path": "/c/step-8"}))
    plan = decide(Observed(job=job, now=at(100), created=at(0)))  # no RayCluster any more
    assert kinds(plan) == [ApplyCluster]
    record = plan.status.restart_history[-1]
    assert (record.reason, record.resumed_from_step) == ("HeadLost", 8)
    assert "deleted under the running trainer" in record.message
    assert plan.status.restart_count == 1 and plan.status.submission_id is None
    assert condition(plan, "TrainerRunning").status == "False"  # a new head is no second loss
    # The operator's own deletions are not counted again: after the restart, or a move off a
    # drained node (which forgets the submission first), the cluster's absence is expected.
    again = decide(Observed(job=make_job(plan.status.wire()), now=at(101), created=at(0)))
    assert again.status.restart_count == 1
    # Nor is the new cluster's head, younger than the trainer that ran on the old one.
    new = ready_cluster(105, head_created=at(106))
    resumed = decide(Observed(job=make_job(again.status.wire()), now=at(110), created=at(0),
                              cluster=new))  # fmt: skip
    assert resumed.status.restart_count == 1
    assert SubmitRayJob("job-12345678-1", resume=True) in resumed.actions


# --- evaluation, export and tracking: what the trainer reports, and what a tracker adds ----------

EXPORT = "/mnt/checkpoints/default/job/export"


def observed(job: Any = None, **beat: Any) -> Observed:
    report = HeartbeatView(renewed=at(99), attempt=0, step=3, total_steps=3, **beat)
    return Observed(
        job=job or make_job(running()),
        now=at(100),
        created=at(0),
        cluster=ready_cluster(),
        ray_job=ray_job("RUNNING"),
        heartbeat=report,
    )


def test_the_latest_evaluation_goes_into_the_status_with_an_event() -> None:
    plan = decide(observed(eval_step=3, eval_score=0.5, eval_accuracy=0.75, eval_pass_at_k=0.9))
    result = plan.status.evaluation
    assert result is not None
    assert (result.step, result.score, result.accuracy, result.pass_at_k) == (3, 0.5, 0.75, 0.9)
    (event,) = [e for e in plan.events if e.reason == "Evaluated"]
    assert "accuracy 0.750" in event.message and "step 3" in event.message


def test_an_evaluation_already_in_the_status_makes_no_second_event() -> None:
    status = running(evaluation={"step": 3, "accuracy": 0.75})
    plan = decide(observed(make_job(status), eval_step=3, eval_accuracy=0.75))
    assert not [e for e in plan.events if e.reason == "Evaluated"]


def test_the_export_goes_into_the_status_when_it_is_the_jobs_own() -> None:
    plan = decide(observed(export_step=3, export_path=EXPORT))
    assert plan.status.export is not None
    assert (plan.status.export.step, plan.status.export.path) == (3, EXPORT)
    assert [e.reason for e in plan.events].count("Exported") == 1


@pytest.mark.parametrize(
    "path",
    [
        "/mnt/checkpoints/default/other-job/export",  # another job's directory
        "/mnt/checkpoints/default/job/../other/export",  # out of it by `..`
        "/etc/passwd",
        "s3://somebody-elses-bucket/default/job/export/",
        "relative/export",
    ],
)
def test_an_export_path_outside_the_job_is_not_believed(path: str) -> None:
    plan = decide(observed(export_step=3, export_path=path))
    assert plan.status.export is None
    assert "Exported" not in [e.reason for e in plan.events]


def test_a_bucket_export_is_the_jobs_own_only_under_its_prefix() -> None:
    job = make_job(running(), checkpoint={"objectStore": {"bucket": "ckpts", "prefix": "team/"}})
    assert contract.is_job_output(job, "s3://ckpts/team/default/job/export/")
    assert not contract.is_job_output(job, "s3://ckpts/team/default/other/export/")
    assert not contract.is_job_output(job, "s3://ckpts/other/default/job/export/")


def test_trackers_that_lose_calls_make_one_warning_per_increase() -> None:
    plan = decide(observed(tracking_failures=2))
    assert plan.status.tracking_failures == 2
    (event,) = [e for e in plan.events if e.reason == "TrackingUnavailable"]
    assert event.type == "Warning" and "2 calls" in event.message
    again = decide(observed(make_job(running(trackingFailures=2)), tracking_failures=2))
    assert not [e for e in again.events if e.reason == "TrackingUnavailable"]


def tracked_job(**tracking: Any) -> Any:
    return parse_job(merge_patch(valid_job("job"), {"spec": {"tracking": tracking}}))


def head_and_worker_env(job: Any) -> dict[str, dict[str, Any]]:
    """Each pod template's container env by name: the head's and the workers' groups."""
    cluster = builder.build_ray_cluster(job)
    templates = {"head": cluster["spec"]["headGroupSpec"]["template"]}
    for group in cluster["spec"]["workerGroupSpecs"]:
        templates[group["groupName"]] = group["template"]
    return {
        name: {var["name"]: var for var in template["spec"]["containers"][0]["env"]}
        for name, template in templates.items()
    }


def test_tracking_secrets_reach_only_the_heads_container_and_each_key_is_optional() -> None:
    job = tracked_job(
        mlflow={"trackingUri": "http://mlflow.mlflow:5000", "credentialsSecret": "ml"},
        wandb={"project": "p", "apiKeySecret": "wb"},
    )
    envs = head_and_worker_env(job)
    keys = {*MLFLOW_SECRET_KEYS, WANDB_SECRET_KEY}
    refs = {name: var["valueFrom"]["secretKeyRef"] for name, var in envs.pop("head").items()
            if name in keys}  # fmt: skip
    assert refs == {
        **{key: {"name": "ml", "key": key, "optional": True} for key in MLFLOW_SECRET_KEYS},
        WANDB_SECRET_KEY: {"name": "wb", "key": WANDB_SECRET_KEY, "optional": True},
    }
    assert envs and all(not keys & set(env) for env in envs.values())


def test_a_tracker_is_a_declared_destination_and_offline_wandb_is_none() -> None:
    job = tracked_job(mlflow={"trackingUri": "http://10.1.2.3:5000"}, wandb={"project": "p"})
    destinations = network.job_destinations(job)
    assert [(str(d.address), d.port) for d in destinations] == [("10.1.2.3", 5000)]
    online = tracked_job(wandb={"project": "p", "apiKeySecret": "wb"})
    assert [(d.host, d.port) for d in network.job_destinations(online)] == [("api.wandb.ai", 443)]
