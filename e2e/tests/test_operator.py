"""The operator on the real local control plane, with KubeRay and the stand-in Ray.

These jobs run a stand-in driver (`spec.entrypoint`, a Python one-liner) instead of the trainer:
they test the operator's lifecycle, not training, and stay fast. Real training under the operator,
with an injected failure, is what `rlhfjob demo` runs.
"""

from __future__ import annotations

import ipaddress
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from rlhf_local import pools
from rlhf_local.jobs import FINISH_AT_ONCE, SLEEP_FOREVER, Jobs, job_manifest
from rlhf_local.operator_process import OperatorProcess, metric_value
from rlhf_local.testing import LocalCluster, wait_for
from rlhfjob import api

pytestmark = pytest.mark.e2e


@pytest.fixture
def jobs(local_cluster: LocalCluster, namespace: str) -> Jobs:
    return Jobs(local_cluster, namespace)


def test_job_runs_on_its_pools_and_succeeds(
    jobs: Jobs, operator: OperatorProcess, local_cluster: LocalCluster
) -> None:
    jobs.create(job_manifest("tiny", jobs.namespace, FINISH_AT_ONCE))
    cluster = wait_for(lambda: jobs.ray_cluster("tiny"), 60, "the RayCluster")
    assert cluster["metadata"]["ownerReferences"][0]["kind"] == "RLHFJob"

    def scheduled_pods() -> list[Any] | None:
        listed = local_cluster.core.list_namespaced_pod(jobs.namespace).items
        placed = [pod for pod in listed if pod.spec.node_name]
        return placed if len(placed) == 3 else None

    pods = wait_for(scheduled_pods, 120, "three scheduled Ray pods")
    nodes = {n.metadata.name: n.metadata.labels for n in local_cluster.core.list_node().items}
    placed = {
        p.metadata.labels["rlhf.dev/role"]: nodes[p.spec.node_name][pools.POOL_LABEL] for p in pods
    }
    assert placed == {"head": "cpu", "trainer": "gpu-train", "rollout": "gpu-rollout"}

    job = jobs.wait_phase("tiny", "Succeeded", 240, operator)
    status = job["status"]
    assert status["rayClusterName"] == "tiny"
    assert status["completionTime"]
    reasons = jobs.event_reasons("tiny")
    for reason in ("Provisioning", "Submitted", "Succeeded"):
        assert reason in reasons, reasons
    # The finished job releases its cluster; the RLHFJob stays for inspection.
    wait_for(lambda: jobs.ray_cluster("tiny") is None, 60, "the RayCluster to be released")

    table = local_cluster.kubectl("get", "rlhfjobs", "-n", jobs.namespace)
    header = table.splitlines()[0].split()
    assert header[:6] == ["NAME", "PHASE", "STEP", "TOTAL", "RESTARTS", "CHECKPOINT"]
    assert "Succeeded" in table


@pytest.mark.attack(
    "anyone in the cluster submits code to a job's Ray head",
    "Ray token auth (401 without the token, 403 with a wrong one)",
)
def test_trainer_is_submitted_once_even_across_an_operator_restart(
    jobs: Jobs, operator: OperatorProcess
) -> None:
    jobs.create(job_manifest("restart", jobs.namespace, SLEEP_FOREVER))
    jobs.wait_phase("restart", "Running", 180, operator)
    cluster_uid = jobs.ray_cluster("restart")["metadata"]["uid"]  # type: ignore[index]

    operator.stop()
    operator.start()
    # Give the restarted operator several reconciles of its own, then compare.
    wait_for(
        lambda: (
            metric_value(operator.metrics(), 'rlhf_operator_reconciles_total{result="ok"}') >= 3
        ),
        60,
        "the restarted operator to reconcile",
    )
    assert jobs.phase("restart") == "Running"
    assert jobs.ray_cluster("restart")["metadata"]["uid"] == cluster_uid  # type: ignore[index]
    submissions = jobs.ray_submissions("restart")
    assert len(submissions) == 1, submissions
    assert_locked_down(jobs, "restart")


def assert_locked_down(jobs: Jobs, name: str) -> None:
    """A running job's head refuses anyone without its token; its pods pass Pod Security
    "restricted" (the test namespace enforces it) and only the head holds an API token."""
    dashboard = jobs.dashboard(name)
    submission = json.dumps({"entrypoint": "echo borrowed GPUs"}).encode()
    for headers, refused in (({}, 401), ({"Authorization": "Bearer guessed"}, 403)):
        request = urllib.request.Request(
            f"{dashboard}/api/jobs/", data=submission, method="POST",
            headers={"Content-Type": "application/json", **headers},
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request, timeout=10)
        assert answer.value.code == refused
    assert len(jobs.ray_submissions(name)) == 1, "nothing was submitted without the token"

    namespace = jobs.lc.core.read_namespace(jobs.namespace)
    assert namespace.metadata.labels["pod-security.kubernetes.io/enforce"] == "restricted"
    privileged = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "privileged"},
                  "spec": {"containers": [{"name": "c", "image": "busybox",
                                           "securityContext": {"privileged": True}}]}}  # fmt: skip
    with pytest.raises(ApiException) as refused_pod:
        jobs.lc.core.create_namespaced_pod(jobs.namespace, privileged, dry_run="All")
    assert refused_pod.value.status == 403, "Pod Security admission is enforced here"
    for pod in jobs.lc.core.list_namespaced_pod(
        jobs.namespace, label_selector=f"rlhf.dev/job={name}"
    ).items:
        head = pod.metadata.labels["rlhf.dev/role"] == "head"
        assert pod.spec.automount_service_account_token is head, pod.metadata.name

    policies = jobs.lc.networking.list_namespaced_network_policy(jobs.namespace).items
    pods_policy, head_policy = sorted(
        (p for p in policies if p.metadata.labels.get("rlhf.dev/job") == name),
        key=lambda p: len(p.spec.pod_selector.match_labels),
    )
    assert pods_policy.spec.pod_selector.match_labels == {"rlhf.dev/job": name}
    assert pods_policy.spec.policy_types == ["Ingress", "Egress"]
    assert head_policy.spec.pod_selector.match_labels == {
        "rlhf.dev/job": name,
        "ray.io/node-type": "head",
    }
    # Stored as built: no block the API server accepted lets a pod reach the metadata address.
    rules = [*pods_policy.spec.egress, *head_policy.spec.egress]
    blocks = [peer.ip_block for rule in rules for peer in rule.to or [] if peer.ip_block]
    metadata = ipaddress.ip_address("169.254.169.254")
    assert blocks and all(
        any(metadata in ipaddress.ip_network(e) for e in b._except or [])
        for b in blocks
        if metadata in ipaddress.ip_network(b.cidr)
    )


