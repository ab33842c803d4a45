"""CPU learning benchmark of every algorithm: each advantage estimator and policy loss the trainer
registers, and the DAPO and Dr. GRPO recipes, trained on the tiny target-token task.

Each run is `rlhfjob train` on `examples/grpo-tiny-cpu.yaml` (PPO: `examples/ppo-tiny-cpu.yaml`)
with `COMMON` and the run's `algorithm` fields laid over the example's, one trainer rank and one
rollout engine (fewer processes on a small machine; the placements are `learn.py`'s subject),
and its checkpoints and step log in a scratch directory. The result holds per run the spec fields,
`steps`, the reward curve, `final_reward_fraction` (the mean reward of the last step / the
task's maximum) and wall times; at top level the lowest fraction and the command.

    .venv/bin/python benchmarks/algorithms.py [--only NAME ...] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learn import RunFailedError, train_and_summarise  # a sibling script

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = "benchmarks/results/algorithms-cpu.json"
GRPO_EXAMPLE = "examples/grpo-tiny-cpu.yaml"
PPO_EXAMPLE = "examples/ppo-tiny-cpu.yaml"

RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    # Estimators, each with the default policy loss (ppo-clip, token-mean).
    "grpo": (GRPO_EXAMPLE, {}),
    "ppo": (PPO_EXAMPLE, {}),
    "rloo": (GRPO_EXAMPLE, {"name": "rloo"}),
    "reinforce-plus-plus": (GRPO_EXAMPLE, {"name": "reinforce-plus-plus"}),
    "reinforce-plus-plus-baseline": (GRPO_EXAMPLE, {"name": "reinforce-plus-plus-baseline"}),
    # Policy losses (GSPO's aggregation is its own, sequence-mean-token-mean).
    "gspo": (GRPO_EXAMPLE, {"policyLoss": "gspo", "clipRangeLow": 3e-4, "clipRangeHigh": 4e-4}),
    # The aggregation no run above uses.
    "grpo-sequence-mean-token-sum": (GRPO_EXAMPLE, {"lossAggregation": "sequence-mean-token-sum"}),
    # Recipes. DAPO: clip-higher, dynamic sampling, token-mean, overlong shaping (this task's
    # responses all run to maxResponseLength, so the penalty is the same for each).
    "dapo": (
        GRPO_EXAMPLE,
        {
            "clipRangeLow": 0.2,
            "clipRangeHigh": 0.28,
            "lossAggregation": "token-mean",
            "dynamicSampling": {"maxGenerationBatches": 3},
            "overlongShaping": {"bufferLength": 2, "penalty": 0.1},
        },
    ),
    "dr-grpo": (GRPO_EXAMPLE, {"scaleRewards": False, "lossAggregation": "constant-normaliser"}),
}
"""Per run: the example it starts from and the `algorithm` fields it sets."""

COMMON: dict[str, Any] = {"updateEpochs": 2, "stopTokenIds": [2]}
"""Laid over the GRPO example in every run, so that the runs differ where the algorithms do: a
second pass over each batch is off-policy (the ratios leave 1 and the clipping acts), and
responses that stop at token 2 differ in length (so do the aggregations). The PPO example
already makes two passes."""


def job_document(example: str, algorithm: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """The example with the run's algorithm fields, one rank and one engine, its checkpoints
    under `scratch`."""
    document = yaml.safe_load((REPO / example).read_text())
    spec = document["spec"]
    spec["algorithm"].update({**(COMMON if example == GRPO_EXAMPLE else {}), **algorithm})
    spec["roles"]["trainer"]["replicas"] = spec["roles"]["rollout"]["replicas"] = 1
    spec["checkpoint"]["path"] = str(scratch / "checkpoints")
    return document


def run(name: str, scratch: Path) -> dict[str, Any]:
    """Train one run to the end and summarise its learning curve."""
    example, algorithm = RUNS[name]
    summary, records = train_and_summarise(job_document(example, algorithm, scratch), scratch)
    if "dropped_groups" in records[-1]:
        summary["dropped_groups"] = [r["dropped_groups"] for r in records]
        summary["generation_batches"] = [r["generation_batches"] for r in records]
    return {"example": example, "algorithm": algorithm, **summary}


def write_report(results: dict[str, Any], argv: list[str], output: Path) -> None:
    """The JSON so far (written after every run, so an interrupted benchmark keeps its runs)."""
    finished = [r["final_reward_fraction"] for r in results.values() if "error" not in r]
    report = {
        "command": " ".join(["python", "benchmarks/algorithms.py", *argv]),
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "trainer_ranks": 1,
        "rollout_engines": 1,
        "final_reward_fraction": min(finished) if finished else None,
        "algorithms": results,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="where to write the JSON")
    parser.add_argument("--only", nargs="*", choices=sorted(RUNS), help="these runs only")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    output = Path(args.output)
    if not output.is_absolute():
        output = REPO / output

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlhf-algorithms-") as scratch:
        for name in args.only or RUNS:
            directory = Path(scratch) / name
            directory.mkdir()
            try:
                results[name] = summary = run(name, directory)
            except RunFailedError as failure:
                results[name] = {"error": str(failure)[-2000:]}
                print(f"{name}: failed\n{failure}", flush=True)
            else:
                print(
                    f"{name}: reward {summary['start_reward']:.3f} -> "
                    f"{summary['final_reward']:.3f} ({summary['final_reward_fraction']:.0%} of "
                    f"max) in {summary['steps']} steps, {summary['wall_seconds']:.0f} s wall",
                    flush=True,
                )
            write_report(results, argv, output)
    print(f"wrote {output}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
