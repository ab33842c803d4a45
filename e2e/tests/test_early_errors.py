"""What only the cluster can tell shows on the job within a minute, quoting the cause (issue 13).

Each job here passes the RLHFJob schema and the operator's policy, yet cannot run: the API
server refuses its RayCluster, KubeRay cannot create its pods, the scheduler cannot place them,
or the kubelet cannot start a container (a Secret it names is missing). The job must say why, in
the cause's own words, long before `provisioningTimeoutSeconds`; a refusal that retrying cannot
fix ends the job Failed, one that may pass (a quota, a Secret created later) keeps it
Provisioning.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rlhf_local import pools
from rlhf_local.jobs import FINISH_AT_ONCE, Jobs, condition_of, job_manifest
from rlhf_local.operator_process import OperatorProcess
from rlhf_local.testing import LocalCluster, wait_for
from rlhfjob.valid_cases import SECRET, SECRET_ENV

pytestmark = pytest.mark.e2e

SHOWN_WITHIN_S = 60
TIMER_TICKS_S = 12
"""A few of the operator's timer ticks (5 s each by default)."""


@pytest.fixture
def jobs(local_cluster: LocalCluster, namespace: str) -> Jobs:
    return Jobs(local_cluster, namespace)


REFUSAL = "RayClusters are not allowed in this namespace (a cluster's own policy)"


@contextlib.contextmanager
def rayclusters_refused(lc: LocalCluster, namespace: str) -> Iterator[None]:
    """A ValidatingAdmissionPolicy of the cluster that refuses every RayCluster created in
    `namespace` (422 Invalid), in force (a dry run refused) before the block runs.

    Before the RLHFJob schema carried Kubernetes' own schema of volume sources, a
    `persistentVolumeClaim` without `claimName` reached the API server inside the RayCluster
    and was refused there; now the RLHFJob itself is refused for it (issue 28), so a refusal the
    job cannot foresee comes from the cluster's own policy, as it would in a real one."""
    name = f"refuse-rayclusters-{namespace}"
    manifests = [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": ["ray.io"],
                            "apiVersions": ["*"],
                            "operations": ["CREATE"],
                            "resources": ["rayclusters"],
                        }
                    ]
                },
                "validations": [{"expression": "false", "message": REFUSAL, "reason": "Invalid"}],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {
                "policyName": name,
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
                },
            },
        },
    ]
    for manifest in manifests:
        lc.apply(manifest)
    probe = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "probe", "namespace": namespace},
        "spec": {"headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [
            {"name": "ray-head", "image": "probe"}]}}}},
    }  # fmt: skip

    def refused() -> bool:
        try:
            lc.custom.create_namespaced_custom_object(
                "ray.io", "v1", namespace, "rayclusters", probe, dry_run="All"
            )
        except ApiException as error:
            return error.status == 422 and REFUSAL in str(error.body)
        return False

    try:
        wait_for(refused, 30, "the policy refusing RayClusters")
        yield
    finally:
        for manifest in reversed(manifests):
            kind = manifest["kind"].lower()
            lc.kubectl("delete", kind, name, "--ignore-not-found", "--wait=false")


def test_a_raycluster_the_api_server_refuses_fails_the_job_quoting_the_cause(
    jobs: Jobs, operator: OperatorProcess, local_cluster: LocalCluster
) -> None:
    with rayclusters_refused(local_cluster, jobs.namespace):
        manifest = job_manifest(
            "rejected",
            jobs.namespace,
            FINISH_AT_ONCE,
            provisioningTimeoutSeconds=3600,  # the cause must show, not the deadline
        )
        jobs.create(manifest)
        job = jobs.wait_phase("rejected", "Failed", SHOWN_WITHIN_S, operator)
    message = job["status"]["message"]
    assert "the API server refused the RayCluster rejected (422 Invalid)" in message, message
    assert REFUSAL in message, message
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

    status = wait_for(
        lambda: _cause_shown(jobs, "quota", "PodCreationFailed", "exceeded quota"),
        SHOWN_WITHIN_S,
        "the quota to show on the job",
        interval=0.5,
        details=lambda: f"{jobs.status('quota')}\n{operator.log_tail(60)}",
    )
    assert status["phase"] == "Provisioning", "quota may free up: the job waits for it"
    assert "KubeRay FailedToCreate" in status["message"]
    assert "no-pods" in status["message"]
    assert (condition_of(status, "ClusterReady") or {}).get("status") == "False"


def _cause_shown(jobs: Jobs, name: str, reason: str, words: str) -> dict[str, Any] | None:
    """The job's status once its message quotes `words` and ClusterReady says `reason`, with
    the same message. One read: KubeRay retries a refused pod under a new random name, so two
    reads can see two different messages."""
    status = jobs.status(name)
    ready = condition_of(status, "ClusterReady") or {}
    shown = words in status.get("message", "") and ready.get("message") == status["message"]
    return status if shown and ready.get("reason") == reason else None


