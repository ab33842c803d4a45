"""Kueue on the local control plane admits, preempts and converts for real.

Hand-written `v1beta2` Workloads with no job and no pods: what is tested is Kueue itself (its
scheduler, webhooks, conversion and certificates as `up` sets them up), and the job
controller's half of an eviction (`rlhf_local.kueue.release_quota`) that the operator mirrors.
Seconds, not minutes: nothing is scheduled onto nodes.
"""

from __future__ import annotations

import base64
import datetime
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rlhf_local import cluster, kueue, pools
from rlhf_local.kueue import FlavorQuota, KueueAdmin, PodSet
from rlhf_local.paths import local_dir
from rlhf_local.testing import LocalCluster, wait_for

pytestmark = pytest.mark.e2e

#: One trainer's worth: all 8 GPUs of a gpu-train node, so the queue's quota fits one workload.
TRAINER = PodSet("trainer", 1, {"cpu": "4", "memory": "16Gi", pools.GPU_RESOURCE: "8"})
WAIT = 30


@pytest.fixture
def admin(local_cluster: LocalCluster) -> Iterator[KueueAdmin]:
    with KueueAdmin(local_cluster) as handle:
        yield handle


def gpu_reserved(cq: dict[str, Any], flavor: str) -> str:
    """The ClusterQueue's reserved GPUs in `flavor` ("0" when none)."""
    for usage in cq.get("status", {}).get("flavorsReservation") or []:
        if usage["name"] == flavor:
            for resource in usage.get("resources") or []:
                if resource["name"] == pools.GPU_RESOURCE:
                    return str(resource["total"])
    return "0"


