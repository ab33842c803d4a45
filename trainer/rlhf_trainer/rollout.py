"""The rollout interface every engine implements (design decision 8).

The driver talks to rollout engines only through `RolloutEngine`: generate token ids with their
log-probs, and take new weights. The vLLM backend (GPU) and the transformers backend (CPU, tests)
both implement it, each usually wrapped in a Ray actor on the rollout pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: `n` responses per prompt, at most `max_tokens` tokens each."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    """Seeds the engine's sampler for this call, so a resumed run samples the same tokens."""
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = True
    """Whether the engine reports each token's log-prob. The trainer recomputes the behaviour
    log-probs itself, so it asks for none: vLLM's full-vocabulary log-softmax per generated
    token costs about 40 % of its throughput."""


@dataclass(frozen=True)
class Completion:
    """One sampled response: its token ids and the engine's log-prob of each token (empty when
    the sampling asked for none)."""

    token_ids: list[int]
    logprobs: list[float]
    policy_version: int
    """The weight version that generated it (the driver measures version lag with it)."""


class RolloutEngine(Protocol):
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        """`sampling.n` completions for each prompt, in prompt order."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace parameters by name (Hugging Face names) and adopt `version`."""
        ...

    def policy_version(self) -> int: ...
