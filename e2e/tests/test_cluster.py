"""Acceptance of the local control plane: scheduling onto fake GPU pools, KubeRay, stand-in Ray."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from typing import Any

import pytest
from kubernetes import client
from ray.job_submission import JobStatus, JobSubmissionClient

from rlhf_local import cluster, pools
from rlhf_local.standin import DASHBOARD_ANNOTATION
from rlhf_local.testing import LocalCluster, events_for, wait_for
from rlhfjob.contract.kuberay import RAY_CLUSTERS, RAY_GROUP, RAY_VERSION

pytestmark = pytest.mark.e2e


@pytest.fixture
def namespace(unrestricted_namespace: str) -> str:
    """These RayClusters are KubeRay's plain examples, not the operator's restricted pods."""
    return unrestricted_namespace


RAY_IMAGE = "rayproject/ray:2.60.0"
#: Starting a Ray node takes 10-40 s of CPU on two cores (the stand-in starts them one at a
#: time and retries a node that failed to register), so waits for Ray nodes are generous.
RAY_NODE_TIMEOUT = 300


def ray_cluster(
    name: str,
    *,
    pool: str,
    replicas: int,
    gpus: int,
    resources: dict[str, int],
    group: str = "workers",
) -> dict[str, Any]:
    """A RayCluster: CPU-pool head, one worker group pinned to `pool` (tainted GPU pools)."""
    worker_pod: dict[str, Any] = {
        "nodeSelector": {pools.POOL_LABEL: pool},
        "containers": [
            {
                "name": "ray-worker",
                "image": RAY_IMAGE,
                "resources": {
                    "requests": {"cpu": "4", "memory": "16Gi"},
                    "limits": {"cpu": "4", "memory": "16Gi"},
                },
            }
        ],
    }
    if gpus:
        worker_pod["tolerations"] = [
            {"key": pools.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
        ]
        for section in ("requests", "limits"):
            worker_pod["containers"][0]["resources"][section][pools.GPU_RESOURCE] = str(gpus)
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name},
        "spec": {
            "headGroupSpec": {
                # No CPUs on the head: tasks must land on the worker group.
                "rayStartParams": {"num-cpus": "0"},
                "template": {
                    "spec": {
                        "nodeSelector": {pools.POOL_LABEL: "cpu"},
                        "containers": [
                            {
                                "name": "ray-head",
                                "image": RAY_IMAGE,
                                "resources": {
                                    "requests": {"cpu": "1", "memory": "2Gi"},
                                    "limits": {"cpu": "1", "memory": "2Gi"},
                                },
                            }
                        ],
                    }
                },
            },
            "workerGroupSpecs": [
                {
                    "groupName": group,
                    "replicas": replicas,
                    "minReplicas": replicas,
                    "maxReplicas": replicas,
                    # KubeRay's format: a JSON object inside a quoted string.
                    "rayStartParams": {
                        "num-cpus": "1",
                        "resources": json.dumps(json.dumps(resources)),
                    },
                    "template": {"spec": worker_pod},
                }
            ],
        },
    }


def get_rc(lc: LocalCluster, ns: str, name: str) -> dict[str, Any]:
    return lc.custom.get_namespaced_custom_object(RAY_GROUP, RAY_VERSION, ns, RAY_CLUSTERS, name)


def ray_pods(lc: LocalCluster, ns: str, name: str, node_type: str) -> list[Any]:
    sel = f"ray.io/cluster={name},ray.io/node-type={node_type}"
    return lc.core.list_namespaced_pod(ns, label_selector=sel).items


def ray_nodes(dashboard: str) -> list[dict[str, Any]]:
    """Nodes as Ray's state API (on the dashboard) reports them, dead ones included."""
    url = f"{dashboard}/api/v0/nodes?limit=100&detail=1"
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    return body["data"]["result"]["result"]


def nodes_with(dashboard: str, resource: str, state: str) -> list[dict[str, Any]]:
    return [
        n
        for n in ray_nodes(dashboard)
        if n["state"] == state and resource in (n.get("resources_total") or {})
    ]


def dashboard_of(lc: LocalCluster, ns: str, name: str) -> str:
    return wait_for(
        lambda: get_rc(lc, ns, name)["metadata"].get("annotations", {}).get(DASHBOARD_ANNOTATION),
        RAY_NODE_TIMEOUT,
        f"the stand-in to publish {DASHBOARD_ANNOTATION} on {ns}/{name}",
        details=lambda: cluster.log_tail("standin-ray"),
    )


