"""Turning sampled completions and their rewards into a training batch (pure tensor code).

The driver calls these between the remote phases of a step: flatten the engines' completions
into rows, score them, then compute advantages with the estimator `algorithm.name` chooses.
Each estimator is one function registered with `@advantage_estimator(name)` next to its
neighbours; the names, what each needs (groups, a critic) and the paper each follows are the
API's (`rlhfjob.api.algorithm.ADVANTAGE_ESTIMATORS`), and a unit test holds the two equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlhf_trainer import masked
from rlhf_trainer.algo import formulas as alg
from rlhf_trainer.data.prompts import PromptItem
from rlhf_trainer.registry import Registry
from rlhf_trainer.rollout.base import Completion
from rlhfjob.api import AlgorithmSpec
from rlhfjob.api.algorithm import ADVANTAGE_ESTIMATORS, EstimatorChoice


@dataclass
class Rollout:
    """One row per sampled response, with the samples of one prompt next to each other."""

    prompts: list[list[int]]
    responses: list[list[int]]
    metadata: list[dict[str, Any]]
    policy_versions: list[int]
    logprobs: list[list[float]] = field(default_factory=list)
    """The engine's log-prob of each response token (the behaviour policy's), when asked for
    (`algorithm.maxStaleness`); empty otherwise."""
    action_masks: list[list[int]] = field(default_factory=list)
    """Multi-turn trajectories (`spec.environment`): 1 on each response token the model
    generated, 0 on the environment's (tool results, the chat template's turn markers),
    which are never trained on. Empty: every response token is the model's."""

    def __len__(self) -> int:
        return len(self.responses)

    @property
    def num_generated_tokens(self) -> int:
        if self.action_masks:
            return sum(sum(mask) for mask in self.action_masks)
        return sum(len(response) for response in self.responses)

    def final_turns(self) -> list[list[int]]:
        """Each row's last run of model tokens (a trajectory's last turn), what its reward
        reads; the whole response where every token is the model's."""
        if not self.action_masks:
            return self.responses
        pairs = zip(self.responses, self.action_masks, strict=True)
        return [last_model_run(response, mask) for response, mask in pairs]

    def groups(self, indices: Sequence[int], group_size: int) -> Rollout:
        """The rows of the groups at `indices` (each `group_size` contiguous rows), in order."""
        rows = [g * group_size + i for g in indices for i in range(group_size)]
        return Rollout(
            [self.prompts[r] for r in rows],
            [self.responses[r] for r in rows],
            [self.metadata[r] for r in rows],
            [self.policy_versions[r] for r in rows],
            [self.logprobs[r] for r in rows] if self.logprobs else [],
            [self.action_masks[r] for r in rows] if self.action_masks else [],
        )

    @staticmethod
    def concatenate(parts: Sequence[Rollout]) -> Rollout:
        """The rows of `parts`, one after the other."""
        return Rollout(
            [row for part in parts for row in part.prompts],
            [row for part in parts for row in part.responses],
            [row for part in parts for row in part.metadata],
            [row for part in parts for row in part.policy_versions],
            [row for part in parts for row in part.logprobs],
            [row for part in parts for row in part.action_masks],
        )


def last_model_run(response: Sequence[int], mask: Sequence[int]) -> list[int]:
    """The tokens of the last contiguous run of 1s in `mask` (none: an empty list)."""
    end = len(mask)
    while end > 0 and not mask[end - 1]:
        end -= 1
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return list(response[start:end])


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
            rollout.logprobs.append(list(sample.logprobs))
    if not any(rollout.logprobs):  # the engines were not asked for them
        rollout.logprobs = []
    return rollout


@dataclass(frozen=True)
class SampledStep:
    """What a step trains on: its rollout and the rewards its advantages see, plus the reward
    function's scores of every response it sampled (dropped groups too), which the step
    reports, and what dynamic sampling and the environment did (empty without them)."""

    rollout: Rollout
    rewards: Tensor
    task_rewards: Tensor
    reward_components: dict[str, float]
    """Each reward part's mean over every sampled response (rollouts are of equal size)."""
    report: dict[str, float]


