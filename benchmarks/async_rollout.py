"""Generating the next batch while this one trains (`algorithm.maxStaleness`): the speedup
against the on-policy loop, beside the bound the phase overlap allows, on CPU.

    python benchmarks/async_rollout.py [--steps 60] [--out benchmarks/results/async-cpu.json]

The same job (the tiny GRPO example, a larger model and longer responses so that generation
and the update weigh alike) is trained twice with `rlhfjob train` on a local Ray: on-policy
(`maxStaleness: 0`) and one step ahead (`1`). From the step log, after `WARMUP_STEPS`:

* ``step_seconds`` of each run (median) and ``speedup`` = on-policy over ahead;
* ``bound``: what overlapping the phases can give at most, from the on-policy run's phases:
  (generate + reward + reference + advantage + update + sync) over
  (max(generate + reward, reference + advantage + update) + sync), the sync staying serial;
* ``final_reward_fraction``: the ahead run's mean reward over its last `LAST_STEPS` steps
  over the task's maximum.

``partial_rollouts``: where generation outweighs the update (responses of 160 tokens, the
example's small model), the batch ahead decoded whole against in segments of 16 tokens
(`partialRolloutTokens`): the step time of each, the share of responses that resumed under the
newer weights, and the behaviour-proximal KL (how far off-policy the trained tokens were).

One trainer rank and one engine, each a process with a core of its own on two cores (the
driver mostly waits); with more actors than cores the overlap would only move work between
processes fighting for the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "async-cpu.json"
WARMUP_STEPS = 5
LAST_STEPS = 5
GENERATION = ("generate", "reward")
UPDATE = ("reference", "advantage", "update")


OVERLAP_MODEL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4}
"""The speedup's job: a model large enough that the update weighs about what generation does."""
PARTIAL_SEGMENT = 16
PARTIAL_RESPONSE = 160


def job(
    directory: Path,
    steps: int,
    model: dict[str, Any],
    **algorithm: Any,
) -> Path:
    document = yaml.safe_load((REPO / "examples" / "grpo-tiny-cpu.yaml").read_text())
    spec = document["spec"]
    spec["model"]["randomInit"].update(model, max_position_embeddings=256)
    spec["algorithm"].update(totalSteps=steps, **algorithm)
    spec["roles"]["trainer"]["replicas"] = 1
    spec["roles"]["rollout"]["replicas"] = 1  # a core for the rank, one for the engine
    spec["checkpoint"].update(path=str(directory / "checkpoints"), intervalSteps=steps)
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def train(path: Path, directory: Path) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-m", "rlhfjob_cli", "train", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
        cwd=directory,
    )
    if result.returncode != 0:
        raise RuntimeError((result.stdout + result.stderr)[-4000:])
    name = yaml.safe_load(path.read_text())["metadata"]["name"]
    log = directory / "checkpoints" / "default" / name / "metrics.jsonl"
    records = {json.loads(line)["step"]: json.loads(line) for line in log.read_text().splitlines()}
    return [records[step] for step in sorted(records)]


def phases(records: list[dict[str, Any]], names: tuple[str, ...]) -> float:
    return statistics.median(sum(r["phase_seconds"].get(n, 0.0) for n in names) for r in records)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--partial-steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from rlhf_trainer.data.tasks import get_task

    runs: dict[str, Any] = {}
    partial: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlhfjob-async-") as scratch:
        for segment in (0, PARTIAL_SEGMENT):
            directory = Path(scratch) / f"partial-{segment}"
            directory.mkdir()
            path = job(
                directory,
                args.partial_steps,
                {},
                maxStaleness=1,
                maxResponseLength=PARTIAL_RESPONSE,
                partialRolloutTokens=segment,
            )
            steady = train(path, directory)[WARMUP_STEPS:]
            partial[str(segment)] = {
                "step_seconds": statistics.median(r["step_seconds"] for r in steady),
                "resumed_fraction": statistics.mean(
                    r.get("resumed_responses", 0) / sum(r["staleness"].values()) for r in steady
                ),
                "behaviour_kl": statistics.median(r["policy_behaviour_kl"] for r in steady),
            }
        for staleness in (0, 1):
            directory = Path(scratch) / str(staleness)
            directory.mkdir()
            path = job(
                directory, args.steps, OVERLAP_MODEL, maxStaleness=staleness, maxResponseLength=24
            )
            records = train(path, directory)
            steady = records[WARMUP_STEPS:]
            runs[str(staleness)] = {
                "step_seconds": statistics.median(r["step_seconds"] for r in steady),
                "generate_and_reward_s": phases(steady, GENERATION),
                "score_and_update_s": phases(steady, UPDATE),
                "sync_s": phases(steady, ("sync",)),
                "rewards": [round(r["reward_mean"], 4) for r in records],
            }
    on_policy, ahead = runs["0"], runs["1"]
    serial = on_policy["generate_and_reward_s"] + on_policy["score_and_update_s"]
    overlapped = max(on_policy["generate_and_reward_s"], on_policy["score_and_update_s"])
    bound = (serial + on_policy["sync_s"]) / (overlapped + on_policy["sync_s"])
    max_reward = get_task("target_token").max_reward
    result = {
        "benchmark": "async-cpu",
        "command": f"python benchmarks/async_rollout.py --steps {args.steps}"
        f" --partial-steps {args.partial_steps}",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "job": "examples/grpo-tiny-cpu.yaml, hidden 128, 4 layers, responses of 24 tokens, "
        "1 trainer rank, 1 engine",
        "speedup": on_policy["step_seconds"] / ahead["step_seconds"],
        "bound": bound,
        "final_reward_fraction": statistics.mean(ahead["rewards"][-LAST_STEPS:]) / max_reward,
        "on_policy_final_reward_fraction": statistics.mean(on_policy["rewards"][-LAST_STEPS:])
        / max_reward,
        "runs": runs,
        "partial_rollouts": {
            "job": f"examples/grpo-tiny-cpu.yaml, responses of {PARTIAL_RESPONSE} tokens, "
            f"maxStaleness 1, 1 trainer rank, 1 engine; key: partialRolloutTokens",
            "step_time_ratio": partial[str(PARTIAL_SEGMENT)]["step_seconds"]
            / partial["0"]["step_seconds"],
            "runs": partial,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