def wait_ready(lc: LocalCluster, ns: str, name: str) -> None:
    wait_for(
        lambda: (get_rc(lc, ns, name).get("status") or {}).get("state") == "ready",
        120,
        f"KubeRay to report {ns}/{name} ready",
        details=lambda: json.dumps(get_rc(lc, ns, name).get("status"), indent=1),
    )


def test_fake_pools_have_gpus_labels_and_taints(local_cluster: LocalCluster) -> None:
    nodes = {n.metadata.name: n for n in local_cluster.core.list_node().items}
    for pool in pools.POOLS:
        for name in pool.node_names():
            node = nodes[name]
            assert node.metadata.labels[pools.POOL_LABEL] == pool.name
            assert node.metadata.annotations[pools.KWOK_ANNOTATION] == "fake"
            ready = {c.type: c.status for c in node.status.conditions}["Ready"]
            assert ready == "True", f"{name} not Ready"
            gpus = node.status.allocatable.get(pools.GPU_RESOURCE)
            taints = {(t.key, t.effect) for t in node.spec.taints or []}
            if pool.gpus:
                assert gpus == str(pool.gpus)
                assert (pools.GPU_RESOURCE, "NoSchedule") in taints
                assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
            else:
                assert gpus is None
                assert not taints


def test_up_twice_is_harmless(local_cluster: LocalCluster) -> None:
    before = cluster.status()
    started = time.monotonic()
    assert cluster.up(echo=False) == local_cluster.kubeconfig
    assert cluster.status() == before, "a second `up` restarted components"
    assert time.monotonic() - started < 60


def test_garbage_collection_and_service_account_tokens(
    local_cluster: LocalCluster, namespace: str
) -> None:
    """The controller manager runs: owned objects are collected, SA tokens are issued."""
    core = local_cluster.core
    owner = core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"))
    )
    ref = client.V1OwnerReference(
        api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid
    )
    core.create_namespaced_config_map(
        namespace,
        client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owned", owner_references=[ref])),
    )
    core.delete_namespaced_config_map("owner", namespace)
    wait_for(
        lambda: (
            "owned"
            not in {c.metadata.name for c in core.list_namespaced_config_map(namespace).items}
        ),
        60,
        "the garbage collector to delete the owned ConfigMap",
    )

    wait_for(
        lambda: core.read_namespaced_service_account("default", namespace),
        60,
        "the default ServiceAccount",
    )
    token = core.create_namespaced_service_account_token(
        "default",
        namespace,
        client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[])),
    )
    assert token.status.token.count(".") == 2  # a signed JWT


def test_gpu_worker_group_runs_ray_tasks_and_loses_a_node(
    local_cluster: LocalCluster, namespace: str
) -> None:
    lc = local_cluster
    name = "train"
    lc.apply(
        ray_cluster(name, pool="gpu-train", replicas=2, gpus=8, resources={"trainer": 1}),
        namespace,
    )
    wait_ready(lc, namespace, name)

    train_nodes = set(pools.POOLS[1].node_names())
    workers = ray_pods(lc, namespace, name, "worker")
    assert len(workers) == 2
    placed = {p.metadata.name: p.spec.node_name for p in workers}
    assert set(placed.values()) == train_nodes, f"workers not spread on gpu-train: {placed}"
    (head,) = ray_pods(lc, namespace, name, "head")
    assert head.spec.node_name in pools.POOLS[0].node_names()

    dashboard = dashboard_of(lc, namespace, name)
    alive = wait_for(
        lambda: (
            len(nodes_with(dashboard, "trainer", "ALIVE")) == 2
            and nodes_with(dashboard, "trainer", "ALIVE")
        ),
        RAY_NODE_TIMEOUT,
        "two Ray nodes advertising the `trainer` resource",
        details=lambda: json.dumps(ray_nodes(dashboard), indent=1, default=str)[:4000],
    )
    assert all(n["resources_total"].get("GPU", 0) == 0 for n in alive)
    trainer_ids = {n["node_id"] for n in alive}

    jobs = JobSubmissionClient(dashboard)
    script = (
        "import ray; ray.init(); "
        "node = lambda: ray.get_runtime_context().get_node_id(); "
        "f = ray.remote(resources={'trainer': 1}, num_cpus=1)(node); "
        "print('RAN-ON', ray.get(f.remote()))"
    )
    job = jobs.submit_job(entrypoint=f'python -c "{script}"')
    status = wait_for(
        lambda: (s := jobs.get_job_status(job)).is_terminal() and s,
        300,
        f"Ray job {job} to finish",
        details=lambda: jobs.get_job_logs(job),
    )
    logs = jobs.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs
    found = re.search(r"RAN-ON ([0-9a-f]{20,})", logs)
    assert found, logs
    ran_on = found.group(1)
    assert ran_on in trainer_ids, f"task ran on {ran_on}, not on a trainer node {trainer_ids}"

    victim = workers[0].metadata.name
    lc.core.delete_namespaced_pod(victim, namespace)
    dead = wait_for(
        lambda: nodes_with(dashboard, "trainer", "DEAD"),
        90,
        f"Ray to report the node of deleted pod {victim} dead",
    )
    assert len(dead) == 1 and dead[0]["node_id"] in trainer_ids
    # KubeRay replaces the pod, and the replacement gets a new Ray node.
    wait_for(
        lambda: len(nodes_with(dashboard, "trainer", "ALIVE")) == 2,
        RAY_NODE_TIMEOUT,
        "a Ray node for the replacement worker pod",
    )


