"""Held-out evaluation (`rlhf_trainer.run.evaluation`, `rlhf_trainer.data.heldout`) on a real
transformers engine: the split, greedy and sampled figures, by data source, the step log."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf_trainer.data.heldout import load_held_out, split_held_out
from rlhf_trainer.data.prompts import PromptItem
from rlhf_trainer.data.tasks import target_token_reward
from rlhf_trainer.rollout.engines import HFEngine
from rlhf_trainer.rollout.model_source import ModelSource
from rlhf_trainer.run import metrics as m
from rlhf_trainer.run.curves import read_step_log
from rlhf_trainer.run.evaluation import Evaluator, is_due
from rlhf_trainer.run.sampling import Sampler
from rlhf_trainer.run.startup import Inputs
from rlhfjob.api import EvaluationSpec, RLHFJobSpec
from rlhfjob.config import parse_job
from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import valid_job

TINY = {
    "model_type": "qwen2",
    "vocab_size": 16,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}


def spec_with(**changes: object) -> RLHFJobSpec:
    return parse_job(merge_patch(valid_job("job"), {"spec": changes})).spec


def items(count: int) -> list[PromptItem]:
    return [
        PromptItem([2 + i % 10, 3], {"n": i, "data_source": "even" if i % 2 == 0 else "odd"})
        for i in range(count)
    ]


def test_the_held_out_split_is_seeded_disjoint_and_complete() -> None:
    prompts = items(50)
    kept, held = split_held_out(prompts, 10, seed=7)
    assert len(held) == 10 and len(kept) == 40
    assert {i.metadata["n"] for i in kept}.isdisjoint({i.metadata["n"] for i in held})
    assert split_held_out(prompts, 10, seed=7) == (kept, held)  # a resume holds out the same
    assert split_held_out(prompts, 10, seed=8)[1] != held


def test_holding_out_every_prompt_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"spec\.evaluation\.heldOutPrompts"):
        split_held_out(items(5), 5, seed=0)


def test_a_held_out_file_that_cannot_be_read_names_the_field(tmp_path: Path) -> None:
    spec = spec_with(evaluation={"source": str(tmp_path / "missing.jsonl")})
    with pytest.raises(ValueError, match=r"spec\.evaluation\.source"):
        load_held_out(spec, items(4), None)


def test_a_held_out_file_is_read_like_the_dataset_and_capped(tmp_path: Path) -> None:
    path = tmp_path / "test.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": [1, 2, i], "answer": i}) + "\n" for i in range(5))
    )
    spec = spec_with(evaluation={"source": str(path), "maxPrompts": 3})
    train, held = load_held_out(spec, items(4), None)
    assert train == items(4)  # a file of its own takes nothing from training
    assert [item.prompt for item in held] == [[1, 2, 0], [1, 2, 1], [1, 2, 2]]


@pytest.mark.parametrize(
    ("step", "due"), [(0, True), (3, False), (4, True), (7, True), (8, True), (9, False)]
)
def test_evaluation_is_due_before_the_first_step_every_interval_and_after_the_last(
    step: int, due: bool
) -> None:
    assert is_due(EvaluationSpec(heldOutPrompts=1, intervalSteps=4), step, total_steps=7) is due
    assert not is_due(None, 0, total_steps=7)


def evaluator(evaluation: EvaluationSpec, tmp_path: Path) -> tuple[Evaluator, m.TrainerMetrics]:
    """An evaluator over a real tiny engine and the target-token reward."""
    spec = spec_with(algorithm={"maxResponseLength": 6})
    engine = HFEngine(ModelSource(config=TINY, seed=3))
    metrics = m.TrainerMetrics(jsonl_path=tmp_path / "metrics.jsonl")

    @contextlib.contextmanager
    def phase(name: str) -> Iterator[None]:
        with metrics.time_phase(name):
            yield

    inputs = Inputs(reward=None, prompts=items(4))  # type: ignore[arg-type]  # passed below
    sampler = Sampler(spec, inputs, engine, metrics, phase)
    return Evaluator(evaluation, items(8), sampler, target_token_reward, phase), metrics


def test_greedy_and_sampled_figures_by_data_source(tmp_path: Path) -> None:
    spec = EvaluationSpec(heldOutPrompts=8, samples=4, temperature=1.0, passThreshold=0.3)
    run, metrics = evaluator(spec, tmp_path)
    first, again = run.evaluate(0), run.evaluate(0)
    assert first["score"] == again["score"]  # greedy and seeded: the same figures again
    assert first["prompts"] == 8 and 0 <= first["accuracy"] <= first["pass@4"] <= 1
    assert set(first["by_source"]) == {"even", "odd"}
    for figure in ("score", "accuracy", "pass@4", "mean@4"):
        halves = [first["by_source"][source][figure] for source in ("even", "odd")]
        assert first[figure] == pytest.approx(sum(halves) / 2)  # four prompts each

    record = metrics.record_evaluation(first)
    assert record["kind"] == "evaluation" and record["seconds"] > 0
    assert read_step_log(tmp_path / "metrics.jsonl", "evaluation") == [record]
    assert read_step_log(tmp_path / "metrics.jsonl") == []  # not a step
    exported = metrics.registry.get_sample_value(
        m.EVALUATION, {"figure": "accuracy", "source": "all"}
    )
    assert exported == first["accuracy"]


def test_a_response_passes_when_its_reward_reaches_the_threshold(tmp_path: Path) -> None:
    """Rewards by prompt: the first half of the prompts score 1, the rest 0.5."""
    spec = EvaluationSpec(heldOutPrompts=8, samples=2, passThreshold=0.75)
    run, _ = evaluator(spec, tmp_path)

    def by_prompt(prompts: list[list[int]], responses: list[list[int]], metadata: list[dict]):
        return [1.0 if meta["n"] < 4 else 0.5 for meta in metadata]

    run.reward = by_prompt
    record = run.evaluate(3)
    assert (record["score"], record["accuracy"]) == (0.75, 0.5)
    assert (record["pass@2"], record["mean@2"]) == (0.5, 0.75)
    assert record["response_tokens"] == 6  # no stop token: every response as long as allowed
