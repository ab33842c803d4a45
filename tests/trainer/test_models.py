"""The trainer and the rollout engines build the policy with one builder (`models.causal_lm`)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rlhf_trainer.engines import HFEngine, ModelSource  # noqa: E402
from rlhf_trainer.models import build_causal_lm, build_critic, build_reference  # noqa: E402
from rlhfjob.config import load_job  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-tiny-cpu.yaml"


def test_the_engine_and_the_trainer_initialise_the_same_weights_for_one_seed() -> None:
    spec = load_job(EXAMPLE).spec
    seed = spec.algorithm.seed
    trainer = dict(build_causal_lm(spec.model, seed).named_parameters())
    engine = dict(HFEngine(ModelSource.from_spec(spec.model, seed=seed)).model.named_parameters())
    assert trainer.keys() == engine.keys()
    assert all(torch.equal(trainer[name], engine[name]) for name in trainer)
    other = dict(build_causal_lm(spec.model, seed + 1).named_parameters())
    assert not all(torch.equal(trainer[name], other[name]) for name in trainer)


def test_the_reference_and_the_critic_start_from_the_policy_weights() -> None:
    spec = load_job(EXAMPLE).spec
    seed = spec.algorithm.seed
    policy = build_causal_lm(spec.model, seed)
    reference = dict(build_reference(spec.model, seed).named_parameters())
    assert all(torch.equal(p, reference[name]) for name, p in policy.named_parameters())
    backbone = dict(build_critic(spec.model, seed).backbone.named_parameters())
    decoder = dict(policy.get_decoder().named_parameters())
    assert decoder.keys() == backbone.keys()
    assert all(torch.equal(decoder[name], backbone[name]) for name in decoder)


def test_random_init_is_drawn_in_float32_then_cast() -> None:
    spec = load_job(EXAMPLE).spec
    full = dict(build_causal_lm(spec.model, 3).named_parameters())
    half = dict(build_causal_lm(spec.model, 3, torch.bfloat16).named_parameters())
    assert all(half[name].dtype == torch.bfloat16 for name in half)
    assert all(torch.equal(full[name].to(torch.bfloat16), half[name]) for name in full)