def save_sampled(sampled: SampledStep, path: Path) -> None:
    """`sampled` as plain tensors, lists and numbers (read back without unpickling code)."""
    rollout = sampled.rollout
    torch.save(
        {
            "prompts": rollout.prompts,
            "responses": rollout.responses,
            "metadata": rollout.metadata,
            "policy_versions": rollout.policy_versions,
            "logprobs": rollout.logprobs,
            "action_masks": rollout.action_masks,
            "rewards": sampled.rewards,
            "task_rewards": sampled.task_rewards,
            "reward_components": sampled.reward_components,
            "report": sampled.report,
        },
        path,
    )


def load_sampled(path: Path) -> SampledStep:
    saved = torch.load(path, weights_only=True)
    rollout = Rollout(
        saved["prompts"],
        saved["responses"],
        saved["metadata"],
        saved["policy_versions"],
        saved["logprobs"],
        saved.get("action_masks", []),
    )
    return SampledStep(
        rollout,
        saved["rewards"],
        saved["task_rewards"],
        saved["reward_components"],
        saved["report"],
    )


def on_response_columns(
    prompts: Sequence[Sequence[int]], per_token: Sequence[Sequence[float]], columns: int
) -> Tensor:
    """Per-response-token values (an engine's log-probs) on a batch's next-token grid
    (`rlhf_trainer.algo.batch`): row ``r``'s response starts at column ``len(prompt) - 1``."""
    grid = torch.zeros(len(prompts), columns)
    for row, (prompt, values) in enumerate(zip(prompts, per_token, strict=True)):
        start = len(prompt) - 1
        grid[row, start : start + len(values)] = torch.tensor(values, dtype=grid.dtype)
    return grid


def choose_groups(signal: Sequence[bool], wanted: int) -> tuple[list[int], int]:
    """Dynamic sampling's choice among the groups sampled in a step, given which have signal
    (rewards not all equal): the first `wanted` with signal, filled up with the first without
    when there are fewer. Returns the chosen groups in sampling order and how many fill."""
    with_signal = [group for group, has in enumerate(signal) if has][:wanted]
    filler = [group for group, has in enumerate(signal) if not has][: wanted - len(with_signal)]
    return sorted(with_signal + filler), len(filler)


def sequence_kl(
    logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: alg.KLEstimator
) -> Tensor:
    """Per-sequence KL(policy || reference): the per-token estimate summed over the response."""
    return masked.masked_sum(alg.kl_estimate(logprobs, ref_logprobs, estimator), mask, dim=-1)


def kl_penalised_rewards(
    rewards: Tensor,
    algorithm: AlgorithmSpec,
    logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    mask: Tensor | None,
) -> Tensor:
    """Sequence rewards, less ``klCoef`` times each sequence's KL in reward mode."""
    if algorithm.kl_mode == "reward" and algorithm.kl_coef > 0:
        if logprobs is None or ref_logprobs is None or mask is None:
            raise ValueError("KL in the reward needs log-probs, reference log-probs and a mask")
        kl = sequence_kl(logprobs, ref_logprobs, mask, algorithm.kl_estimator)
        rewards = rewards - algorithm.kl_coef * kl
    return rewards


