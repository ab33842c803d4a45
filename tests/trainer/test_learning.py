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


def test_grpo_on_text_prompts_learns_what_a_reward_model_prefers(tmp_path):
    """Text in (a tiny BPE tokenizer, text prompts), the reward-model role out: one replica of
    a hand-weighted sequence-classification model that prefers the token "4" scores every
    response, re-tokenized with its own tokenizer; the policy learns to answer with it."""
    from transformers import AutoTokenizer

    from rlhf_local.tiny_models import save_tiny_reward_model, save_tiny_tokenizer
    from rlhf_trainer.reward_models import RewardModelScorer

    tokenizer_dir = save_tiny_tokenizer(tmp_path / "tokenizer")
    reward_dir = save_tiny_reward_model(tmp_path / "reward-model", tokenizer_dir, "4")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = ["what is two plus two", "hello world", "a b c d e", "the answer is"]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(f'{{"prompt": "{p}"}}\n' for p in prompts))

    document = yaml.safe_load((REPO / "examples" / "grpo-tiny-cpu.yaml").read_text())
    spec = document["spec"]
    document["metadata"]["name"] = "grpo-text-rm"
    spec["model"]["randomInit"]["vocab_size"] = len(tokenizer)
    spec["model"]["randomInit"]["max_position_embeddings"] = 64
    spec["model"].update(tokenizer=str(tokenizer_dir), reward=str(reward_dir))
    spec["dataset"] = {"source": str(dataset), "promptField": "prompt"}
    spec["reward"] = {"type": "model", "batchSize": 16}
    spec["roles"]["reward"] = {"replicas": 1, "cpu": 1, "memory": "2Gi"}
    spec["algorithm"].update(stopAtEos=False, totalSteps=40, policyLearningRate=0.005)
    job = tmp_path / "grpo-text-rm.yaml"
    document["spec"]["checkpoint"]["path"] = str(tmp_path / "checkpoints")
    job.write_text(yaml.safe_dump(document))
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-m", "rlhfjob_cli", "train", "--config", str(job)],
        capture_output=True, text=True, timeout=1200, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    records = read_step_log(tmp_path / "checkpoints" / "default" / "grpo-text-rm" / "metrics.jsonl")

    # The best a response can score: every one of its 8 tokens the target.
    scorer = RewardModelScorer(str(reward_dir))
    best = scorer.score(prompts, ["4" * 8] * len(prompts), batch_size=8)
    achievable = sum(best) / len(best)
    rewards = [record["reward_mean"] for record in records]
    assert records[-1]["reward_components"] == {"model": pytest.approx(rewards[-1])}
    assert rewards[0] < 0.3 * achievable, rewards
    assert rewards[-1] >= 0.9 * achievable, (rewards, achievable)