def test_suspend_releases_the_cluster_and_resume_starts_again(
    jobs: Jobs, operator: OperatorProcess, tmp_path: Path
) -> None:
    jobs.create(job_manifest("pause", jobs.namespace, SLEEP_FOREVER))
    jobs.wait_phase("pause", "Running", 180, operator)
    jobs.patch_spec("pause", {"suspend": True})
    jobs.wait_phase("pause", "Suspended", 60, operator)
    wait_for(lambda: jobs.ray_cluster("pause") is None, 90, "the RayCluster to be deleted")

    jobs.patch_spec("pause", {"suspend": False})
    job = jobs.wait_phase("pause", "Running", 180, operator)
    assert "Resumed" in jobs.event_reasons("pause")
    assert job["status"]["restartCount"] == 0, "suspending is not a failure"


def test_active_deadline_fails_the_job(jobs: Jobs, operator: OperatorProcess) -> None:
    jobs.create(job_manifest("deadline", jobs.namespace, SLEEP_FOREVER, activeDeadlineSeconds=20))
    job = jobs.wait_phase("deadline", "Failed", 180, operator)
    assert "activeDeadlineSeconds" in job["status"]["message"]
    assert "DeadlineExceeded" in jobs.event_reasons("deadline")


def test_ttl_deletes_the_finished_job_and_garbage_collects_its_objects(
    jobs: Jobs, operator: OperatorProcess, local_cluster: LocalCluster
) -> None:
    jobs.create(job_manifest("ttl", jobs.namespace, FINISH_AT_ONCE, ttlSecondsAfterFinished=2))

    def gone() -> bool:
        names = [
            j["metadata"]["name"]
            for j in local_cluster.custom.list_namespaced_custom_object(
                api.GROUP, api.VERSION, jobs.namespace, api.PLURAL
            )["items"]
        ]
        return "ttl" not in names

    wait_for(gone, 300, "the RLHFJob to be deleted after its TTL")
    wait_for(
        lambda: (
            not local_cluster.core.list_namespaced_config_map(
                jobs.namespace, label_selector="rlhf.dev/job=ttl"
            ).items
        ),
        120,
        "its ConfigMap to be garbage-collected",
    )


def test_deleting_a_running_job_removes_its_cluster_but_not_checkpoints(
    jobs: Jobs, operator: OperatorProcess, local_cluster: LocalCluster, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "ckpt"
    kept = checkpoints / jobs.namespace / "delete" / "step-00000001" / "manifest.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("{}")
    manifest = job_manifest(
        "delete", jobs.namespace, SLEEP_FOREVER, checkpoint={"path": str(checkpoints)}
    )
    jobs.create(manifest)
    jobs.wait_phase("delete", "Running", 180, operator)
    local_cluster.custom.delete_namespaced_custom_object(
        api.GROUP, api.VERSION, jobs.namespace, api.PLURAL, "delete"
    )
    wait_for(lambda: jobs.ray_cluster("delete") is None, 120, "the RayCluster to be collected")
    assert kept.exists(), "the operator must never delete checkpoints"


def test_unsatisfiable_gpu_request_fails_with_the_schedulers_reason(
    jobs: Jobs, operator: OperatorProcess
) -> None:
    manifest = job_manifest("toobig", jobs.namespace, FINISH_AT_ONCE, provisioningTimeoutSeconds=15)
    manifest["spec"]["roles"]["trainer"]["gpus"] = 16  # the pool's nodes have 8 each
    jobs.create(manifest)
    job = jobs.wait_phase("toobig", "Failed", 120, operator)
    message = job["status"]["message"]
    assert "not ready after 15s" in message
    assert "Insufficient nvidia.com/gpu" in message, message
    assert "ProvisioningTimeout" in jobs.event_reasons("toobig")


def test_operator_exports_metrics(jobs: Jobs, operator: OperatorProcess) -> None:
    jobs.create(job_manifest("metrics", jobs.namespace, FINISH_AT_ONCE))
    jobs.wait_phase("metrics", "Succeeded", 240, operator)
    text = operator.metrics()
    for name in (
        "rlhf_operator_jobs",
        "rlhf_operator_reconciles_total",
        "rlhf_operator_reconcile_duration_seconds_bucket",
        "rlhf_operator_cluster_ready_seconds_count",
        "rlhf_operator_ray_job_submissions_total",
    ):
        assert name in text, name
