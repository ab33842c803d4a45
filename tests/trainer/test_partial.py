"""Partial rollouts (`rlhf_trainer.rollout.partial`) on a real transformers engine: responses
decoded in segments, new weights loaded at a boundary, the open responses resumed under them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlhf_trainer.modeling.logprobs import logprobs_from_logits
from rlhf_trainer.rollout.base import Completion, SamplingParams
from rlhf_trainer.rollout.engines import HFEngine
from rlhf_trainer.rollout.model_source import ModelSource
from rlhf_trainer.rollout.partial import generate_in_segments

TINY = {
    "model_type": "qwen2",
    "vocab_size": 32,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


def logprobs_under(engine: HFEngine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Each of `tokens`' log-probs after `prompt` under the engine's current weights."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0]
    return logprobs_from_logits(logits[len(prompt) - 1 : -1], ids[0, len(prompt) :], 1.0)


Generate = Callable[[list[list[int]], SamplingParams], list[list[Completion]]]


def counting(engine: HFEngine, calls: list[SamplingParams], rows: list[int]) -> Generate:
    """The engine's generate, recording each call's sampling and prompts (the engine is real)."""

    def generate(prompts: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        calls.append(sampling)
        rows.append(len(prompts))
        return engine.generate(prompts, sampling)

    return generate


def test_open_responses_resume_under_the_weights_loaded_at_a_boundary() -> None:
    engine = HFEngine(ModelSource(config=TINY, seed=1))
    newer = HFEngine(ModelSource(config=TINY, seed=2)).named_parameters()
    older = {name: tensor.clone() for name, tensor in engine.named_parameters().items()}
    boundaries = 0

    def update_after_two_segments() -> bool:
        nonlocal boundaries
        boundaries += 1
        if boundaries == 2:
            engine.load_weights(newer.items(), version=1)
        return boundaries >= 2

    calls: list[SamplingParams] = []
    sampling = SamplingParams(n=2, max_tokens=12, seed=7)
    result = generate_in_segments(
        counting(engine, calls, []), PROMPTS, sampling, 3, update_after_two_segments
    )

    # Segments of 3, 3, then the remaining 6 in one call once the update was synced.
    assert [call.max_tokens for call in calls] == [3, 3, 6]
    assert [call.n for call in calls] == [2, 1, 1]
    assert len({call.seed for call in calls}) == 3
    assert result.resumed == len(PROMPTS) * 2
    fresh = HFEngine(ModelSource(config=TINY, seed=1))
    fresh.load_weights(older.items(), version=0)
    for prompt, group in zip(PROMPTS, result.completions, strict=True):
        assert len(group) == 2
        for completion in group:
            assert len(completion.token_ids) == len(completion.logprobs) == 12
            assert completion.policy_version == 0  # as old as its first token
            # The first six tokens were sampled by the old weights, the rest by the new ones:
            # each keeps the log-prob of the weights that sampled it.
            old_part = logprobs_under(fresh, prompt, completion.token_ids)[:6]
            new_part = logprobs_under(engine, prompt, completion.token_ids)[6:]
            torch.testing.assert_close(
                torch.tensor(completion.logprobs),
                torch.cat([old_part, new_part]),
                atol=1e-4,
                rtol=1e-4,
            )


def test_finished_responses_are_not_resumed_and_without_an_update_segments_continue() -> None:
    engine = HFEngine(ModelSource(config=TINY, seed=3))
    whole = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=10, seed=5))
    stop = whole[0][0].token_ids[1]  # stops some responses in the first segment
    calls: list[SamplingParams] = []
    sampling = SamplingParams(n=2, max_tokens=10, seed=5, stop_token_ids=(stop,))
    rows: list[int] = []
    result = generate_in_segments(
        counting(engine, calls, rows), PROMPTS, sampling, 4, lambda: False
    )

    assert [call.max_tokens for call in calls] == [4, 4, 2]
    # Only the responses still open after a segment go on: all six, then those not stopped.
    open_after_first = sum(
        len(c.token_ids) >= 4 and stop not in c.token_ids[:4] for g in whole for c in g
    )
    assert rows[:2] == [len(PROMPTS), open_after_first]
    assert open_after_first < 2 * len(PROMPTS)
    assert result.resumed == 0
    assert result.completions[0][0].token_ids[-1] == stop
    assert len(result.completions[0][0].token_ids) == 2
    for group in result.completions:
        for completion in group:
            ids = completion.token_ids
            assert len(ids) == len(completion.logprobs) <= 10
            assert stop not in ids[:-1]  # nothing after a stop token
            assert ids[-1] == stop or len(ids) == 10


def test_a_segment_as_long_as_the_response_is_one_call() -> None:
    engine = HFEngine(ModelSource(config=TINY, seed=4))
    calls: list[SamplingParams] = []
    sampling = SamplingParams(n=2, max_tokens=5, seed=9)
    result = generate_in_segments(counting(engine, calls, []), PROMPTS, sampling, 8, lambda: True)
    assert len(calls) == 1 and calls[0].max_tokens == 5
    assert result.completions == engine.generate(PROMPTS, sampling)
