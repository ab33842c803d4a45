"""Partial rollouts: a batch decoded in segments, so new weights can reach the engines between
them (`algorithm.partialRolloutTokens`).

The batch generated ahead (`algorithm.maxStaleness`) would otherwise finish under the weights
it started with, and the step's weight sync would wait for its slowest response. Decoding it in
segments of a few tokens gives the driver a boundary to sync at soon after the update is done;
responses still open then resume, prompt plus their tokens so far, under the new weights, each
token keeping the log-prob of the weights that sampled it (what the decoupled objective's
behaviour weights need). Engines need no support for interrupting a request: a segment is an
ordinary `generate` call, so the vLLM and the transformers engines both do it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from rlhf_trainer.rollout.base import Completion, SamplingParams
from rlhf_trainer.seeds import segment_seed

Generate = Callable[[list[list[int]], SamplingParams], list[list[Completion]]]


@dataclass(frozen=True)
class SegmentedRollout:
    completions: list[list[Completion]]
    """`sampling.n` completions per prompt, in prompt order, as `generate` returns them; each
    carries the oldest policy version that sampled any of its tokens."""
    resumed: int
    """Responses that resumed under newer weights than they started with."""


def generate_in_segments(
    generate: Generate,
    prompts: list[list[int]],
    sampling: SamplingParams,
    segment_tokens: int,
    weights_updated: Callable[[], bool],
) -> SegmentedRollout:
    """Decode `prompts` as `generate` would, `segment_tokens` at a time, asking
    `weights_updated` at every boundary where a response is still open; once it answers True
    (it syncs the engines itself) the open responses finish in one more call.

    A response is open while it has used every token of each segment and its last token is no
    stop token. Segments after the first are seeded from the call's seed and their index, so
    the split is reproducible given where the update landed.
    """
    if segment_tokens < 1:
        raise ValueError("segment_tokens must be at least 1")
    stops = set(sampling.stop_token_ids)
    budget = sampling.max_tokens
    done = min(segment_tokens, budget)
    groups = [list(group) for group in generate(prompts, replace(sampling, max_tokens=done))]
    resumed: set[tuple[int, int]] = set()
    segment = 0
    while done < budget:
        open_rows = [
            (i, j)
            for i, group in enumerate(groups)
            for j, completion in enumerate(group)
            if len(completion.token_ids) == done and completion.token_ids[-1] not in stops
        ]
        if not open_rows:
            break
        length = budget - done if weights_updated() else min(segment_tokens, budget - done)
        segment += 1
        continued = generate(
            [prompts[i] + groups[i][j].token_ids for i, j in open_rows],
            replace(
                sampling,
                n=1,
                max_tokens=length,
                seed=None if sampling.seed is None else segment_seed(sampling.seed, segment),
            ),
        )
        for (i, j), (more,) in zip(open_rows, continued, strict=True):
            before = groups[i][j]
            if more.policy_version != before.policy_version:
                resumed.add((i, j))
            groups[i][j] = Completion(
                token_ids=before.token_ids + more.token_ids,
                logprobs=before.logprobs + more.logprobs,
                policy_version=min(before.policy_version, more.policy_version),
            )
        done += length
    return SegmentedRollout(groups, len(resumed))
