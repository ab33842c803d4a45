"""The operator's Kubernetes adapter (`rlhf_operator.kube.Kube`) against the real API server.

The reconciler's unit tests run on a fake of its port; this is where the adapter's own calls —
create or apply over the job's own, create-only Secrets, a delete bound to the uid seen — meet
the client library and the API server they were written for, without a job or an operator.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rlhf_local.testing import LocalCluster, wait_for
from rlhf_operator.kube import Kube
from rlhf_operator.ports import ApplyRefusedError
from rlhf_operator.views import NOT_OWNED
from rlhfjob.contract import kuberay as ray

pytestmark = pytest.mark.e2e


def _owner(lc: LocalCluster, namespace: str) -> dict[str, Any]:
    """A controller reference to a real object (the garbage collector deletes dependents of a
    missing owner), standing in for the job."""
    made = lc.core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"))
    )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": made.metadata.uid,
        "controller": True,
    }


def _config_map(name: str, namespace: str, data: dict[str, str], owner: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def _data(lc: LocalCluster, name: str, namespace: str) -> dict[str, str]:
    return dict(lc.core.read_namespaced_config_map(name, namespace).data or {})


def test_apply_creates_then_updates_its_own_and_refuses_anothers(
    local_cluster: LocalCluster, unrestricted_namespace: str
) -> None:
    ns, kube = unrestricted_namespace, Kube(local_cluster.api)
    owner = _owner(local_cluster, ns)

    async def scenario() -> None:
        await kube.apply(_config_map("mine", ns, {"v": "1"}, owner))
        await kube.apply(_config_map("mine", ns, {"v": "2"}, owner))
        assert _data(local_cluster, "mine", ns) == {"v": "2"}

        await kube.create_if_missing(_config_map("once", ns, {"v": "1"}, owner))
        await kube.create_if_missing(_config_map("once", ns, {"v": "2"}, owner))
        assert _data(local_cluster, "once", ns) == {"v": "1"}, "created once, never rewritten"

        local_cluster.core.create_namespaced_config_map(
            ns, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="theirs"), data={"v": "0"})
        )
        for write in (kube.apply, kube.create_if_missing):
            with pytest.raises(ApplyRefusedError) as refusal:
                await write(_config_map("theirs", ns, {"v": "9"}, owner))
            assert refusal.value.reason == NOT_OWNED
            assert f"ConfigMap {ns}/theirs exists and is not this job's" in refusal.value.message
        assert _data(local_cluster, "theirs", ns) == {"v": "0"}
        held = local_cluster.core.read_namespaced_config_map("theirs", ns)
        assert held.metadata.owner_references is None

    asyncio.run(scenario())


def test_a_secret_is_created_once_and_never_read_back(
    local_cluster: LocalCluster, unrestricted_namespace: str
) -> None:
    ns, kube = unrestricted_namespace, Kube(local_cluster.api)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "token-abc", "namespace": ns},
        "stringData": {"token": "first"},
    }

    async def scenario() -> None:
        await kube.create_secret(secret)
        await kube.create_secret({**secret, "stringData": {"token": "second"}})

    asyncio.run(scenario())
    kept = local_cluster.core.read_namespaced_secret("token-abc", ns)
    assert kept.data == {"token": "Zmlyc3Q="}, "the first Secret of a name is kept, unchanged"


def test_a_raycluster_is_deleted_only_by_the_uid_seen(
    local_cluster: LocalCluster, unrestricted_namespace: str
) -> None:
    ns, kube = unrestricted_namespace, Kube(local_cluster.api)
    body = {
        "apiVersion": ray.RAY_API_VERSION,
        "kind": ray.RAY_CLUSTER_KIND,
        "metadata": {"name": "seen", "namespace": ns},
        "spec": {
            "headGroupSpec": {
                "rayStartParams": {},
                "template": {
                    "spec": {
                        "nodeSelector": {"adapter.example.com/nowhere": "true"},
                        "containers": [{"name": "ray-head", "image": "ray:adapter"}],
                    }
                },
            }
        },
    }
    made = local_cluster.custom.create_namespaced_custom_object(
        ray.RAY_GROUP, ray.RAY_VERSION, ns, ray.RAY_CLUSTERS, body
    )

    async def scenario() -> None:
        with pytest.raises(ApiException) as refused:
            await kube.delete_ray_cluster(ns, "seen", "00000000-0000-0000-0000-000000000000")
        assert refused.value.status == 409, "a RayCluster made since is never deleted"
        assert await kube.get_ray_cluster(ns, "seen") is not None
        await kube.delete_ray_cluster(ns, "seen", made["metadata"]["uid"])
        await kube.delete_ray_cluster(ns, "seen", made["metadata"]["uid"])  # gone: no error

    asyncio.run(scenario())
    wait_for(
        lambda: asyncio.run(kube.get_ray_cluster(ns, "seen")) is None, 60, "the RayCluster gone"
    )


NODE_STATES: dict[str, tuple[bool, str, list[dict[str, str]]]] = {
    # name: (spec.unschedulable, the Ready condition's status, taints)
    "rlhf-e2e-cordoned-ready": (True, "True", []),
    "rlhf-e2e-cordoned-not-ready": (
        True, "False", [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}],
    ),
    "rlhf-e2e-cordoned-unreachable": (
        True, "Unknown", [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}],
    ),
    "rlhf-e2e-tainted-not-cordoned": (
        False, "True", [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}],
    ),
    "rlhf-e2e-schedulable": (False, "True", []),
}  # fmt: skip
"""Nodes in the states a drain finds them in. A cordon is `spec.unschedulable` whatever else
the node says: a node that went NotReady or unreachable while being drained still holds the
job's pods (and their PodDisruptionBudget holds the drain) until the job moves off."""


def test_every_cordoned_node_is_listed_whatever_its_readiness_and_taints(
    local_cluster: LocalCluster,
) -> None:
    core, kube = local_cluster.core, Kube(local_cluster.api)
    try:
        for name, (cordoned, ready, taints) in NODE_STATES.items():
            core.create_node(
                client.V1Node(
                    metadata=client.V1ObjectMeta(name=name),
                    spec=client.V1NodeSpec(unschedulable=cordoned, taints=taints or None),
                )
            )
            condition = {"type": "Ready", "status": ready, "reason": "E2E"}
            core.patch_node_status(name, {"status": {"conditions": [condition]}})
        listed = asyncio.run(kube.cordoned_nodes()) & set(NODE_STATES)
        assert listed == {name for name, (cordoned, _, _) in NODE_STATES.items() if cordoned}
    finally:
        for name in NODE_STATES:
            try:
                core.delete_node(name)
            except ApiException as error:
                if error.status != 404:
                    raise
