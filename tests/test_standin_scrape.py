"""The stand-in's scrape targets: each Ray pod's metrics ports, labelled as the chart's
PodMonitor labels them, so the e2e Prometheus sees what a cluster's would."""

from __future__ import annotations

import json
from pathlib import Path

from kubernetes import client

from rlhf_local.standin import (
    SCRAPE_TARGETS,
    LocalRay,
    NodeParams,
    RayNode,
    StandIn,
    _scrape_labels,
)


def pod(name: str, role: str) -> client.V1Pod:
    labels = {"rlhf.dev/job": "grpo", "rlhf.dev/role": role, "ray.io/cluster": "grpo"}
    return client.V1Pod(metadata=client.V1ObjectMeta(name=name, namespace="team-a", labels=labels))


def node(name: str, role: str, scrape: dict[str, int], tmp_path: Path) -> RayNode:
    return RayNode(name, f"uid-{name}", role, 1, NodeParams(1, {}), tmp_path / "log", 0, scrape,
                   _scrape_labels(pod(name, role)))  # fmt: skip


def test_the_labels_are_the_pod_monitors() -> None:
    labels = _scrape_labels(pod("grpo-head-x", "head"))
    assert labels == {
        "namespace": "team-a",
        "pod": "grpo-head-x",
        "rlhfjob": "grpo",
        "role": "head",
    }


def test_every_metrics_port_of_every_ray_pod_is_a_target(tmp_path: Path) -> None:
    standin = StandIn(tmp_path / "ray", tmp_path / "state", tmp_path / "logs", tmp_path / "kc")
    standin.state_dir.mkdir()
    head = node("grpo-head-x", "head", {"metrics": 7001, "trainer-metrics": 7002}, tmp_path)
    worker = node("grpo-trainer-y", "trainer", {"metrics": 7003}, tmp_path)
    local = LocalRay("team-a", "grpo", "uid", "uid-head", tmp_path, 1, 2, head, {"w": worker})
    standin.clusters["uid"] = local
    standin._write_state()
    targets = json.loads((standin.state_dir / SCRAPE_TARGETS).read_text())
    found = {(t["targets"][0], t["labels"]["endpoint"], t["labels"]["role"]) for t in targets}
    assert found == {
        ("127.0.0.1:7001", "metrics", "head"),
        ("127.0.0.1:7002", "trainer-metrics", "head"),
        ("127.0.0.1:7003", "metrics", "trainer"),
    }
    assert all(t["labels"]["rlhfjob"] == "grpo" for t in targets)
    standin.clusters.clear()
    standin._write_state()
    assert json.loads((standin.state_dir / SCRAPE_TARGETS).read_text()) == []
