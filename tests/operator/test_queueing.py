"""Kueue admission: the Workload a queued job gets, how Kueue's answers read, the status writes
owed to Kueue, and the lifecycle of a queued job (admitted, preempted, drained, requeued)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rlhf_operator import builder, names, queueing
from rlhf_operator.lifecycle import (
    ApplyCluster,
    ApplyWorkload,
    ClearStopRequest,
    DeleteCluster,
    FinishWorkload,
    ReleaseQuota,
    RequestStop,
    SetPodsReady,
    SetWorkloadActive,
    StopRayJob,
    SubmitRayJob,
    decide,
)
from rlhf_operator.policy import JobPolicy
from rlhf_operator.views import ApplyRefusal, ClusterView, HeartbeatView, Observed, RayJobView
from rlhfjob.api import Phase, RLHFJob
from rlhfjob.config import parse_job
from rlhfjob.contract import kueue
from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import valid_job

T0 = datetime(2026, 1, 1, tzinfo=UTC)
QUEUE = "team-a"
SECRET = {"name": "hf", "key": "token"}


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def queued_job(
    status: dict[str, Any] | None = None, labels: dict[str, str] | None = None, **spec: Any
) -> RLHFJob:
    document = merge_patch(valid_job("job"), {"spec": spec})
    document["metadata"].update(
        uid="12345678-abcd",
        generation=1,
        labels={kueue.LABEL_QUEUE_NAME: QUEUE, **(labels or {})},
    )
    if status is not None:
        document["status"] = status
    return parse_job(document)


def condition(type_: str, status: str, reason: str = "", message: str = "") -> dict[str, Any]:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }


ADMISSION = {
    "clusterQueue": "gpus",
    "podSetAssignments": [
        {"name": "head", "flavors": {"cpu": "cpu", "memory": "cpu"}, "count": 1},
        {"name": "trainer", "flavors": {"cpu": "h100", "nvidia.com/gpu": "h100"}, "count": 1},
        {"name": "rollout", "flavors": {"cpu": "h100", "nvidia.com/gpu": "h100"}, "count": 1},
    ],
}


def workload_body(*conditions: dict[str, Any], admission: bool = True) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": list(conditions)}
    if admission:
        status["admission"] = ADMISSION
    return {
        "metadata": {"name": "rlhfjob-job-abcde", "resourceVersion": "7"},
        "spec": {"active": True},
        "status": status,
    }


PENDING = queueing.workload_view(
    workload_body(
        condition(kueue.QUOTA_RESERVED, "False", "Pending", "couldn't assign flavors"),
        admission=False,
    )
)
ADMITTED = queueing.workload_view(
    workload_body(
        condition(kueue.QUOTA_RESERVED, "True", "QuotaReserved"),
        condition(kueue.ADMITTED, "True", "Admitted"),
    )
)
PREEMPTED = queueing.workload_view(
    workload_body(
        condition(kueue.QUOTA_RESERVED, "True", "QuotaReserved"),
        condition(kueue.ADMITTED, "True", "Admitted"),
        condition(kueue.EVICTED, "True", "Preempted", "Preempted to accommodate a workload"),
        condition(kueue.PREEMPTED, "True", "InClusterQueue", "Preempted to accommodate"),
    )
)


# -- the Workload -----------------------------------------------------------------------------


def test_the_workload_has_a_pod_set_per_group_and_none_of_the_pods_secrets() -> None:
    job = queued_job(
        roles={
            "trainer": {"replicas": 2, "gpus": 8, "nodeSelector": {"pool": "h100"}},
            "rollout": {"backend": "hf", "gpus": 1},
        },
        pods={
            "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}]
        },
    )
    workload = builder.build_workload(job, priority=None)
    assert workload["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    assert workload["metadata"]["name"] == names.workload_name(job)
    assert workload["metadata"]["ownerReferences"][0]["uid"] == "12345678-abcd"
    assert workload["metadata"]["labels"][kueue.LABEL_JOB_UID] == "12345678-abcd"
    spec = workload["spec"]
    assert spec["queueName"] == QUEUE and spec["active"] is True
    assert [(p["name"], p["count"]) for p in spec["podSets"]] == [
        ("head", 1), ("trainer", 2), ("rollout", 1),
    ]  # fmt: skip
    assert all("minCount" not in p for p in spec["podSets"])  # a gang: all or nothing
    trainer = spec["podSets"][1]["template"]["spec"]
    cluster = builder.build_ray_cluster(job)
    pod = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert trainer["containers"][0]["resources"] == pod["containers"][0]["resources"]
    assert trainer["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "8"
    assert trainer["nodeSelector"] == pod["nodeSelector"]
    assert "HF_TOKEN" not in str(workload) and "secretKeyRef" not in str(workload)
    assert "priorityClassRef" not in spec


@pytest.mark.parametrize(
    ("labels", "pods", "ref"),
    [
        ({kueue.LABEL_PRIORITY_CLASS: "high"}, None,
         {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "high"}),
        ({}, {"priorityClassName": "batch"},
         {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "batch"}),
        # Kueue's label wins over the pods' class.
        ({kueue.LABEL_PRIORITY_CLASS: "high"}, {"priorityClassName": "batch"},
         {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "high"}),
    ],
)  # fmt: skip
def test_the_priority_comes_from_kueues_label_or_the_pods_class(
    labels: dict[str, str], pods: dict[str, Any] | None, ref: dict[str, str]
) -> None:
    job = queued_job(labels=labels, **({"pods": pods} if pods else {}))
    spec = builder.build_workload(job, priority=1000)["spec"]
    assert spec["priorityClassRef"] == ref and spec["priority"] == 1000


def test_a_suspended_job_has_an_inactive_workload() -> None:
    assert builder.build_workload(queued_job(suspend=True), None)["spec"]["active"] is False


def test_workload_names_are_stable_per_job_and_differ_by_uid() -> None:
    job = queued_job()
    again = queued_job()
    other = parse_job({**valid_job("job"), "metadata": {"name": "job", "uid": "other"}})
    assert names.workload_name(job) == names.workload_name(again)
    assert names.workload_name(job) != names.workload_name(other)
    assert names.workload_name(job).startswith("rlhfjob-job-")


# -- reading Kueue's answer -------------------------------------------------------------------


def test_kueues_conditions_read_as_waiting_admitted_and_evicted() -> None:
    assert PENDING is not None and ADMITTED is not None and PREEMPTED is not None
    assert not PENDING.quota_reserved and not PENDING.running_allowed
    assert PENDING.waiting_message == "couldn't assign flavors"
    assert ADMITTED.running_allowed and ADMITTED.cluster_queue == "gpus"
    assert ADMITTED.flavors == {"head": ("cpu",), "trainer": ("h100",), "rollout": ("h100",)}
    assert PREEMPTED.quota_reserved and not PREEMPTED.running_allowed
    assert PREEMPTED.eviction == queueing.Eviction(
        "Preempted", "Preempted to accommodate a workload"
    )
    assert PREEMPTED.eviction.requeued
    assert queueing.workload_view(None) is None
    deleting = {**workload_body(), "metadata": {"name": "w", "deletionTimestamp": "2026-01-01"}}
    assert queueing.workload_view(deleting) is None


def test_an_admitted_group_lands_where_its_flavors_say() -> None:
    assert ADMITTED is not None
    flavors = {
        "h100": {"spec": {"nodeLabels": {"pool": "h100", "zone": "a"},
                          "tolerations": [{"key": "gpu", "operator": "Exists"}]}},
        "cpu": {"spec": {"nodeLabels": {"pool": "cpu"}}},
    }  # fmt: skip
    placed = queueing.placement(ADMITTED, flavors)
    assert placed["trainer"] == {
        "nodeSelector": {"pool": "h100", "zone": "a"},
        "tolerations": [{"key": "gpu", "operator": "Exists"}],
    }
    cluster = builder.build_ray_cluster(queued_job(), placed)
    trainer = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert trainer["nodeSelector"]["zone"] == "a"
    assert {"key": "gpu", "operator": "Exists"} in trainer["tolerations"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    assert head["nodeSelector"]["pool"] == "cpu" and "tolerations" not in head


# -- what the operator writes to Kueue --------------------------------------------------------


def test_giving_the_quota_back_after_a_preemption_requeues_the_workload() -> None:
    assert PREEMPTED is not None
    patch = queueing.release_patch(PREEMPTED, at(30), generation=1)
    assert patch["metadata"] == {"resourceVersion": "7"}  # a Workload Kueue changed is re-read
    assert patch["status"]["admission"] is None
    by_type = {c["type"]: c for c in patch["status"]["conditions"]}
    assert by_type[kueue.REQUEUED]["status"] == "True"
    assert by_type[kueue.REQUEUED]["reason"] == "Preempted"
    assert by_type[kueue.QUOTA_RESERVED]["status"] == "False"
    assert by_type[kueue.QUOTA_RESERVED]["lastTransitionTime"] == "2026-01-01T00:00:30Z"
    assert by_type[kueue.ADMITTED]["reason"] == "NoReservation"
    assert patch["status"]["accumulatedPastExecutionTimeSeconds"] == 30  # admitted at 0, out at 30
    # Kueue's own conditions stay as they were.
    assert by_type[kueue.EVICTED]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert by_type[kueue.PREEMPTED]["status"] == "True"


def test_a_deactivated_workload_is_not_requeued() -> None:
    assert ADMITTED is not None
    inactive = replace(ADMITTED, active=False, eviction=queueing.Eviction("Deactivated", "x"))
    by_type = {
        c["type"]: c for c in queueing.release_patch(inactive, at(1))["status"]["conditions"]
    }
    assert by_type[kueue.REQUEUED]["status"] == "False"


def test_finishing_marks_the_workload_finished() -> None:
    assert ADMITTED is not None
    patch = queueing.finish_patch(ADMITTED, True, "training finished", at(9))
    finished = next(c for c in patch["status"]["conditions"] if c["type"] == kueue.FINISHED)
    assert finished["status"] == "True" and finished["reason"] == "Succeeded"
    assert "admission" not in patch["status"]


def test_a_queue_label_is_refused_where_the_operator_runs_without_kueue() -> None:
    problems = JobPolicy().problems(queued_job())
    assert len(problems) == 1
    assert problems[0].startswith(f"metadata.labels[{kueue.LABEL_QUEUE_NAME}]")
    assert JobPolicy(kueue=True).problems(queued_job()) == []


# -- the lifecycle of a queued job ------------------------------------------------------------


def ray_job(state: str) -> RayJobView:
    return RayJobView(submission_id="job-12345678-0", status=state)  # type: ignore[arg-type]


def cluster() -> ClusterView:
    return ClusterView(name="job", created=at(0), ready=True, dashboard="http://head:8265")


def running(**status: Any) -> dict[str, Any]:
    admitted = condition("Admitted", "True", "Admitted", "admitted by ClusterQueue gpus")
    return {"phase": "Running", "startTime": T0.isoformat(), "currentStep": 12,
            "submissionId": "job-12345678-0", "conditions": [admitted], **status}  # fmt: skip


def kinds(plan: Any) -> list[type]:
    return [type(action) for action in plan.actions]


def job_condition(plan: Any, type_: str) -> Any:
    return next(c for c in plan.status.conditions if c.type == type_)


def test_a_queued_job_gets_a_workload_and_no_cluster_before_admission() -> None:
    plan = decide(Observed(job=queued_job(), now=at(0), created=at(0)))
    assert kinds(plan) == [ApplyWorkload]
    assert plan.status.phase == Phase.PENDING
    assert [e.reason for e in plan.events] == ["Queued"]
    assert job_condition(plan, "Admitted").status == "False"
    waiting = decide(Observed(job=queued_job(), now=at(1), created=at(0), workload=PENDING))
    assert waiting.actions == []
    assert waiting.status.phase == Phase.PENDING
    assert "couldn't assign flavors" in waiting.status.message  # Kueue's own words
    assert job_condition(waiting, "Admitted").reason == "Pending"


def test_a_refused_workload_is_shown_and_retried_or_fails_the_job() -> None:
    forbidden = ApplyRefusal("Workload", "w", 403, "Forbidden", "cannot create workloads")
    seen = Observed(job=queued_job(), now=at(0), created=at(0), workload_error=forbidden)
    plan = decide(seen)
    assert plan.actions == [] and plan.status.phase == Phase.PENDING
    assert "cannot create workloads" in job_condition(plan, "Admitted").message
    assert plan.requeue_after is not None
    invalid = replace(forbidden, code=422, reason="Invalid", message="spec.queueName: Invalid")
    failed = decide(replace(seen, workload_error=invalid))
    assert failed.status.phase == Phase.FAILED and "spec.queueName" in failed.status.message


def test_admission_creates_the_cluster_and_says_who_admitted_it() -> None:
    plan = decide(Observed(job=queued_job(), now=at(2), created=at(0), workload=ADMITTED))
    assert plan.actions == [ApplyCluster(), SetPodsReady(False)]  # for Kueue's waitForPodsReady
    assert plan.status.phase == Phase.PROVISIONING
    admitted = job_condition(plan, "Admitted")
    assert admitted.status == "True" and "gpus" in admitted.message
    assert "Admitted" in [e.reason for e in plan.events]


def test_a_preempted_job_drains_then_releases_its_cluster_then_its_quota() -> None:
    beat = HeartbeatView(renewed=at(45), step=12, attempt=0)
    seen = Observed(job=queued_job(running()), now=at(50), created=at(0), cluster=cluster(),
                    ray_job=ray_job("RUNNING"), heartbeat=beat, workload=PREEMPTED)  # fmt: skip
    asked = decide(seen)
    assert asked.actions == [RequestStop(at(50))]
    assert job_condition(asked, "Draining").reason == "Preempted"
    assert "Preempted to accommodate" in job_condition(asked, "Draining").message
    # The trainer checkpointed step 13 and exited: the cluster goes, the quota stays for now.
    status = asked.status.model_dump(by_alias=True, mode="json", exclude_none=True)
    saved = replace(beat, renewed=at(60), checkpoint_requested_at=at(50), checkpoint_saved_step=13)
    done = decide(replace(seen, job=queued_job(status), now=at(61), heartbeat=saved,
                          ray_job=ray_job("FAILED")))  # fmt: skip
    assert kinds(done) == [ClearStopRequest, DeleteCluster]
    assert done.status.phase == Phase.PENDING
    assert job_condition(done, "Draining").reason == "Drained"
    # The cluster is gone but a pod is still terminating: the preemptor must wait.
    status = done.status.model_dump(by_alias=True, mode="json", exclude_none=True)
    later = replace(seen, job=queued_job(status), now=at(65), cluster=None, ray_job=None,
                    heartbeat=saved, pods_left=1)  # fmt: skip
    assert ReleaseQuota not in kinds(decide(later))
    released = decide(replace(later, pods_left=0))
    assert kinds(released) == [ReleaseQuota]
    assert "QuotaReleased" in [e.reason for e in released.events]
    assert released.status.restart_count == 0  # a preemption is not a failure
    assert released.status.submission_id is None


def test_a_readmitted_job_resumes_the_same_attempt_from_the_drains_checkpoint() -> None:
    drained = condition("Draining", "False", "Drained", "evicted by Kueue: the trainer stopped")
    status = {"phase": "Pending", "startTime": T0.isoformat(), "currentStep": 13,
              "lastCheckpoint": {"step": 13, "path": "/c/13"}, "conditions": [drained]}  # fmt: skip
    waiting = replace(ADMITTED, pods_ready=False)
    plan = decide(Observed(job=queued_job(status), now=at(100), created=at(0), workload=waiting))
    assert kinds(plan) == [ApplyCluster]
    status = plan.status.model_dump(by_alias=True, mode="json", exclude_none=True)
    ready = decide(Observed(job=queued_job(status), now=at(110), created=at(0),
                            cluster=cluster(), workload=waiting))  # fmt: skip
    assert ready.actions == [
        SubmitRayJob(submission_id="job-12345678-0", resume=True),
        SetPodsReady(True),
    ]


def test_a_workload_that_loses_its_admission_takes_the_cluster_down() -> None:
    # Someone cleared the reservation (or deleted and recreated the Workload) under a cluster.
    seen = Observed(job=queued_job(running()), now=at(50), created=at(0), cluster=cluster(),
                    ray_job=ray_job("RUNNING"), workload=PENDING)  # fmt: skip
    plan = decide(seen)
    assert kinds(plan) == [StopRayJob, DeleteCluster]
    assert plan.status.phase == Phase.PENDING


def test_suspending_a_queued_job_deactivates_its_workload_and_gives_the_quota_back() -> None:
    job = queued_job(running(), suspend=True)
    seen = Observed(job=job, now=at(50), created=at(0), cluster=cluster(),
                    ray_job=ray_job("RUNNING"), workload=ADMITTED)  # fmt: skip
    plan = decide(seen)
    assert kinds(plan) == [StopRayJob, DeleteCluster, SetWorkloadActive]
    assert plan.actions[-1] == SetWorkloadActive(False)
    assert ADMITTED is not None
    inactive = replace(ADMITTED, active=False)
    status = plan.status.model_dump(by_alias=True, mode="json", exclude_none=True)
    gone = decide(Observed(job=queued_job(status, suspend=True), now=at(60), created=at(0),
                           workload=inactive))  # fmt: skip
    assert kinds(gone) == [ReleaseQuota]
    assert gone.status.phase == Phase.SUSPENDED
    resumed = replace(inactive, quota_reserved=False, admitted=False)
    status = gone.status.model_dump(by_alias=True, mode="json", exclude_none=True)
    back = decide(Observed(job=queued_job(status), now=at(70), created=at(0), workload=resumed))
    assert kinds(back) == [SetWorkloadActive] and back.actions[0] == SetWorkloadActive(True)
    assert back.status.phase == Phase.PENDING


def test_a_finished_job_finishes_its_workload_once_its_pods_are_gone() -> None:
    status = {"phase": "Succeeded", "message": "training finished",
              "completionTime": at(5).isoformat()}  # fmt: skip
    job = queued_job(status)
    busy = decide(Observed(job=job, now=at(6), created=at(0), workload=ADMITTED, pods_left=2))
    assert FinishWorkload not in kinds(busy)
    plan = decide(Observed(job=job, now=at(7), created=at(0), workload=ADMITTED))
    assert plan.actions == [FinishWorkload(True, "training finished")]
    assert ADMITTED is not None
    finished = replace(ADMITTED, finished=True)
    assert decide(Observed(job=job, now=at(8), created=at(0), workload=finished)).actions == []


def test_pods_ready_reads_as_kueues_job_controllers_write_it() -> None:
    assert ADMITTED is not None
    started = queueing.pods_ready_patch(ADMITTED, True, at(5))["status"]["conditions"]
    ready = next(c for c in started if c["type"] == kueue.PODS_READY)
    assert (ready["status"], ready["reason"]) == ("True", "Started")
    after = replace(ADMITTED, conditions=tuple(started))
    lost = queueing.pods_ready_patch(after, False, at(9))["status"]["conditions"]
    assert next(c for c in lost if c["type"] == kueue.PODS_READY)["reason"] == "WaitForRecovery"
    again = queueing.pods_ready_patch(replace(after, conditions=tuple(lost)), True, at(20))
    back = next(c for c in again["status"]["conditions"] if c["type"] == kueue.PODS_READY)
    assert back["reason"] == "Recovered"
    assert (
        queueing.workload_view({**workload_body(), "status": {"conditions": lost}}).pods_ready
        is False
    )  # type: ignore[union-attr]