KUBELET_LESS_TAINT = {"key": "rlhf.dev/e2e-kubelet-less", "value": "yes", "effect": "NoSchedule"}


def _kubelet_less_node(name: str, pool: str) -> dict[str, Any]:
    """A Ready node no kubelet (and no KWOK) looks after: what the test writes into the status of
    the pods placed on it is what they show, as a kubelet's report would be."""
    manifest = pools.node_manifest(pools.POOLS[0], name, zone="local-a")
    del manifest["metadata"]["annotations"][pools.KWOK_ANNOTATION]
    manifest["metadata"]["labels"][pools.POOL_LABEL] = pool
    manifest["spec"]["taints"] = [KUBELET_LESS_TAINT]  # for this test's head alone
    return manifest


def test_pods_the_scheduler_cannot_place_or_the_kubelet_cannot_start_show_why(
    jobs: Jobs, operator: OperatorProcess, local_cluster: LocalCluster
) -> None:
    lc, name, pool = local_cluster, "no-secret", f"kubelet-less-{secrets.token_hex(3)}"
    jobs.create(
        job_manifest(
            name,
            jobs.namespace,
            FINISH_AT_ONCE,
            head={  # no such node yet
                "nodeSelector": {pools.POOL_LABEL: pool},
                "tolerations": [{"operator": "Equal", **KUBELET_LESS_TAINT}],
            },
            pods={"env": [SECRET_ENV]},  # a Secret nobody created
            provisioningTimeoutSeconds=3600,
        )
    )
    # The real scheduler's words first: no node matches the head's selector.
    status = wait_for(
        lambda: _cause_shown(jobs, name, "Unschedulable", "the scheduler cannot place pod"),
        SHOWN_WITHIN_S,
        "the scheduler's words on the job",
        interval=0.5,
        details=lambda: f"{jobs.status(name)}\n{operator.log_tail(60)}",
    )
    assert "didn't match Pod's node affinity/selector" in status["message"], status

    # A node for it appears; the head is placed there, and its container cannot start: the
    # test writes what a kubelet reports for a missing Secret (no kubelet runs here).
    node = _kubelet_less_node(pool, pool)
    status = node.pop("status")  # a create ignores it; the kubelet's part is a status patch
    lc.core.create_node(node)
    try:
        lc.core.patch_node_status(pool, {"status": {
            "capacity": status["capacity"], "allocatable": status["allocatable"],
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "the test stands in for a kubelet"}]}})  # fmt: skip

        def head_placed() -> Any:
            found = lc.core.list_namespaced_pod(
                jobs.namespace, label_selector="ray.io/node-type=head"
            ).items
            return next((p for p in found if p.spec.node_name == pool), None)

        head = wait_for(head_placed, SHOWN_WITHIN_S, "the head placed on the new node")
        container = head.spec.containers[0].name
        said = f'secret "{SECRET["name"]}" not found'
        lc.core.patch_namespaced_pod_status(head.metadata.name, jobs.namespace, {"status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "True"},
                           {"type": "Ready", "status": "False", "reason": "ContainersNotReady"}],
            "containerStatuses": [{
                "name": container, "image": head.spec.containers[0].image, "imageID": "",
                "ready": False, "restartCount": 0, "started": False,
                "state": {"waiting": {"reason": "CreateContainerConfigError", "message": said}},
            }],
        }})  # fmt: skip
        status = wait_for(
            lambda: _cause_shown(jobs, name, "ContainersNotStarting", said),
            SHOWN_WITHIN_S,
            "the kubelet's words on the job",
            interval=0.5,
            details=lambda: f"{jobs.status(name)}\n{operator.log_tail(60)}",
        )
        assert status["message"] == (
            f"waiting for Ray pods: container {container} of pod {head.metadata.name} cannot "
            f"start: CreateContainerConfigError: {said}"
        )
        assert status["phase"] == "Provisioning", "a Secret created later is picked up: it waits"
    finally:
        lc.core.delete_node(pool)
        # No kubelet confirms a graceful deletion of the pods that were placed there: remove
        # them at once, or the namespace's deletion waits for the controller manager's pod GC
        # (about 40 s after the node goes).
        for placed in lc.core.list_namespaced_pod(jobs.namespace).items:
            if placed.spec.node_name == pool:
                with contextlib.suppress(ApiException):  # gone already
                    lc.core.delete_namespaced_pod(
                        placed.metadata.name, jobs.namespace, grace_period_seconds=0
                    )
