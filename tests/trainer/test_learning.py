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
from typing import Any

import pytest
import yaml

pytest.importorskip("torch")
pytest.importorskip("ray")
pytest.importorskip("deepspeed")

from rlhf_trainer.data.tasks import get_task
from rlhf_trainer.run.curves import read_step_log

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def train_example(
    name: str,
    directory: Path,
    random_init: dict[str, Any] | None = None,
    spec: dict[str, Any] | None = None,
    **algorithm: Any,
) -> tuple[list[dict], float, Path]:
    """Run `examples/<name>` (with `algorithm`, `model.randomInit` and other `spec` fields
    changed) to the end; returns (step records, max reward, run directory)."""
    document = yaml.safe_load((REPO / "examples" / name).read_text())
    document["spec"]["algorithm"].update(algorithm)
    document["spec"].update(spec or {})
    if random_init:
        document["spec"]["model"]["randomInit"].update(random_init)
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
    """Also on prompts it never trains on: the held-out evaluation's greedy score rises."""
    evaluation = {"heldOutPrompts": 32, "intervalSteps": 10, "samples": 4, "passThreshold": 0.75}
    records, max_reward, run_dir = train_example(example, tmp_path, spec={"evaluation": evaluation})
    rewards = [record["reward_mean"] for record in records]
    assert [record["step"] for record in records] == list(range(1, len(records) + 1))
    assert rewards[0] < 0.15 * max_reward, rewards  # near chance at the start
    assert rewards[-1] >= 0.9 * max_reward, rewards
    assert (run_dir / "reward_curve.png").is_file()
    held_out = read_step_log(run_dir / "metrics.jsonl", "evaluation")
    last = len(records)
    assert [e["step"] for e in held_out] == sorted({0, *range(10, last + 1, 10), last})
    first, final = held_out[0], held_out[-1]
    assert {e["prompts"] for e in held_out} == {32}
    assert first["score"] < 0.3 * max_reward < 0.8 * max_reward <= final["score"], held_out
    assert first["accuracy"] < final["accuracy"] and final["pass@4"] >= final["accuracy"]
    assert all(e["seconds"] > 0 for e in held_out)


@pytest.mark.parametrize(
    ("example", "staleness", "segment"),
    [("grpo-tiny-cpu.yaml", 1, 2), ("ppo-tiny-cpu.yaml", 2, 0)],
    ids=["grpo-partial-rollouts", "ppo"],
)
def test_batches_generated_a_step_ahead_still_learn(example, staleness, segment, tmp_path):
    """`algorithm.maxStaleness`: each step trains on a batch the engines generated while the
    step before trained, one update behind, with the decoupled objective's weights; with
    partial rollouts (`partialRolloutTokens`) in segments, the update's weights reaching the
    engines at a boundary when it lands before the batch is done."""
    records, max_reward, _ = train_example(
        example, tmp_path, maxStaleness=staleness, partialRolloutTokens=segment
    )
    rewards = [record["reward_mean"] for record in records]
    assert rewards[-1] >= 0.9 * max_reward, rewards
    assert set(records[0]["staleness"]) == {"0"}  # the first batch is generated on-policy
    assert {lag for record in records[1:] for lag in record["staleness"]} == {"1"}
    assert all(0 < r["policy_behaviour_weight"] < 5 for r in records)
    # How many responses resumed under the newer weights depends on timing: only its range.
    batch = sum(records[0]["staleness"].values())
    resumed = [r.get("resumed_responses") for r in records[1:]]
    if segment:
        assert all(n is not None and 0 <= n <= batch for n in resumed), resumed
    else:
        assert set(resumed) == {None}


def test_partial_rollouts_resume_open_responses_under_the_new_weights(tmp_path):
    """Responses long enough that generating the batch ahead takes about three times the
    update: the update lands while it is decoded, the weights are synced at a segment
    boundary and the open responses resume under them, still one update old by their first
    token. (Learning with partial rollouts: the parametrized test above.)"""
    records, _, _ = train_example(
        "grpo-tiny-cpu.yaml",
        tmp_path,
        random_init={"max_position_embeddings": 256},
        totalSteps=4,
        promptsPerStep=4,
        groupSize=4,
        maxResponseLength=160,
        maxStaleness=1,
        partialRolloutTokens=16,
    )
    assert [set(r["staleness"]) for r in records] == [{"0"}, {"1"}, {"1"}, {"1"}]
    resumed = [r["resumed_responses"] for r in records[1:]]
    assert any(n > 0 for n in resumed) and all(n <= 16 for n in resumed), resumed
    # Every step's update reaches the engines, the last one's too (no batch ahead then).
    assert all(r["weight_sync_bytes"] > 0 for r in records), records


