"""What only the cluster can tell shows on the job within a minute, quoting the cause (issue 13).

Each job here passes the RLHFJob schema and the operator's policy, yet cannot run: the API
server refuses its RayCluster, or KubeRay cannot create its pods. The job must say why, in the
cause's own words, long before `provisioningTimeoutSeconds`; a refusal that retrying cannot fix
ends the job Failed, one that may pass (a quota) keeps it Provisioning.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubernetes import client

from rlhf_local.jobs import FINISH_AT_ONCE, Jobs, job_manifest
from rlhf_local.operator_process import OperatorProcess
from rlhf_local.testing import LocalCluster, wait_for

pytestmark = pytest.mark.e2e

SHOWN_WITHIN_S = 60
TIMER_TICKS_S = 12
"""A few of the operator's timer ticks (5 s each by default)."""


@pytest.fixture
def jobs(local_cluster: LocalCluster, namespace: str) -> Jobs:
    return Jobs(local_cluster, namespace)


def test_a_raycluster_the_api_server_refuses_fails_the_job_quoting_the_cause(
    jobs: Jobs, operator: OperatorProcess
) -> None:
    # The RLHFJob schema takes any one volume source and the builder copies it verbatim; the
    # RayCluster CRD's pod template requires persistentVolumeClaim.claimName (422 Invalid).
    manifest = job_manifest(
        "rejected",
        jobs.namespace,
        FINISH_AT_ONCE,
        checkpoint={"volume": {"persistentVolumeClaim": {}}},
        provisioningTimeoutSeconds=3600,  # the cause must show, not the deadline
    )
    jobs.create(manifest)
    job = jobs.wait_phase("rejected", "Failed", SHOWN_WITHIN_S, operator)
    message = job["status"]["message"]
    assert "the API server refused the RayCluster rejected (422 Invalid)" in message, message
    assert "persistentVolumeClaim.claimName: Required value" in message, message
    failed = jobs.condition("rejected", "Failed")
    assert failed is not None and failed["reason"] == "ClusterRejected"
    assert jobs.event_reasons("rejected").count("ClusterRejected") == 1
    assert jobs.ray_cluster("rejected") is None
    # Refused for good: no retry loop, no second Event, no failed reconcile every timer tick.
    time.sleep(TIMER_TICKS_S)
    assert jobs.status("rejected")["message"] == message
    assert jobs.event_reasons("rejected").count("ClusterRejected") == 1
    assert f"{jobs.namespace}/rejected: reconcile failed" not in operator.log_tail(2000)


def _quota_enforced(lc: LocalCluster, namespace: str) -> bool:
    """The quota controller has counted the namespace: admission now refuses pods."""
    quota = lc.core.read_namespaced_resource_quota("no-pods", namespace)
    hard = (quota.status.hard if quota.status else None) or {}
    return bool(hard.get("pods") == "0")


def test_pods_kuberay_cannot_create_show_the_cause_within_a_minute(
    jobs: Jobs, operator: OperatorProcess, local_cluster: LocalCluster
) -> None:
    quota = client.V1ResourceQuota(
        metadata=client.V1ObjectMeta(name="no-pods"),
        spec=client.V1ResourceQuotaSpec(hard={"pods": "0"}),
    )
    local_cluster.core.create_namespaced_resource_quota(jobs.namespace, quota)
    wait_for(lambda: _quota_enforced(local_cluster, jobs.namespace), 30, "the quota enforced")

    jobs.create(
        job_manifest("quota", jobs.namespace, FINISH_AT_ONCE, provisioningTimeoutSeconds=3600)
    )

    def cause_shown() -> dict[str, Any] | None:
        status = jobs.status("quota")
        ready = jobs.condition("quota", "ClusterReady") or {}
        shown = "exceeded quota" in status.get("message", "")
        return status if shown and ready.get("reason") == "PodCreationFailed" else None

    status = wait_for(
        cause_shown,
        SHOWN_WITHIN_S,
        "the quota to show on the job",
        interval=0.5,
        details=lambda: f"{jobs.status('quota')}\n{operator.log_tail(60)}",
    )
    assert status["phase"] == "Provisioning", "quota may free up: the job waits for it"
    assert "KubeRay FailedToCreate" in status["message"]
    assert "no-pods" in status["message"]
    ready = jobs.condition("quota", "ClusterReady")
    assert ready is not None and ready["status"] == "False"
    assert ready["message"] == status["message"]
