"""The fake node pools of the local cluster (KWOK nodes: no kubelet, no processes).

Other code targets these labels and taints, so they are part of the contract documented in
docs/local-cluster.md:

* every node: ``rlhf.dev/pool: <pool>``, ``type: kwok`` and the annotation
  ``kwok.x-k8s.io/node: fake`` that tells KWOK to manage it;
* ``cpu``: heads and the operator; no taint;
* ``gpu-train`` and ``gpu-rollout``: 8 ``nvidia.com/gpu`` each, the GPU Feature Discovery
  labels a real H100 node carries, and the taint ``nvidia.com/gpu=present:NoSchedule``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

POOL_LABEL = "rlhf.dev/pool"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
KWOK_ANNOTATION = "kwok.x-k8s.io/node"


@dataclass(frozen=True)
class Pool:
    """A group of identical fake nodes."""

    name: str
    count: int
    cpu: str
    memory: str
    instance_type: str
    gpus: int = 0
    labels: dict[str, str] = field(default_factory=dict)

    def node_names(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(self.count)]


H100_LABELS = {
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.memory": "81559",
    "nvidia.com/gpu.count": "8",
    "nvidia.com/cuda.driver.major": "550",
}

POOLS: tuple[Pool, ...] = (
    Pool("cpu", 2, cpu="16", memory="64Gi", instance_type="m6i.4xlarge"),
    Pool(
        "gpu-train",
        2,
        cpu="192",
        memory="2048Gi",
        instance_type="p5.48xlarge",
        gpus=8,
        labels=H100_LABELS,
    ),
    Pool(
        "gpu-rollout",
        2,
        cpu="192",
        memory="2048Gi",
        instance_type="p5.48xlarge",
        gpus=8,
        labels=H100_LABELS,
    ),
)


def node_manifest(pool: Pool, name: str, zone: str) -> dict[str, Any]:
    """A Node object KWOK will manage, with capacity in its status (KWOK keeps it)."""
    capacity = {
        "cpu": pool.cpu,
        "memory": pool.memory,
        "pods": "110",
        "ephemeral-storage": "1Ti",
    }
    if pool.gpus:
        capacity[GPU_RESOURCE] = str(pool.gpus)
    labels = {
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/os": "linux",
        "kubernetes.io/hostname": name,
        "node.kubernetes.io/instance-type": pool.instance_type,
        "topology.kubernetes.io/region": "local",
        "topology.kubernetes.io/zone": zone,
        "type": "kwok",
        POOL_LABEL: pool.name,
        **pool.labels,
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": [GPU_TAINT] if pool.gpus else []},
        "status": {
            "allocatable": capacity,
            "capacity": capacity,
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "fake",
                "kubeProxyVersion": "fake",
            },
        },
    }


def node_manifests() -> list[dict[str, Any]]:
    """Every fake node, spread over two zones like a small real cluster."""
    return [
        node_manifest(pool, name, zone=f"local-{'ab'[i % 2]}")
        for pool in POOLS
        for i, name in enumerate(pool.node_names())
    ]