def test_gspo_with_dapos_dynamic_sampling_and_overlong_shaping_learns(tmp_path):
    """The new loss path end to end, on one trainer rank and one engine: GSPO's sequence ratio
    and its sequence-mean aggregation (weighted by sequences across micro-batches), clip-higher,
    dynamic sampling's refills and the overlong penalty. Every algorithm's own run is
    `benchmarks/algorithms.py`."""
    document = yaml.safe_load((REPO / "examples" / "grpo-tiny-cpu.yaml").read_text())
    spec = document["spec"]
    spec["algorithm"].update(
        totalSteps=20,
        updateEpochs=2,  # the second pass is off-policy: the sequence ratio leaves 1
        stopTokenIds=[2],  # responses of several lengths: the aggregation and the penalty act
        policyLoss="gspo",
        clipRangeLow=3e-4,
        clipRangeHigh=4e-4,
        dynamicSampling={"maxGenerationBatches": 2},
        overlongShaping={"bufferLength": 2, "penalty": 0.1},
    )
    spec["roles"]["trainer"]["replicas"] = spec["roles"]["rollout"]["replicas"] = 1
    spec["checkpoint"]["path"] = str(tmp_path / "checkpoints")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(document))
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-m", "rlhfjob_cli", "train", "--config", str(tmp_path / "job.yaml")],
        capture_output=True, text=True, timeout=1200, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    records = read_step_log(tmp_path / "checkpoints" / "default" / "grpo-tiny" / "metrics.jsonl")
    rewards = [record["reward_mean"] for record in records]
    assert rewards[0] < 0.15 and rewards[-1] >= 0.9, rewards  # the task's reward, unshaped
    assert sum(record["dropped_groups"] for record in records) > 0
    assert max(record["generation_batches"] for record in records) == 2
    assert any(record["policy_clip_fraction"] > 0 for record in records)


PROMPTS = ["what is two plus two", "hello world", "a b c d e", "the answer is"]


def train_text_job(directory: Path, example: str, **spec: Any) -> list[dict]:
    """`examples/<example>` on text: the tiny BPE tokenizer, a policy of its vocabulary, the
    text prompts above; `spec` sections replace or update the example's. Returns the step log."""
    from transformers import AutoTokenizer

    from rlhf_local.tiny_models import save_tiny_tokenizer

    tokenizer_dir = save_tiny_tokenizer(directory / "tokenizer")
    dataset = directory / "prompts.jsonl"
    dataset.write_text("".join(f'{{"prompt": "{prompt}"}}\n' for prompt in PROMPTS))
    document = yaml.safe_load((REPO / "examples" / example).read_text())
    document["metadata"]["name"] = "text-job"
    job_spec = document["spec"]
    job_spec["model"]["randomInit"]["vocab_size"] = len(
        AutoTokenizer.from_pretrained(tokenizer_dir)
    )
    job_spec["model"]["tokenizer"] = str(tokenizer_dir)
    job_spec["dataset"] = {"source": str(dataset), "promptField": "prompt"}
    job_spec["checkpoint"]["path"] = str(directory / "checkpoints")
    # One trainer rank and one engine: the examples' placements are covered above, and fewer
    # processes on two cores make these runs quicker.
    job_spec["roles"]["trainer"]["replicas"] = job_spec["roles"]["rollout"]["replicas"] = 1
    for section, fields in spec.items():
        if section in ("reward",):
            job_spec[section] = fields
        else:
            job_spec.setdefault(section, {}).update(fields)
    job = directory / "text-job.yaml"
    job.write_text(yaml.safe_dump(document))
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-m", "rlhfjob_cli", "train", "--config", str(job)],
        capture_output=True, text=True, timeout=1200, env=env, cwd=directory,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return read_step_log(directory / "checkpoints" / "default" / "text-job" / "metrics.jsonl")


def rule_and_reward_model(directory: Path) -> tuple[dict[str, Any], float]:
    """Both kinds of reward at once, half each: a rule that reads the decoded response (how
    many "4"s of the 8 it may hold) and a reward-model replica (a hand-weighted classifier that
    prefers the token "4", re-tokenizing with its own tokenizer). Returns the spec sections and
    the best mean reward a policy can reach (every response 8 "4"s)."""
    from rlhf_local.tiny_models import save_tiny_reward_model, save_tiny_tokenizer
    from rlhf_trainer.rewards.model import RewardModelScorer

    (directory / "fours.py").write_text(
        "def fours(response_texts):\n"
        "    return [min(1.0, text.count('4') / 8) for text in response_texts]\n"
    )
    reward_dir = save_tiny_reward_model(
        directory / "reward-model", save_tiny_tokenizer(directory / "rm-tokenizer"), "4"
    )
    best = RewardModelScorer(str(reward_dir)).score(PROMPTS, ["4" * 8] * len(PROMPTS), 8)
    spec = {
        "model": {"reward": str(reward_dir)},
        "reward": {
            "type": "combined",
            "batchSize": 16,
            "components": [
                {"type": "function", "name": "fours", "function": "fours:fours", "weight": 0.5},
                {"type": "model", "name": "preference", "weight": 0.5},
            ],
        },
        "roles": {"reward": {"replicas": 1, "cpu": 1, "memory": "2Gi"}},
    }
    return spec, 0.5 * 1.0 + 0.5 * sum(best) / len(best)


@pytest.mark.parametrize(
    ("example", "algorithm"),
    [
        ("grpo-tiny-cpu.yaml", {"stopAtEos": False, "totalSteps": 40}),
        ("ppo-tiny-cpu.yaml", {"totalSteps": 60}),  # responses end at the tokenizer's EOS
    ],
    ids=["grpo", "ppo"],
)
def test_text_prompts_learn_what_a_text_rule_and_a_reward_model_prefer(
    example, algorithm, tmp_path
):
    """Text in (a tiny BPE tokenizer, text prompts), every reward kind out: GRPO and PPO each
    learn from a text rule and a reward model combined, to 0.9 of what is achievable."""
    spec, achievable = rule_and_reward_model(tmp_path)
    records = train_text_job(
        tmp_path, example, **spec, algorithm={**algorithm, "policyLearningRate": 0.005}
    )
    rewards = [record["reward_mean"] for record in records]
    assert set(records[-1]["reward_components"]) == {"fours", "preference"}
    assert rewards[0] < 0.3 * achievable, rewards
    assert max(rewards[-3:]) >= 0.9 * achievable, (rewards, achievable)
