"""Preemption without lost work, on the local control plane: the steps a preemption costs.

    python benchmarks/preemption.py [--runs 3] [--interval 8] [--via kueue|suspend]

Two tiny GRPO jobs (`rlhf_local.faults.fault_job`) train under the operator, one after the
other, and each is preempted and resumed `--runs` times: one with a drain
(`checkpoint.stopGracePeriodSeconds` at its default: the trainer checkpoints the step it is on
before the cluster goes), one without (`stopGracePeriodSeconds: 0`: the cluster goes at once
and the job resumes from its last interval checkpoint). Each time the job is preempted halfway
between two interval checkpoints.

`--via kueue`: the job is queued in a real Kueue ClusterQueue with quota for one
job; a higher-priority job arrives, Kueue evicts the first, which drains and gives its quota
back once its pods are gone; the preemptor is deleted once admitted, and Kueue admits the first
job again (results: `benchmarks/results/preemption-kueue.json`). `--via suspend` (the default):
the job is suspended and resumed (`spec.suspend`), what a queue without Kueue's protocol does.
Per run:

* ``steps_retrained``: steps trained a second time after the resume (the step log);
* ``release_s``: preemption (the preemptor's creation, or the suspend) → the RayCluster is gone
  (the drain's checkpoint included);
* ``resume_s``: the quota is free again (the preemptor deleted, or the resume) → the first step
  trained on the new cluster.

Prints one JSON document and writes it to --out; top level: ``steps_retrained_with_jit`` and
``steps_retrained_without_jit`` (the worst run of each), ``release_seconds`` and
``resume_seconds`` (p50 of the runs with a drain).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlhf_local import faults
from rlhf_local.faults import TrainingRecord
from rlhf_local.harness import wait_for
from rlhf_local.jobs import Jobs
from rlhf_local.kueue import FlavorQuota, KueueAdmin
from rlhf_local.session import operator_session
from rlhfjob.contract import kueue

TOTAL_STEPS = 1000
TIMEOUT = 600.0


def p50(values: list[float]) -> float | None:
    ordered = sorted(values)
    return round(ordered[(len(ordered) - 1) // 2], 3) if ordered else None


def say(message: str) -> None:
    print(f"[preemption] {message}", file=sys.stderr, flush=True)


@dataclass
class Preemptor:
    """How the job is preempted and let go again: `spec.suspend`, or a Kueue preemption by a
    higher-priority job of the same size (deleted once admitted, to give the quota back)."""

    jobs: Jobs
    queue: str | None = None
    priority: str | None = None
    checkpoints: Path = Path()
    count: int = 0

    def preempt(self, name: str) -> None:
        if self.queue is None:
            self.jobs.patch_spec(name, {"suspend": True})
            return
        self.count += 1
        steps = {"totalSteps": TOTAL_STEPS}
        preemptor = f"preemptor-{self.count}"
        manifest = faults.fault_job(preemptor, self.jobs.namespace, self.checkpoints,
                                    algorithm=steps)  # fmt: skip
        labels = manifest["metadata"].setdefault("labels", {})
        labels.update(
            {kueue.LABEL_QUEUE_NAME: self.queue, kueue.LABEL_PRIORITY_CLASS: self.priority}
        )
        self.jobs.create(manifest)

    def let_go(self, name: str) -> None:
        if self.queue is None:
            self.jobs.patch_spec(name, {"suspend": False})
            return
        preemptor = f"preemptor-{self.count}"
        wait_for(lambda: (self.jobs.condition(preemptor, "Admitted") or {}).get("status") == "True",
                 TIMEOUT, f"{preemptor} to be admitted")  # fmt: skip
        self.jobs.lc.custom.delete_namespaced_custom_object(
            "rlhf.dev", "v1alpha1", self.jobs.namespace, "rlhfjobs", preemptor
        )


def preempt_once(
    jobs: Jobs, name: str, record: TrainingRecord, interval: int, grace: int, how: Preemptor
) -> dict[str, Any]:
    """Preempt halfway between two checkpoints, let it resume, and measure what it cost."""
    start = record.last_step()
    target = (start // interval + 1) * interval + interval // 2  # past the next checkpoint
    wait_for(lambda: record.last_step() >= target, TIMEOUT, f"step {target}")
    suspended_at = time.time()
    how.preempt(name)
    wait_for(lambda: jobs.ray_cluster(name) is None, TIMEOUT, "the RayCluster to go")
    released_at = time.time()
    trained = record.last_step()
    logged = len(record.records())
    resumed_from = record.newest_checkpoint() or 0
    how.let_go(name)
    resumed_at = time.time()
    first = wait_for(
        lambda: record.records()[logged:][:1], TIMEOUT, "the first step after the resume"
    )[0]
    sample = {
        "stop_grace_period_seconds": grace,
        "suspended_at_step": trained,
        "resumed_from_step": resumed_from,
        "steps_retrained": trained - (int(first["step"]) - 1),
        "release_s": round(released_at - suspended_at, 3),
        "resume_s": round(float(first["time"]) - resumed_at, 3),
    }
    say(str(sample))
    return sample


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="suspends with a drain, and without")
    parser.add_argument("--interval", type=int, default=8, help="checkpoint.intervalSteps")
    parser.add_argument("--via", choices=("suspend", "kueue"), default="suspend")
    parser.add_argument("--out", default="benchmarks/results/preemption.json")
    args = parser.parse_args()

    samples: list[dict[str, Any]] = []
    with operator_session("preemption") as session, KueueAdmin(session.lc) as admin:
        jobs = Jobs(session.lc, session.namespace)
        checkpoints = session.workdir / "checkpoints"
        how = Preemptor(jobs, checkpoints=checkpoints)
        if args.via == "kueue":
            flavor = admin.flavor("cpu")
            one_job = FlavorQuota(flavor, cpu="4", memory="8Gi")  # a fault job's four pods
            queue = admin.cluster_queue("preemption", [one_job], namespaces=[jobs.namespace])
            admin.wait_cluster_queue_active(queue)
            how.queue = admin.local_queue(jobs.namespace, "preemption", queue)
            how.priority = admin.priority_class("high", 1000)
            low = admin.priority_class("low", 100)
        for name, grace in (("drained", 600), ("undrained", 0)):
            manifest = faults.fault_job(
                name,
                jobs.namespace,
                checkpoints,
                algorithm={"totalSteps": TOTAL_STEPS},
                checkpoint={"intervalSteps": args.interval, "stopGracePeriodSeconds": grace},
            )
            if how.queue is not None:
                manifest["metadata"]["labels"] = {
                    kueue.LABEL_QUEUE_NAME: how.queue,
                    kueue.LABEL_PRIORITY_CLASS: low,
                }
            record = TrainingRecord.of(manifest)
            jobs.create(manifest)
            for run in range(args.runs):
                say(f"{name}: run {run + 1}/{args.runs}, stopGracePeriodSeconds {grace}")
                samples.append(preempt_once(jobs, name, record, args.interval, grace, how))
            jobs.lc.custom.delete_namespaced_custom_object(
                "rlhf.dev", "v1alpha1", jobs.namespace, "rlhfjobs", name
            )
            wait_for(lambda n=name: jobs.ray_cluster(n) is None, TIMEOUT, f"{name}'s cluster")

    drained = [s for s in samples if s["stop_grace_period_seconds"]]
    undrained = [s for s in samples if not s["stop_grace_period_seconds"]]
    result = {
        "benchmark": "preemption",
        "command": f"task bench:preemption -- --runs {args.runs} --interval {args.interval} "
        f"--via {args.via}",
        "via": args.via,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": "2 cores, 24 GiB; local control plane, KWOK nodes, stand-in Ray",
        "job": "rlhf_local.faults.fault_job: 1 trainer rank, 2 rollout engines, checkpoint every "
        f"{args.interval} steps, heartbeat 1 s; preempted halfway between two checkpoints "
        + ("by a higher-priority job through Kueue" if args.via == "kueue" else "by a suspend"),
        "steps_retrained_with_jit": max(s["steps_retrained"] for s in drained),
        "steps_retrained_without_jit": max(s["steps_retrained"] for s in undrained),
        "interval_steps": args.interval,
        "release_seconds": p50([s["release_s"] for s in drained]),
        "resume_seconds": p50([s["resume_s"] for s in drained]),
        "release_seconds_without_jit": p50([s["release_s"] for s in undrained]),
        "resume_seconds_without_jit": p50([s["resume_s"] for s in undrained]),
        "runs": samples,
    }
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0 if result["steps_retrained_with_jit"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