def test_kueue_admits_preempts_and_waits_for_the_quota(
    local_cluster: LocalCluster, unrestricted_namespace: str, admin: KueueAdmin
) -> None:
    namespace = unrestricted_namespace
    cpu = admin.flavor("cpu")
    gpu = admin.flavor("gpu-train")
    cq = admin.cluster_queue(
        "rlhf",
        [
            FlavorQuota(cpu, cpu="32", memory="128Gi"),
            FlavorQuota(gpu, cpu="192", memory="2048Gi", gpus=8),
        ],
        namespaces=[namespace],
    )
    lq = admin.local_queue(namespace, "rlhf", cq)
    low = admin.priority_class("low", 100)
    high = admin.priority_class("high", 1000)
    admin.wait_cluster_queue_active(cq)

    def get(name: str) -> dict[str, Any]:
        return kueue.get_workload(admin.custom, namespace, admin.name(name))

    def until(name: str, check: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        return kueue.wait_workload(admin.custom, namespace, admin.name(name), check, what, WAIT)

    def reserved_gpus_become(total: str, what: str) -> None:
        """Kueue updates the ClusterQueue's status a moment after it admits."""
        wait_for(
            lambda: gpu_reserved(admin.get(kueue.CLUSTER_QUEUES, cq), gpu) == total,
            WAIT,
            f"ClusterQueue {cq} to reserve {total} GPUs ({what})",
            details=lambda: str(admin.get(kueue.CLUSTER_QUEUES, cq).get("status")),
        )

    def create(name: str, priority_class: str, priority: int) -> None:
        manifest = kueue.workload(
            admin.name(name), namespace, lq, [TRAINER], priority_class=priority_class,
            priority=priority,
        )  # fmt: skip
        admin.workload(manifest)

    # 1. The low-priority workload is admitted: quota reserved on the GPU flavor (the CPU
    # flavor has no GPUs; the GPU flavor's taint is tolerated by the flavor's toleration).
    create("low", low, 100)
    wl_low = until("low", kueue.is_admitted, "admitted")
    assert kueue.has_quota_reservation(wl_low)
    (assignment,) = wl_low["status"]["admission"]["podSetAssignments"]
    assert assignment["name"] == "trainer"
    assert assignment["flavors"] == {"cpu": gpu, "memory": gpu, pools.GPU_RESOURCE: gpu}
    reserved_gpus_become("8", "the low one")

    # 2. A high-priority one of the same size: Kueue preempts the low one (Evicted, reason
    # Preempted) and keeps the high one pending while the low one still holds the quota.
    create("high", high, 1000)
    wl_low = until("low", lambda wl: kueue.is_true(wl, kueue.EVICTED), "evicted")
    evicted = kueue.condition(wl_low, kueue.EVICTED)
    preempted = kueue.condition(wl_low, kueue.PREEMPTED)
    assert evicted is not None and evicted["reason"] == "Preempted", kueue.summary(wl_low)
    assert preempted is not None and preempted["status"] == "True"
    assert preempted["reason"] == "InClusterQueue", kueue.summary(wl_low)
    # The scheduler's verdict on it ("... Pending the preemption of 1 workload(s)").
    wl_high = until(
        "high",
        lambda wl: kueue.condition(wl, kueue.QUOTA_RESERVED) is not None,
        "considered by the scheduler",
    )
    assert not kueue.has_quota_reservation(wl_high), kueue.summary(wl_high)
    # Kueue does not free an evicted workload's quota by itself: the job controller must.
    wl_low = get("low")
    assert kueue.has_quota_reservation(wl_low) and "admission" in wl_low["status"]
    assert gpu_reserved(admin.get(kueue.CLUSTER_QUEUES, cq), gpu) == "8"

    # 3. The job controller's step once the job has stopped: release the quota.
    released_at = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    stored = kueue.release_quota(admin.custom, namespace, admin.name("low"))
    assert "admission" not in stored["status"]
    conds = kueue.conditions(stored)
    assert conds[kueue.QUOTA_RESERVED]["status"] == "False"
    assert conds[kueue.QUOTA_RESERVED]["reason"] == "Pending"
    assert conds[kueue.REQUEUED]["status"] == "True"
    assert conds[kueue.REQUEUED]["reason"] == "Preempted"
    assert conds[kueue.ADMITTED]["status"] == "False"
    assert conds[kueue.ADMITTED]["reason"] == "NoReservation"
    assert stored["status"]["accumulatedPastExecutionTimeSeconds"] >= 0
    managers = {f["manager"] for f in stored["metadata"]["managedFields"]}
    assert kueue.ADMISSION_FIELD_MANAGER in managers

    # 4. Now the high one is admitted, after the release; the low one waits in the queue.
    wl_high = until("high", kueue.is_admitted, "admitted after the release")
    reserved = kueue.condition(wl_high, kueue.QUOTA_RESERVED)
    assert reserved is not None
    assert kueue.parse_time(reserved["lastTransitionTime"]) >= released_at
    wl_low = get("low")
    assert not kueue.has_quota_reservation(wl_low), kueue.summary(wl_low)
    assert not kueue.is_true(wl_low, kueue.ADMITTED)
    evictions = wl_low["status"]["schedulingStats"]["evictions"]
    assert [(e["reason"], e["count"]) for e in evictions] == [("Preempted", 1)]
    reserved_gpus_become("8", "the high one")

    # 5. The deprecated v1beta1 serves the same objects through Kueue's conversion webhook.
    old = kueue.get_workload(admin.custom, namespace, admin.name("high"), kueue.OLD_VERSION)
    assert old["apiVersion"] == f"{kueue.GROUP}/{kueue.OLD_VERSION}"
    assert old["spec"]["priorityClassName"] == high
    assert old["spec"]["priorityClassSource"] == "kueue.x-k8s.io/workloadpriorityclass"
    assert "priorityClassRef" not in old["spec"]
    old_cq: Any = admin.custom.get_cluster_custom_object(
        kueue.GROUP, kueue.OLD_VERSION, kueue.CLUSTER_QUEUES, cq
    )
    assert old_cq["spec"]["resourceGroups"][0]["flavors"][1]["name"] == gpu


def test_kueue_webhook_judges_workloads(unrestricted_namespace: str, admin: KueueAdmin) -> None:
    """Kueue's own validating webhook is in the path of every Workload write (the CRD schema
    alone allows this one): a request of the resource `pods` is refused."""
    reserved = PodSet("main", 1, {"cpu": "1", "pods": "1"})
    with pytest.raises(ApiException) as refused:
        admin.workload(kueue.workload(admin.name("pods"), unrestricted_namespace, "q", [reserved]))
    # A webhook's denial (403), not the schema's 422.
    assert refused.value.status == 403, refused.value
    assert "vworkload.kb.io" in str(refused.value.body)  # Kueue's validating webhook
    assert "reserved for internal kueue use" in str(refused.value.body)


def test_kueue_kept_the_local_certificates(local_cluster: LocalCluster) -> None:
    """Kueue's certificate rotator found the certificates `up` made valid and kept them: the
    Secret still holds them and every conversion CRD trusts the local Kueue CA."""
    pki = cluster.Layout(local_dir()).kueue_pki
    secret: Any = local_cluster.core.read_namespaced_secret(cluster.KUEUE_SECRET, "kueue-system")
    for name in ("ca.crt", "tls.crt"):
        assert base64.b64decode(secret.data[name]) == (pki / name).read_bytes(), name
    ca = base64.b64encode((pki / "ca.crt").read_bytes()).decode()
    crds = client.ApiextensionsV1Api(local_cluster.api)
    for name in sorted(cluster.KUEUE_CONVERSION_CRDS):
        crd: Any = crds.read_custom_resource_definition(name)
        assert crd.spec.conversion.strategy == "Webhook", name
        assert crd.spec.conversion.webhook.client_config.ca_bundle == ca, name
