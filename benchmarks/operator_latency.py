"""Operator latency on the local control plane: apply → RayCluster created, and → Running.

    python benchmarks/operator_latency.py [--jobs 50] [--batch 5] [--out FILE]

Jobs run in batches (each running job holds a real stand-in Ray cluster, and this machine is
small). The ceiling, measured in the same run, is the same RayCluster applied directly, without
the operator, until its Ray dashboard is up: the part of "Running" the operator cannot speed up.
Prints one JSON document and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlhf_local.harness import LocalCluster
from rlhf_local.jobs import SLEEP_FOREVER, job_manifest
from rlhf_local.session import operator_session
from rlhf_operator import builder
from rlhfjob import api, contract
from rlhfjob.config import parse_job

POLL = 0.1
NOTE = (
    "The ceiling is one bare RayCluster at a time; jobs run --batch at a time and the stand-in Ray "
    "starts nodes one after another, so apply_to_running includes waiting for the other jobs' Ray "
    "nodes. Run with --batch 1 to compare like with like."
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(values, 0.5), 3),
        "p99": round(percentile(values, 0.99), 3),
        "mean": round(statistics.fmean(values), 3),
    }


def progress(label: str, done: int, total: int) -> None:
    print(f"\r{label}: {done}/{total}", end="", file=sys.stderr, flush=True)


class Bench:
    def __init__(self, lc: LocalCluster, namespace: str) -> None:
        self.lc, self.namespace = lc, namespace

    def _list(self, group: str, version: str, plural: str) -> list[dict[str, Any]]:
        listed: dict[str, Any] = self.lc.custom.list_namespaced_custom_object(
            group, version, self.namespace, plural
        )  # type: ignore[assignment]
        return list(listed["items"])

    def _clusters(self) -> dict[str, dict[str, Any]]:
        items = self._list("ray.io", "v1", "rayclusters")
        return {item["metadata"]["name"]: item for item in items}

    def _phases(self) -> dict[str, str]:
        items = self._list(api.GROUP, api.VERSION, api.PLURAL)
        return {i["metadata"]["name"]: (i.get("status") or {}).get("phase", "") for i in items}

    def _wait_gone(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while self._clusters() and time.monotonic() < deadline:
            time.sleep(0.5)

    def operator_batch(self, names: list[str]) -> list[dict[str, float]]:
        started: dict[str, float] = {}
        created: dict[str, float] = {}
        running: dict[str, float] = {}
        for name in names:
            started[name] = time.monotonic()
            self.lc.custom.create_namespaced_custom_object(
                api.GROUP, api.VERSION, self.namespace, api.PLURAL,
                job_manifest(name, self.namespace, SLEEP_FOREVER),
            )  # fmt: skip
        deadline = time.monotonic() + 600
        while len(running) < len(names) and time.monotonic() < deadline:
            now = time.monotonic()
            for name in self._clusters():
                created.setdefault(name, now)
            for name, phase in self._phases().items():
                if phase == "Running":
                    running.setdefault(name, now)
            time.sleep(POLL)
        for name in names:
            self.lc.custom.delete_namespaced_custom_object(
                api.GROUP, api.VERSION, self.namespace, api.PLURAL, name
            )
        self._wait_gone()
        return [
            {
                "created_s": created[name] - started[name],
                "running_s": running[name] - started[name],
            }
            for name in names
            if name in running and name in created
        ]

    def bare_cluster(self, name: str) -> float:
        """Apply the builder's RayCluster directly; seconds until its Ray dashboard is up."""
        document = job_manifest(name, self.namespace, SLEEP_FOREVER)
        document["metadata"]["uid"] = str(uuid.uuid4())
        manifest = builder.build_ray_cluster(parse_job(document))
        del manifest["metadata"]["ownerReferences"]  # no owner: the operator never sees it
        for template in [manifest["spec"]["headGroupSpec"]["template"]] + [
            group["template"] for group in manifest["spec"]["workerGroupSpecs"]
        ]:
            template["spec"].pop("serviceAccountName")
        started = time.monotonic()
        self.lc.custom.create_namespaced_custom_object(
            "ray.io", "v1", self.namespace, "rayclusters", manifest
        )
        deadline = started + 600
        seconds = float("nan")
        while time.monotonic() < deadline:
            rc = self._clusters().get(name, {})
            if (rc.get("metadata", {}).get("annotations") or {}).get(contract.DASHBOARD_ANNOTATION):
                seconds = time.monotonic() - started
                break
            time.sleep(POLL)
        self.lc.custom.delete_namespaced_custom_object(
            "ray.io", "v1", self.namespace, "rayclusters", name
        )
        self._wait_gone()
        return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--batch", type=int, default=5)
    parser.add_argument("--ceiling-runs", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/operator-latency.json")
    args = parser.parse_args()

    with operator_session("bench") as session:
        bench = Bench(session.lc, session.namespace)
        ceiling = []
        for i in range(args.ceiling_runs):
            ceiling.append(bench.bare_cluster(f"bare-{i}"))
            progress("ceiling (bare RayCluster to dashboard)", i + 1, args.ceiling_runs)
        print(file=sys.stderr)
        samples: list[dict[str, float]] = []
        names = [f"job-{i:03d}" for i in range(args.jobs)]
        for start in range(0, len(names), args.batch):
            samples += bench.operator_batch(names[start : start + args.batch])
            progress("RLHFJobs to Running", len(samples), args.jobs)
        print(file=sys.stderr)

    result = {
        "benchmark": "operator-latency",
        "command": "task bench:operator  # python benchmarks/operator_latency.py "
        f"--jobs {args.jobs} --batch {args.batch} --ceiling-runs {args.ceiling_runs}",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": "2 cores, 24 GiB; local control plane, KWOK nodes, stand-in Ray",
        "jobs": args.jobs,
        "completed": len(samples),
        "batch": args.batch,
        "apply_to_raycluster_created_s": summary([s["created_s"] for s in samples]),
        "apply_to_running_s": summary([s["running_s"] for s in samples]),
        "ceiling_raycluster_to_dashboard_s": summary(ceiling),
        "samples": [{k: round(v, 3) for k, v in s.items()} for s in samples],
        "note": NOTE if args.batch > 1 else "",
    }
    result["operator_overhead_p50_s"] = round(
        result["apply_to_running_s"]["p50"] - result["ceiling_raycluster_to_dashboard_s"]["p50"],
        3,
    )
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0 if len(samples) == args.jobs else 1


if __name__ == "__main__":
    raise SystemExit(main())
