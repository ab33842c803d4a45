"""A training step's phases, before and after a change: two checkouts, one job, interleaved.

    git worktree add /tmp/before COMMIT
    python benchmarks/step_phases.py /tmp/before . --runs 2 --out benchmarks/results/NAME.json

Runs `rlhfjob train` on ``examples/grpo-tiny-colocated-cpu.yaml`` (no mid-run checkpoints)
from each checkout in turn, ``--runs`` times (before, after, before, after: a load that drifts
hits both alike), and reports per checkout the median step seconds and the median of each
phase over the steps after the first 5 (warm-up), the last steps' reward and the last KL: two
checkouts that train the same run give the same rewards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

EXAMPLE = "examples/grpo-tiny-colocated-cpu.yaml"
WARM_UP = 5


def run_job(checkout: Path, work: Path) -> dict[str, Any]:
    """One run of the example from `checkout`; its step figures."""
    document = yaml.safe_load((checkout / EXAMPLE).read_text())
    document["spec"]["checkpoint"].update(path=str(work / "checkpoints"), intervalSteps=10**6)
    job = work / "job.yaml"
    job.write_text(yaml.safe_dump(document))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(
        str(checkout / part) for part in ("trainer", ".", "cli", "operator")
    )
    command = [sys.executable, "-m", "rlhfjob_cli", "train", "--config", str(job)]
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{checkout}: the job failed\n{done.stderr[-3000:]}")
    name = document["metadata"]["name"]
    log = work / "checkpoints" / "default" / name / "metrics.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if r.get("kind") != "evaluation"][WARM_UP:]
    phases = sorted({p for s in steps for p in s["phase_seconds"]})
    return {
        "step_seconds_median": round(statistics.median(s["step_seconds"] for s in steps), 4),
        "phase_seconds_median": {
            p: round(statistics.median(s["phase_seconds"].get(p, 0.0) for s in steps), 4)
            for p in phases
        },
        "reward_last_5": sum(s["reward_mean"] for s in steps[-5:]) / 5,
        "kl_last": steps[-1]["kl"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="the checkout without the change")
    parser.add_argument("after", type=Path, help="the checkout with it")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="step-phases-") as scratch:
        for index in range(args.runs):
            for label in ("before", "after"):
                work = Path(scratch) / f"{label}-{index}"
                work.mkdir()
                runs[label].append(run_job(getattr(args, label).resolve(), work))
                print(label, json.dumps(runs[label][-1]), flush=True)
    ratios = [
        b["step_seconds_median"] / a["step_seconds_median"]
        for b, a in zip(runs["before"], runs["after"], strict=True)
    ]
    report = {"example": EXAMPLE, "runs": runs, "speedup_per_pair": [round(r, 2) for r in ratios]}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
