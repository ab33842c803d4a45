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


GENERATE_TIMEOUT_S = 1800.0
"""Bound on one step's generation as seen by the driver."""
CALL_TIMEOUT_S = 900.0
"""Bound on a whole weight sync (or a sync-group build) as seen by the driver."""


@dataclass
class SyncResult:
    """One weight update reaching the engines: the policy version, how long, how many bytes."""

    version: int
    seconds: float
    bytes: int


class Rollout(Protocol):
    """The driver's rollout, whichever the placement: `fleet.RolloutFleet` (engine actors on
    their own pool) or `colocated.ColocatedRollout` (an engine inside each policy rank)."""

    desired: int
    """Engines a step's prompts are split over (chunk ``i`` is seeded from ``i``)."""
    minimum: int

    def maintain(self) -> None:
        """At the start of a step: admit engines that came back, start missing ones."""
        ...

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        """`sampling.n` completions for each prompt, in prompt order."""
        ...

    def sync(self, version: int) -> SyncResult:
        """Give every live engine the policy's current weights as `version`."""
        ...

    def shutdown(self) -> None: ...
