"""Turning sampled completions and their rewards into a training batch (pure tensor code).

The driver calls these between the remote phases of a step: flatten the engines' completions
into rows, score them, then compute advantages. GRPO normalises each prompt's group of sequence
rewards; PPO shapes token rewards with the KL penalty and runs GAE over the critic's values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlhf_trainer import algorithms as alg
from rlhf_trainer.data import PromptItem
from rlhf_trainer.registry import Registry
from rlhf_trainer.rollout import Completion
from rlhfjob.api import AlgorithmSpec


@dataclass
class Rollout:
    """One row per sampled response, with the samples of one prompt next to each other."""

    prompts: list[list[int]]
    responses: list[list[int]]
    metadata: list[dict[str, Any]]
    policy_versions: list[int]

    def __len__(self) -> int:
        return len(self.responses)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(response) for response in self.responses)


def flatten_completions(
    items: Sequence[PromptItem], completions: Sequence[Sequence[Completion]]
) -> Rollout:
    """Rows in prompt order, each prompt's completions contiguous (GRPO's group layout)."""
    if len(items) != len(completions):
        raise ValueError(f"{len(items)} prompts but completions for {len(completions)}")
    rollout = Rollout([], [], [], [])
    for item, samples in zip(items, completions, strict=True):
        for sample in samples:
            rollout.prompts.append(list(item.prompt))
            rollout.responses.append(list(sample.token_ids))
            rollout.metadata.append(dict(item.metadata))
            rollout.policy_versions.append(sample.policy_version)
    return rollout


def sequence_kl(
    logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: alg.KLEstimator
) -> Tensor:
    """Per-sequence KL(policy || reference): the per-token estimate summed over the response."""
    return alg.masked_sum(alg.kl_estimate(logprobs, ref_logprobs, estimator), mask, dim=-1)


def grpo_advantages(
    rewards: Tensor,
    algorithm: AlgorithmSpec,
    *,
    logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """One advantage per row: group-normalised rewards, after the KL penalty in reward mode."""
    if algorithm.kl_mode == "reward" and algorithm.kl_coef > 0:
        if logprobs is None or ref_logprobs is None or mask is None:
            raise ValueError("KL in the reward needs log-probs, reference log-probs and a mask")
        kl = sequence_kl(logprobs, ref_logprobs, mask, algorithm.kl_estimator)
        rewards = rewards - algorithm.kl_coef * kl
    return alg.grpo_advantages(rewards, algorithm.group_size, algorithm.scale_rewards)


def ppo_advantages(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    algorithm: AlgorithmSpec,
    *,
    logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Token-level ``(advantages, returns)``: GAE over KL-shaped token rewards.

    The sequence reward lands on each row's last response token; in reward mode every token
    also pays ``klCoef`` times its KL estimate. Advantages are whitened over the batch (the
    usual PPO normalisation); returns, the critic's targets, are not.
    """
    kl_coef = algorithm.kl_coef if algorithm.kl_mode == "reward" else 0.0
    if kl_coef > 0 and (logprobs is None or ref_logprobs is None):
        raise ValueError("KL in the reward needs log-probs and reference log-probs")
    token_rewards = alg.kl_shaped_token_rewards(
        rewards,
        logprobs if logprobs is not None else torch.zeros_like(mask),
        ref_logprobs if ref_logprobs is not None else torch.zeros_like(mask),
        mask,
        kl_coef,
        algorithm.kl_estimator,
    )
    advantages, returns = alg.gae_advantages(
        token_rewards, values, mask, algorithm.gamma, algorithm.gae_lambda
    )
    return alg.masked_whiten(advantages, mask), returns


# --------------------------------------------------------------------------------------------
# Advantage estimators by name (`spec.algorithm.name`)


@dataclass(frozen=True)
class StepScores:
    """What a step knows when it estimates advantages: per-row rewards, the response mask, the
    policy's log-probs before the update, the reference's, and the critic's values."""

    rewards: Tensor
    mask: Tensor
    logprobs: Tensor
    ref_logprobs: Tensor | None = None
    values: Tensor | None = None


@dataclass(frozen=True)
class Estimator:
    """An algorithm as the driver runs it: how many samples a prompt gets, whether it trains a
    critic, and the per-row tensors its update needs beyond the old log-probs."""

    samples_per_prompt: Callable[[AlgorithmSpec], int]
    uses_critic: bool
    estimate: Callable[[StepScores, AlgorithmSpec], dict[str, Tensor]]


ESTIMATORS: Registry[Estimator] = Registry("spec.algorithm.name")


def _grpo(scores: StepScores, algorithm: AlgorithmSpec) -> dict[str, Tensor]:
    advantages = grpo_advantages(
        scores.rewards,
        algorithm,
        mask=scores.mask,
        logprobs=scores.logprobs,
        ref_logprobs=scores.ref_logprobs,
    )
    return {"advantages": advantages}


def _ppo(scores: StepScores, algorithm: AlgorithmSpec) -> dict[str, Tensor]:
    if scores.values is None:
        raise ValueError("PPO needs the critic's values")
    advantages, returns = ppo_advantages(
        scores.rewards,
        scores.values,
        scores.mask,
        algorithm,
        logprobs=scores.logprobs,
        ref_logprobs=scores.ref_logprobs,
    )
    return {"advantages": advantages, "returns": returns, "old_values": scores.values}


ESTIMATORS.register("grpo")(Estimator(lambda a: a.group_size, uses_critic=False, estimate=_grpo))
ESTIMATORS.register("ppo")(Estimator(lambda a: 1, uses_critic=True, estimate=_ppo))
