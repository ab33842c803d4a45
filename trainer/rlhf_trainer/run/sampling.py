"""A step's batch: prompts, generated responses and their rewards.

The `Sampler` owns the run's place in the dataset and everything between prompts and scored
responses: the sampling parameters and seeds, stop strings, dynamic sampling (DAPO: groups whose
rewards are all equal are dropped and refilled) and the overlong penalty. Whether the batch is
generated now or ahead of its step is `rlhf_trainer.run.ahead`'s concern, not this one's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from rlhf_trainer.algo.experience import (
    Rollout,
    SampledStep,
    choose_groups,
    flatten_completions,
)
from rlhf_trainer.algo.formulas import groups_with_signal, overlong_penalty
from rlhf_trainer.data.prompts import DataPosition, PromptItem, PromptIterator
from rlhf_trainer.environments.episodes import EPISODE_KEY
from rlhf_trainer.environments.episodes import figures as episode_figures
from rlhf_trainer.rollout.base import Rollout as Engines
from rlhf_trainer.rollout.base import SamplingParams, truncate_completions
from rlhf_trainer.rollout.partial import generate_in_segments
from rlhf_trainer.run import metrics as m
from rlhf_trainer.run.startup import Inputs
from rlhf_trainer.seeds import generation_seed
from rlhfjob.api import AlgorithmSpec, EnvironmentSpec, RLHFJobSpec

Phase = Callable[[str], AbstractContextManager[None]]
"""Times a named phase of the step (metrics and the heartbeat's phase)."""
BetweenSegments = Callable[[], bool]
"""Called at each segment boundary of a partial rollout; True once the weights were synced."""


def score_rollout(
    reward: Callable[..., Sequence[float]],
    rollout: Rollout,
    environment: EnvironmentSpec | None,
) -> list[float]:
    """Each row's reward: of its prompt and response, or for a trajectory its first prompt and
    the model's last turn (its answer), with what the environment did in the record's
    `episode`; a truncated trajectory gets `environment.truncatedReward` where that is set."""
    scores = [float(s) for s in reward(rollout.prompts, rollout.final_turns(), rollout.metadata)]
    fixed = environment.truncated_reward if environment is not None else None
    if fixed is None:
        return scores
    return [
        fixed if (record.get(EPISODE_KEY) or {}).get("truncated") else score
        for score, record in zip(scores, rollout.metadata, strict=True)
    ]


def shaped_rewards(rewards: Tensor, rollout: Rollout, algorithm: AlgorithmSpec) -> Tensor:
    """The rewards with DAPO's overlong penalty added, when the spec asks for it."""
    shaping = algorithm.overlong_shaping
    if shaping is None:
        return rewards
    masks = rollout.action_masks  # a trajectory's length is the model's tokens
    lengths = torch.tensor([sum(m) for m in masks] if masks else list(map(len, rollout.responses)))
    penalty = overlong_penalty(
        lengths, algorithm.max_response_length, shaping.buffer_length, shaping.penalty
    )
    return rewards + penalty


class Sampler:
    """Turns the next prompts into a scored batch on the run's rollout engines."""

    def __init__(
        self,
        spec: RLHFJobSpec,
        inputs: Inputs,
        engines: Engines,
        metrics: m.TrainerMetrics,
        phase: Phase,
        reward_models: Any = None,
    ) -> None:
        self.spec = spec
        self.algorithm = spec.algorithm
        self.inputs = inputs
        self.engines = engines
        self.metrics = metrics
        self.phase = phase
        self.reward_models = reward_models
        self.data = self._iterator(DataPosition())
        self.paused_seconds = 0.0
        """Seconds generation waited on weight syncs between segments, which the token rate
        leaves out."""

    def _iterator(self, position: DataPosition) -> PromptIterator:
        return PromptIterator(
            self.inputs.prompts,
            self.algorithm.seed,
            position=position,
            shuffle=self.spec.dataset.shuffle,
        )

    def rewind(self, position: DataPosition) -> None:
        """Continue the dataset from `position` (a checkpoint's, or before a failed step)."""
        self.data = self._iterator(position)

    def sample(self, step: int, between_segments: BetweenSegments | None = None) -> SampledStep:
        """This step's rollout and its rewards (with overlong shaping, if the spec asks);
        with `between_segments`, generated in segments (partial rollouts, a batch ahead).

        With dynamic sampling (DAPO), groups whose rewards are all equal are dropped and
        further prompts sampled, at most `maxGenerationBatches` rollouts in all; groups still
        missing then are filled with dropped ones, so the batch keeps its size.
        """
        algorithm = self.algorithm
        dynamic = algorithm.dynamic_sampling
        group_size = algorithm.samples_per_prompt
        rollouts: list[Rollout] = []
        task_rewards: list[Tensor] = []
        rewards: list[Tensor] = []
        breakdowns: list[dict[str, float]] = []
        with_signal = resumed = 0
        episodes = self.inputs.episodes
        if episodes is not None and episodes.sandbox_figures is not None:
            episodes.sandbox_figures()  # the step's calls from here (not an evaluation's)
        for index in range(dynamic.max_generation_batches if dynamic else 1):
            rollout, resumed_now = self._generate(step, index, between_segments)
            resumed += resumed_now
            scored, breakdown = self._score(rollout)
            rollouts.append(rollout)
            task_rewards.append(scored)
            breakdowns.append(breakdown)
            rewards.append(shaped_rewards(scored, rollout, algorithm))
            in_segments: dict[str, float] = (
                {"resumed_responses": resumed} if between_segments else {}
            )
            if dynamic is None:
                report = in_segments | self._episode_figures(rollout)
                return SampledStep(rollout, rewards[0], scored, breakdowns[0], report)
            with_signal += int(groups_with_signal(rewards[-1], group_size).sum())
            if with_signal >= algorithm.prompts_per_step:
                break
        every_reward = torch.cat(rewards)
        signal = groups_with_signal(every_reward, group_size).tolist()
        groups, refilled = choose_groups(signal, algorithm.prompts_per_step)
        rows = torch.tensor([g * group_size + i for g in groups for i in range(group_size)])
        every = Rollout.concatenate(rollouts)
        report = {
            "generation_batches": len(rollouts),
            "dropped_groups": len(signal) - sum(signal),
            "refilled_groups": refilled,
        } | in_segments
        return SampledStep(
            every.groups(groups, group_size),
            every_reward[rows],
            torch.cat(task_rewards),
            {name: sum(b[name] for b in breakdowns) / len(breakdowns) for name in breakdowns[0]},
            report | self._episode_figures(every),
        )

    def _episode_figures(self, rollout: Rollout) -> dict[str, float]:
        """The step's `env_*` figures: its trajectories', and the sandbox client's."""
        episodes = self.inputs.episodes
        if episodes is None:
            return {}
        sandbox = episodes.sandbox_figures() if episodes.sandbox_figures is not None else {}
        return episode_figures(rollout.metadata) | sandbox

    def _score(self, rollout: Rollout) -> tuple[Tensor, dict[str, float]]:
        """The reward function's score of each response, and each part's mean."""
        with self.phase(m.PHASE_REWARD):
            if self.reward_models is not None:
                self.reward_models.maintain()  # replacements rejoin, without waiting
            scored = torch.tensor(score_rollout(self.inputs.reward, rollout, self.spec.environment))
        return scored, dict(self.inputs.reward.last_breakdown)

    def sampling_params(self, step: int, batch: int = 0) -> SamplingParams:
        """How to sample step `step`'s prompts: as often as the algorithm asks (`groupSize`,
        ppo once), seeded by step and, with dynamic sampling, rollout `batch`."""
        algorithm = self.algorithm
        return SamplingParams(
            n=algorithm.samples_per_prompt,
            temperature=algorithm.temperature,
            top_p=algorithm.top_p,
            max_tokens=algorithm.max_response_length,
            seed=generation_seed(algorithm.seed, step, batch),
            stop_token_ids=self.inputs.stop_token_ids,
            # On-policy the ranks' log-probs before the update are the behaviour's; a stale
            # sample's behaviour was the engine's, one update or more before.
            logprobs=algorithm.max_staleness > 0,
        )

    def complete(self, items: list[PromptItem], sampling: SamplingParams) -> Rollout:
        """`items`' responses as the engines generate them, cut at stop strings."""
        return self._complete(items, sampling, None)[0]

    def _complete(
        self,
        items: list[PromptItem],
        sampling: SamplingParams,
        between_segments: BetweenSegments | None,
    ) -> tuple[Rollout, int]:
        if self.inputs.episodes is not None:  # multi-turn (spec.environment), on-policy
            return self.inputs.episodes.run(self.engines.generate, items, sampling), 0
        algorithm = self.algorithm
        prompts = [item.prompt for item in items]
        resumed = 0
        if between_segments is not None:
            segmented = generate_in_segments(
                self.engines.generate,
                prompts,
                sampling,
                algorithm.partial_rollout_tokens,
                between_segments,
            )
            completions, resumed = segmented.completions, segmented.resumed
        else:
            completions = self.engines.generate(prompts, sampling)
        if algorithm.stop_strings:  # cut after the token that completes a stop string
            assert self.inputs.decode is not None  # start-up refuses stop strings without
            completions = [
                truncate_completions(group, self.inputs.decode, algorithm.stop_strings)
                for group in completions
            ]
        return flatten_completions(items, completions), resumed

    def _generate(
        self, step: int, batch: int, between_segments: BetweenSegments | None
    ) -> tuple[Rollout, int]:
        """The next `promptsPerStep` prompts' responses, and how many resumed under newer
        weights (partial rollouts)."""
        items = self.data.next_batch(self.algorithm.prompts_per_step)  # fitted at load
        sampling = self.sampling_params(step, batch)
        with self.phase(m.PHASE_GENERATE):
            started, paused_before = time.perf_counter(), self.paused_seconds
            rollout, resumed = self._complete(items, sampling, between_segments)
        seconds = time.perf_counter() - started - (self.paused_seconds - paused_before)
        self.metrics.record_generation(rollout.num_generated_tokens, seconds)
        self.metrics.record_episodes([r[EPISODE_KEY] for r in rollout.metadata if EPISODE_KEY in r])
        return rollout, resumed