def grpo_advantages(
    rewards: Tensor,
    algorithm: AlgorithmSpec,
    *,
    logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """One advantage per row: group-normalised rewards, after the KL penalty in reward mode."""
    rewards = kl_penalised_rewards(rewards, algorithm, logprobs, ref_logprobs, mask)
    return alg.grpo_advantages(rewards, algorithm.group_size, algorithm.scale_rewards)


def kl_shaped_token_rewards(
    rewards: Tensor,
    mask: Tensor,
    algorithm: AlgorithmSpec,
    logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
) -> Tensor:
    """``[B, T]`` token rewards: each row's reward on its last response token and, in reward
    mode, ``klCoef`` times its KL estimate taken from every token."""
    kl_coef = algorithm.kl_coef if algorithm.kl_mode == "reward" else 0.0
    if kl_coef > 0 and (logprobs is None or ref_logprobs is None):
        raise ValueError("KL in the reward needs log-probs and reference log-probs")
    return alg.kl_shaped_token_rewards(
        rewards,
        logprobs if logprobs is not None else torch.zeros_like(mask),
        ref_logprobs if ref_logprobs is not None else torch.zeros_like(mask),
        mask,
        kl_coef,
        algorithm.kl_estimator,
    )


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
    token_rewards = kl_shaped_token_rewards(rewards, mask, algorithm, logprobs, ref_logprobs)
    advantages, returns = alg.gae_advantages(
        token_rewards, values, mask, algorithm.gamma, algorithm.gae_lambda
    )
    return masked.masked_whiten(advantages, mask), returns


# --------------------------------------------------------------------------------------------
# Advantage estimators by name (`spec.algorithm.name`)


@dataclass(frozen=True)
class StepScores:
    """What a step knows when it estimates advantages: per-row rewards, the response mask, the
    policy's log-probs before the update, the reference's, and the critic's values."""

    rewards: Tensor
    mask: Tensor
    logprobs: Tensor | None
    """None when no estimator reads them (`losses.old_logprobs_needed`)."""
    ref_logprobs: Tensor | None = None
    values: Tensor | None = None


EstimateFn = Callable[[StepScores, AlgorithmSpec], dict[str, Tensor]]


@dataclass(frozen=True)
class Estimator:
    """An algorithm as the driver runs it: the per-row tensors its update needs beyond the old
    log-probs, and what the API says it needs (groups, a critic)."""

    estimate: EstimateFn
    choice: EstimatorChoice

    @property
    def uses_critic(self) -> bool:
        return self.choice.uses_critic


ESTIMATORS: Registry[Estimator] = Registry("spec.algorithm.name")


def advantage_estimator(name: str) -> Callable[[EstimateFn], EstimateFn]:
    """Decorator: the estimator the API's `name` chooses (its traits come from the API)."""

    def add(estimate: EstimateFn) -> EstimateFn:
        ESTIMATORS.register(name)(Estimator(estimate, ADVANTAGE_ESTIMATORS[name]))
        return estimate

    return add


@advantage_estimator("grpo")
def _grpo(scores: StepScores, algorithm: AlgorithmSpec) -> dict[str, Tensor]:
    advantages = grpo_advantages(
        scores.rewards,
        algorithm,
        mask=scores.mask,
        logprobs=scores.logprobs,
        ref_logprobs=scores.ref_logprobs,
    )
    return {"advantages": advantages}


@advantage_estimator("ppo")
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


@advantage_estimator("rloo")
def _rloo(scores: StepScores, algorithm: AlgorithmSpec) -> dict[str, Tensor]:
    rewards = kl_penalised_rewards(
        scores.rewards, algorithm, scores.logprobs, scores.ref_logprobs, scores.mask
    )
    return {"advantages": alg.rloo_advantages(rewards, algorithm.group_size)}


def _reinforce_plus_plus(
    rewards: Tensor, scores: StepScores, algorithm: AlgorithmSpec
) -> dict[str, Tensor]:
    token_rewards = kl_shaped_token_rewards(
        rewards, scores.mask, algorithm, scores.logprobs, scores.ref_logprobs
    )
    advantages, _ = alg.reinforce_plus_plus_advantages(token_rewards, scores.mask, algorithm.gamma)
    return {"advantages": advantages}


@advantage_estimator("reinforce-plus-plus")
def _reinforce_plus_plus_plain(scores: StepScores, algorithm: AlgorithmSpec) -> dict[str, Tensor]:
    return _reinforce_plus_plus(scores.rewards, scores, algorithm)


@advantage_estimator("reinforce-plus-plus-baseline")
def _reinforce_plus_plus_baseline(
    scores: StepScores, algorithm: AlgorithmSpec
) -> dict[str, Tensor]:
    # The group's mean reward as the baseline, before the KL shaping and the batch whitening.
    centred = alg.grpo_advantages(scores.rewards, algorithm.group_size, scale_by_std=False)
    return _reinforce_plus_plus(centred, scores, algorithm)
