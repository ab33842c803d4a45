"""Synthetic tasks for CPU learning tests: random token prompts and a known-maximum rule reward.

They exist so that a tiny randomly initialised causal LM (vocabulary 16, hidden size 32-64, two
layers) shows a clear learning curve in a few dozen GRPO or PPO steps on a laptop CPU, with no
tokenizer and no downloads. Measured with a 2-layer Llama (hidden 32, vocabulary 16), Adam at
3e-3, 16 prompts x 8 samples, 8 new tokens: ``target_token`` goes from 0.07 to 0.95 mean
reward in 30 GRPO steps, ``copy_first`` from 0.06 to 0.96 in 60. Rewards are fractions in
[0, 1], so ``max_reward`` is 1.0 and chance level is about ``1 / vocab_size``.

Token id 0 never appears in prompts (engines may use it for padding or BOS). A task's
``reward_function`` string (e.g. ``"rlhf_trainer.data.tasks:target_token_reward"``) goes wherever a
``module:function`` reward is configured; ``synthetic:<name>`` names its prompt source in
:mod:`rlhf_trainer.data.prompts`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TARGET_TOKEN = 1
"""The token ``target_token_reward`` pays for."""

PAD_TOKEN = 0
"""Reserved: never used in prompts."""


def _fraction(matches: int, length: int) -> float:
    return matches / length if length else 0.0


def target_token_reward(
    prompts: list[list[int]], responses: list[list[int]], metadata: list[dict[str, Any]]
) -> list[float]:
    """Fraction of response tokens equal to :data:`TARGET_TOKEN`; an empty response scores 0."""
    del prompts, metadata  # the target does not depend on the prompt
    return [_fraction(sum(t == TARGET_TOKEN for t in r), len(r)) for r in responses]


def copy_first_token_reward(
    prompts: list[list[int]], responses: list[list[int]], metadata: list[dict[str, Any]]
) -> list[float]:
    """Fraction of response tokens equal to the prompt's first token; an empty response scores 0.

    Harder than :func:`target_token_reward`: the policy must attend back to the prompt.
    """
    del metadata
    return [
        _fraction(sum(t == prompt[0] for t in response), len(response)) if prompt else 0.0
        for prompt, response in zip(prompts, responses, strict=True)
    ]


def even_token_reward(
    prompts: list[list[int]], responses: list[list[int]], metadata: list[dict[str, Any]]
) -> list[float]:
    """Fraction of response tokens with an even id; an empty response scores 0.

    Chance is 1/2 for any vocabulary, so a randomly initialised model of a real vocabulary
    (Qwen2's 151,936 tokens) gets a dense signal from its first step, where a single target
    token would be hit once in 150k samples.
    """
    del prompts, metadata
    return [_fraction(sum(t % 2 == 0 for t in r), len(r)) for r in responses]


@dataclass(frozen=True)
class SyntheticTask:
    """A prompt generator plus the rule reward that scores responses to its prompts."""

    name: str
    description: str
    vocab_size: int
    """Smallest vocabulary a model needs for this task's prompts and answers."""
    prompt_length: int
    response_length: int
    """Suggested number of new tokens to generate (the reward is a fraction of whatever length)."""
    reward_function: str
    """``module:function`` spec of the reward (load it with ``rewards.load_reward_function``)."""
    max_reward: float
    reward: Callable[[list[list[int]], list[list[int]], list[dict[str, Any]]], list[float]]
    """The reward function itself, for callers that do not go through the spec."""
    first_token_choices: int | None = None
    """If set, the first prompt token is drawn from ``[1, 1 + first_token_choices)`` only."""

    def make_prompts(self, count: int, seed: int) -> list[list[int]]:
        """``count`` prompts of random tokens in ``[1, vocab_size)``; the same for the same seed."""
        rng = random.Random(f"rlhf-task:{self.name}:{seed}")
        first_limit = 1 + (self.first_token_choices or self.vocab_size - 1)
        return [
            [rng.randrange(1, first_limit)]
            + [rng.randrange(1, self.vocab_size) for _ in range(self.prompt_length - 1)]
            for _ in range(count)
        ]


TASKS: dict[str, SyntheticTask] = {
    task.name: task
    for task in (
        SyntheticTask(
            name="target_token",
            description=f"answer every prompt with token {TARGET_TOKEN} repeated",
            vocab_size=16,
            prompt_length=4,
            response_length=8,
            reward_function=f"{__name__}:target_token_reward",
            max_reward=1.0,
            reward=target_token_reward,
        ),
        SyntheticTask(
            name="copy_first",
            description="answer with the first prompt token (one of 1-4) repeated",
            vocab_size=16,
            prompt_length=4,
            response_length=8,
            reward_function=f"{__name__}:copy_first_token_reward",
            max_reward=1.0,
            reward=copy_first_token_reward,
            # Four possible answers keep it learnable in ~50 GRPO steps on a CPU; with all 15
            # the same model barely moves in 60 steps.
            first_token_choices=4,
        ),
        SyntheticTask(
            name="even_tokens",
            description="answer with even token ids only (chance 1/2 at any vocabulary size)",
            vocab_size=16,
            prompt_length=4,
            response_length=16,
            reward_function=f"{__name__}:even_token_reward",
            max_reward=1.0,
            reward=even_token_reward,
        ),
    )
}


def get_task(name: str) -> SyntheticTask:
    """The task called ``name``; raises ``ValueError`` listing the known names otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        known = ", ".join(sorted(TASKS))
        raise ValueError(f"unknown synthetic task {name!r}; known tasks: {known}") from None
