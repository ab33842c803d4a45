"""The reward sources a job combines, by `reward.type`: a rule function, the reward-model role,
a remote server. `REWARD_SOURCES` is the one place a new source type is added."""

from __future__ import annotations

from collections.abc import Callable

from rlhf_trainer.registry import Registry
from rlhf_trainer.rewards.functions import (
    CombinedReward,
    Decode,
    ModelReward,
    RewardFunctionError,
    RewardPart,
    RuleReward,
    Score,
)
from rlhf_trainer.rewards.remote import RemoteReward
from rlhfjob.api import RewardSourceSpec, RLHFJobSpec

RewardSourceBuilder = Callable[[str, RewardSourceSpec, RLHFJobSpec, Decode | None], Score]
"""Builds the scorer of one reward source: (its name, the source, the spec, the decoder)."""
REWARD_SOURCES: Registry[RewardSourceBuilder] = Registry("spec.reward.type")
"""How each `reward.type` (and component type) scores: the API's choices, one builder each."""


@REWARD_SOURCES.register("function")
def _function_reward(
    name: str, source: RewardSourceSpec, spec: RLHFJobSpec, decode: Decode | None
) -> Score:
    assert source.function is not None  # the API requires it
    return RuleReward.from_spec(source.function, decode)


@REWARD_SOURCES.register("remote")
def _remote_reward(
    name: str, source: RewardSourceSpec, spec: RLHFJobSpec, decode: Decode | None
) -> Score:
    assert source.remote is not None  # the API requires it
    return RemoteReward.from_spec(source.remote, decode, name=name)


@REWARD_SOURCES.register("model")
def _model_reward(
    name: str, source: RewardSourceSpec, spec: RLHFJobSpec, decode: Decode | None
) -> Score:
    if decode is None:
        raise RewardFunctionError(
            name,
            "a reward model scores text, which needs a tokenizer: set "
            "spec.model.tokenizer, or use a policy directory with one",
        )
    return ModelReward(decode, spec.reward.batch_size)


def build_reward(spec: RLHFJobSpec, decode: Decode | None) -> CombinedReward:
    """The job's reward from `spec.reward`: a rule function, the reward-model role, a remote
    server, or a weighted sum of them. RewardFunctionError when a source is unusable,
    UnknownNameError (a ValueError) for a type this trainer has no scorer of."""
    parts = [
        RewardPart(name, weight, REWARD_SOURCES[source.type](name, source, spec, decode))
        for name, source, weight in spec.reward.sources()
    ]
    return CombinedReward(parts, normalize=spec.reward.normalize)
