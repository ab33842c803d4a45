"""CPU learning benchmark: rerun the tiny GRPO and PPO examples and record how well they learn.

Each example runs as `rlhfjob train` (2 ZeRO-3 trainer ranks, 2 rollout engines, a local Ray)
with its checkpoints and step log in a scratch directory. The result file holds, per algorithm,
the reward curve (mean reward per step), the wall time of the whole run (Ray and actor start-up
included) and of the training steps alone, and `final_reward_fraction` (the last step's mean
reward / the task's maximum reward); at top level `final_reward_fraction` is the lower of the two.

    .venv/bin/python benchmarks/learn.py [--output benchmarks/results/cpu-learning.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from rlhf_trainer.data.tasks import get_task
from rlhf_trainer.run.curves import read_step_log

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {"grpo": "examples/grpo-tiny-cpu.yaml", "ppo": "examples/ppo-tiny-cpu.yaml"}
DEFAULT_OUTPUT = "benchmarks/results/cpu-learning.json"


class RunFailedError(Exception):
    """`rlhfjob train` exited with an error (the message is its output's tail)."""


def train_and_summarise(document: dict[str, Any], scratch: Path) -> tuple[dict[str, Any], list]:
    """Run the job `document` to its end as `rlhfjob train` (its own local Ray) in `scratch`;
    return its learning curve's summary and its step records. Both benchmarks of learning
    (this one, `algorithms.py`) measure a run this way."""
    job = scratch / f"{document['metadata']['name']}.yaml"
    job.write_text(yaml.safe_dump(document))
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "rlhfjob_cli", "train", "--config", str(job)],
        capture_output=True,
        text=True,
        env=env,
        cwd=scratch,
    )
    wall_seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RunFailedError((result.stdout + result.stderr)[-4000:])
    spec = document["spec"]
    run_dir = Path(spec["checkpoint"]["path"]) / "default" / document["metadata"]["name"]
    records = read_step_log(run_dir / "metrics.jsonl")
    max_reward = get_task(spec["dataset"]["source"].removeprefix("synthetic:")).max_reward
    curve = [round(record["reward_mean"], 4) for record in records]
    summary = {
        "steps": len(records),
        "max_reward": max_reward,
        "start_reward": curve[0],
        "final_reward": curve[-1],
        "final_reward_fraction": round(curve[-1] / max_reward, 4),
        "first_step_at_0_9": next(
            (r["step"] for r in records if r["reward_mean"] >= 0.9 * max_reward), None
        ),
        "wall_seconds": round(wall_seconds, 1),
        "training_seconds": round(sum(r["step_seconds"] for r in records), 1),
        "reward_curve": curve,
    }
    return summary, records


def run_example(example: str, scratch: Path) -> dict[str, Any]:
    """Train one example to the end and summarise its learning curve."""
    document = yaml.safe_load((REPO / example).read_text())
    document["spec"]["checkpoint"]["path"] = str(scratch / "checkpoints")
    try:
        summary, _ = train_and_summarise(document, scratch)
    except RunFailedError as failure:
        raise SystemExit(f"{example} failed:\n{failure}") from failure
    roles = document["spec"]["roles"]
    return {
        "example": example,
        "trainer_ranks": roles["trainer"]["replicas"],
        "rollout_engines": roles["rollout"]["replicas"],
        **summary,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="where to write the JSON")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)

    algorithms = {}
    with tempfile.TemporaryDirectory(prefix="rlhf-learn-") as scratch:
        for name, example in EXAMPLES.items():
            directory = Path(scratch) / name
            directory.mkdir()
            algorithms[name] = run_example(example, directory)
            summary = algorithms[name]
            print(
                f"{name}: reward {summary['start_reward']:.3f} -> {summary['final_reward']:.3f} "
                f"({summary['final_reward_fraction']:.0%} of max) in {summary['steps']} steps, "
                f"{summary['wall_seconds']:.0f} s wall ({summary['training_seconds']:.0f} s "
                "training)",
                flush=True,
            )
    report = {
        "command": " ".join(["python", "benchmarks/learn.py", *argv]),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "final_reward_fraction": min(a["final_reward_fraction"] for a in algorithms.values()),
        "algorithms": algorithms,
    }
    output = Path(args.output)
    if not output.is_absolute():
        output = REPO / output
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output} (final_reward_fraction {report['final_reward_fraction']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
