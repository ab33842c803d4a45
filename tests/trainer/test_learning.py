"""The CPU examples learn: 2 ZeRO-3 trainer ranks and 2 rollout engines on a local Ray
(colocated: one engine inside each rank).

Each example runs as `rlhfjob train` in a child process that starts its own Ray (the local path
of the driver), with checkpoints and the step log redirected under the test's directory. Mean
reward must rise from about chance (1/32 for the target-token task) to at least 0.9 of the task's
maximum by the last step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch")
pytest.importorskip("ray")
pytest.importorskip("deepspeed")

from rlhf_trainer.curves import read_step_log
from rlhf_trainer.tasks import get_task

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def train_example(name: str, directory: Path) -> tuple[list[dict], float, Path]:
    """Run `examples/<name>` to the end; returns (step records, max reward, run directory)."""
    document = yaml.safe_load((REPO / "examples" / name).read_text())
    document["spec"]["checkpoint"]["path"] = str(directory / "checkpoints")
    job = directory / name
    job.write_text(yaml.safe_dump(document))
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-m", "rlhfjob_cli", "train", "--config", str(job)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        cwd=directory,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    run_dir = directory / "checkpoints" / "default" / document["metadata"]["name"]
    task = get_task(document["spec"]["dataset"]["source"].removeprefix("synthetic:"))
    return read_step_log(run_dir / "metrics.jsonl"), task.max_reward, run_dir


@pytest.mark.parametrize(
    "example", ["grpo-tiny-cpu.yaml", "grpo-tiny-colocated-cpu.yaml", "ppo-tiny-cpu.yaml"]
)
def test_the_tiny_example_learns_its_task(example, tmp_path):
    records, max_reward, run_dir = train_example(example, tmp_path)
    rewards = [record["reward_mean"] for record in records]
    assert [record["step"] for record in records] == list(range(1, len(records) + 1))
    assert rewards[0] < 0.15 * max_reward, rewards  # near chance at the start
    assert rewards[-1] >= 0.9 * max_reward, rewards
    assert (run_dir / "reward_curve.png").is_file()
