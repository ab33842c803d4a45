"""Registries: every choice the API offers has one implementation, and a name without one fails
at start-up naming the field, never falls into another choice's branch."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest

pytest.importorskip("torch")

import torch

from rlhf_trainer.algo import formulas as alg
from rlhf_trainer.algo.experience import ESTIMATORS
from rlhf_trainer.algo.losses import POLICY_LOSSES
from rlhf_trainer.registry import Registry, UnknownNameError
from rlhf_trainer.rewards.sources import REWARD_SOURCES, build_reward
from rlhf_trainer.run.startup import NonRetryableError, load_inputs
from rlhfjob.api import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGGREGATIONS,
    AlgorithmSpec,
    RewardComponentSpec,
    RewardSourceSpec,
    RewardSpec,
)
from rlhfjob.api import (
    POLICY_LOSSES as API_POLICY_LOSSES,
)
from rlhfjob.config import load_job

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-tiny-cpu.yaml"


def choices(model: type, field: str) -> set[str]:
    return set(get_args(model.model_fields[field].annotation))


def test_every_algorithm_the_api_offers_has_an_estimator_and_no_other() -> None:
    assert set(ESTIMATORS) == choices(AlgorithmSpec, "name") == set(ADVANTAGE_ESTIMATORS)
    for name in ESTIMATORS:  # what the driver asks of an estimator is what the API declares
        assert ESTIMATORS[name].uses_critic == ADVANTAGE_ESTIMATORS[name].uses_critic


def test_every_policy_loss_the_api_offers_is_registered_and_no_other() -> None:
    assert set(POLICY_LOSSES) == choices(AlgorithmSpec, "policy_loss") == set(API_POLICY_LOSSES)


def test_every_loss_aggregation_the_api_offers_is_implemented() -> None:
    offered = {name for name in get_args(AlgorithmSpec.model_fields["loss_aggregation"].annotation)
               for name in get_args(name)}  # fmt: skip
    assert offered == set(LOSS_AGGREGATIONS)
    per_token, mask = torch.ones(2, 3), torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    for name in offered:
        assert alg.aggregate_loss(per_token, mask, name, normaliser=2.0) > 0, name


def test_every_reward_source_type_the_api_offers_has_a_scorer_and_no_other() -> None:
    assert set(REWARD_SOURCES) == choices(RewardSourceSpec, "type")
    assert choices(RewardSpec, "type") == choices(RewardSourceSpec, "type") | {"combined"}


def test_a_name_without_an_implementation_names_the_field_and_what_is_known() -> None:
    registry: Registry[int] = Registry("spec.thing")
    registry.register("b")(2)
    registry.register("a")(1)
    assert registry["a"] == 1 and list(registry) == ["a", "b"] and "b" in registry
    with pytest.raises(UnknownNameError, match=r"spec.thing: 'c' is not known .* knows a, b"):
        registry["c"]
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("a")(3)


def test_a_reward_type_only_the_api_knows_is_refused_not_scored_by_the_reward_model() -> None:
    spec = load_job(EXAMPLE).spec
    judge = RewardComponentSpec.model_construct(  # a type a newer API would allow
        type="judge", name=None, weight=1.0, function=None, remote=None
    )
    unknown = RewardSpec.model_construct(
        **{**dict(spec.reward), "type": "combined", "components": [judge]}
    )
    spec = spec.model_copy(update={"reward": unknown})
    with pytest.raises(UnknownNameError, match=r"spec\.reward\.type: 'judge'"):
        build_reward(spec, decode=None)


def test_an_algorithm_only_the_api_knows_fails_at_start_up() -> None:
    spec = load_job(EXAMPLE).spec
    algorithm = AlgorithmSpec.model_construct(**{**dict(spec.algorithm), "name": "dpo"})
    spec = spec.model_copy(update={"algorithm": algorithm})
    with pytest.raises(NonRetryableError, match=r"spec\.algorithm\.name: 'dpo'"):
        load_inputs(spec, check_model=False)