def test_too_many_gpus_stays_pending_with_scheduler_reason(
    local_cluster: LocalCluster, namespace: str
) -> None:
    lc = local_cluster
    name = "greedy"
    # The rollout pool has 2 nodes x 8 GPUs; three 8-GPU workers cannot all fit.
    lc.apply(
        ray_cluster(name, pool="gpu-rollout", replicas=3, gpus=8, resources={"rollout": 1}),
        namespace,
    )

    def pending_reason() -> str | None:
        pending = [
            p for p in ray_pods(lc, namespace, name, "worker") if p.status.phase == "Pending"
        ]
        for pod in pending:
            for ev in events_for(lc, namespace, pod.metadata.name):
                if ev.reason == "FailedScheduling":
                    return str(ev.message)
        return None

    message = wait_for(pending_reason, 60, "a FailedScheduling event for a worker pod")
    print(f"scheduler: {message}")
    assert "Insufficient nvidia.com/gpu" in message, message
    workers = ray_pods(lc, namespace, name, "worker")
    assert sorted(p.status.phase for p in workers) == ["Pending", "Running", "Running"]
    assert (get_rc(lc, namespace, name).get("status") or {}).get("state") != "ready"
    assert DASHBOARD_ANNOTATION not in (
        get_rc(lc, namespace, name)["metadata"].get("annotations") or {}
    )


def test_separate_ray_clusters_and_head_loss(local_cluster: LocalCluster, namespace: str) -> None:
    """Two RayClusters get two Ray clusters; losing a head pod gives that one a new cluster."""
    lc = local_cluster
    for name in ("alpha", "beta"):
        lc.apply(ray_cluster(name, pool="cpu", replicas=1, gpus=0, resources={name: 1}), namespace)
    for name in ("alpha", "beta"):
        wait_ready(lc, namespace, name)
    alpha, beta = dashboard_of(lc, namespace, "alpha"), dashboard_of(lc, namespace, "beta")
    assert alpha != beta
    wait_for(lambda: nodes_with(alpha, "alpha", "ALIVE"), RAY_NODE_TIMEOUT, "alpha's worker")
    wait_for(lambda: nodes_with(beta, "beta", "ALIVE"), RAY_NODE_TIMEOUT, "beta's worker")
    assert not nodes_with(alpha, "beta", "ALIVE"), "clusters share nodes"

    (head,) = ray_pods(lc, namespace, "alpha", "head")
    lc.core.delete_namespaced_pod(head.metadata.name, namespace)
    new_alpha = wait_for(
        lambda: (
            (
                a := get_rc(lc, namespace, "alpha")["metadata"]
                .get("annotations", {})
                .get(DASHBOARD_ANNOTATION)
            )
            not in (None, alpha)
            and a
        ),
        RAY_NODE_TIMEOUT,
        "a new Ray cluster (new dashboard address) after the head pod was deleted",
        details=lambda: cluster.log_tail("standin-ray"),
    )
    wait_for(
        lambda: nodes_with(new_alpha, "alpha", "ALIVE"), 120, "alpha's worker in the new cluster"
    )
    assert get_rc(lc, namespace, "beta")["metadata"]["annotations"][DASHBOARD_ANNOTATION] == beta
