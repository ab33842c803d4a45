"""The rollout interface every engine implements (design decision 8).

The driver talks to rollout engines only through `RolloutEngine`: generate token ids with their
log-probs, and take new weights. The vLLM backend (GPU) and the transformers backend (CPU, tests)
both implement it, each usually wrapped in a Ray actor on the rollout pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rlhf_trainer.data.tokenizer import truncate_at_stop_strings
from rlhf_trainer.seeds import derive_seed


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: `n` responses per prompt, at most `max_tokens` tokens each."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    """Seeds the engine's sampler for this call, so a resumed run samples the same tokens."""
    prompt_seeds: tuple[int, ...] = ()
    """One seed per prompt instead (multi-turn rollouts): a prompt's samples then depend on
    its own seed, not on which other prompts share the call (`prompt_sample_seed`). Engines
    split over the call slice them with the prompts (`for_prompts`)."""
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = True
    """Whether the engine reports each token's log-prob. The trainer recomputes the behaviour
    log-probs itself, so it asks for none: vLLM's full-vocabulary log-softmax per generated
    token costs about 40 % of its throughput."""

    def for_prompts(self, start: int, stop: int, seed: int | None) -> SamplingParams:
        """This sampling for prompts ``[start, stop)`` of the call, with the call seed `seed`."""
        seeds = self.prompt_seeds[start:stop] if self.prompt_seeds else ()
        return dataclasses.replace(self, seed=seed, prompt_seeds=seeds)


def prompt_sample_seed(prompt_seed: int, sample: int) -> int:
    """The seed of sample `sample` (of `n`) of a prompt seeded with `prompt_seed`."""
    return derive_seed(prompt_seed, sample)


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


class WeightSource(Protocol):
    """Who sends the weights a sync pushes: the policy's ZeRO ranks (`rlhf_trainer.ranks`),
    rank 0 leading the sync group. Rollout asks this seam, not the worker group, so that it
    stays below the ranks that build on it."""

    actors: list[Any]
    """The ranks' actor handles, rank 0 first."""

    def submit(self, method: str, *args: Any) -> list[Any]:
        """Start `method(*args)` on every rank; the Ray object refs in rank order."""
        ...


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


def truncate_completions(
    completions: Sequence[Completion],
    decode: Callable[[list[int]], str],
    stop_strings: Sequence[str],
) -> list[Completion]:
    """`completions` each cut by `truncate_at_stop_strings`: new Completions whose `token_ids`,
    and `logprobs` when the engine reported them, stop with the token that completes the first
    stop string. A completion without one is returned as it is."""
    if not stop_strings:
        return list(completions)
    truncated = []
    for completion in completions:
        kept = truncate_at_stop_strings(completion.token_ids, decode, stop_strings)
        if kept == len(completion.token_ids):
            truncated.append(completion)
        else:
            truncated.append(
                dataclasses.replace(
                    completion,
                    token_ids=completion.token_ids[:kept],
                    logprobs=completion.logprobs[:kept],
                )
            )
    return truncated
