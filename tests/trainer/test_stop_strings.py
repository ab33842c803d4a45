"""Stop strings (`algorithm.stopStrings`) cut a response after the token that completes the
first occurrence, on the tiny byte-level tokenizer (no downloads)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers")

from rlhf_local.tiny_models import save_tiny_tokenizer
from rlhf_trainer.data.tokenizer import (
    check_stop_strings,
    decoder,
    truncate_at_stop_strings,
)
from rlhf_trainer.rollout.base import (
    Completion,
    truncate_completions,
)
from rlhfjob.config import load_job

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-tiny-cpu.yaml"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def decode(tokenizer: Any) -> Any:
    return decoder(tokenizer)


def pieces(tokenizer: Any, token_ids: list[int]) -> list[str]:
    return [tokenizer.decode([token]) for token in token_ids]


def test_a_stop_string_spanning_two_tokens_ends_the_response_at_the_second(
    tokenizer: Any, decode: Any
) -> None:
    response = tokenizer.encode("the answer is 4")
    assert pieces(tokenizer, response) == ["the", " answer", " is", " 4"]
    assert truncate_at_stop_strings(response, decode, ["answer is"]) == 3
    assert truncate_at_stop_strings(response, decode, ["er i"]) == 3  # parts of both tokens
    assert truncate_at_stop_strings(response, decode, ["the"]) == 1
    assert truncate_at_stop_strings(response, decode, ["4"]) == 4


def test_the_first_of_several_occurrences_wins(tokenizer: Any, decode: Any) -> None:
    response = tokenizer.encode("hello world. the answer is 4. the answer is 5")
    kept = truncate_at_stop_strings(response, decode, ["answer"])
    assert decode(response[:kept]) == "hello world. the answer"


def test_the_earliest_of_several_stop_strings_wins(tokenizer: Any, decode: Any) -> None:
    response = tokenizer.encode("hello world. the answer is 4. the answer is 5")
    kept = truncate_at_stop_strings(response, decode, ["is 5", "answer", "world."])
    assert decode(response[:kept]) == "hello world."


def test_without_an_occurrence_everything_is_kept(tokenizer: Any, decode: Any) -> None:
    response = tokenizer.encode("the answer is 4")
    assert truncate_at_stop_strings(response, decode, ["5", "answers"]) == len(response)
    assert truncate_at_stop_strings(response, decode, []) == len(response)
    assert truncate_at_stop_strings([], decode, ["4"]) == 0


def test_an_empty_stop_string_is_refused(decode: Any) -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        truncate_at_stop_strings([5], decode, ["x", ""])


def test_completions_have_token_ids_and_logprobs_truncated_alike(
    tokenizer: Any, decode: Any
) -> None:
    cut = tokenizer.encode("the answer is 4")
    whole = tokenizer.encode("hello world")
    completions = [
        Completion(token_ids=cut, logprobs=[-0.1, -0.2, -0.3, -0.4], policy_version=3),
        Completion(token_ids=whole, logprobs=[-1.0] * len(whole), policy_version=3),
        Completion(token_ids=cut, logprobs=[], policy_version=2),  # the engine reported none
    ]
    truncated = truncate_completions(completions, decode, ["answer"])
    assert truncated == [
        Completion(token_ids=cut[:2], logprobs=[-0.1, -0.2], policy_version=3),
        completions[1],
        Completion(token_ids=cut[:2], logprobs=[], policy_version=2),
    ]
    assert truncated[1] is completions[1]
    assert completions[0].token_ids == cut  # the engine's completions are left as they were
    assert truncate_completions(completions, decode, []) == completions


def test_only_the_response_is_searched_not_the_prompt(tokenizer: Any, decode: Any) -> None:
    prompt = tokenizer.encode("what is two plus two the answer")
    response = tokenizer.encode(" is 4")
    assert "answer is" in decode(prompt + response)  # it starts in the prompt
    assert truncate_at_stop_strings(response, decode, ["answer is", "two"]) == len(response)
    completion = Completion(token_ids=response, logprobs=[], policy_version=0)
    assert truncate_completions([completion], decode, ["two"]) == [completion]


def test_byte_level_tokens_with_part_of_a_character_do_not_crash(
    tokenizer: Any, decode: Any
) -> None:
    response = tokenizer.encode("€ x")
    assert len(tokenizer.encode("€")) == 3  # three bytes, a token each
    assert decode(response[:1]) == "\ufffd"
    assert truncate_at_stop_strings(response, decode, ["€"]) == 3  # completed by the third
    assert truncate_at_stop_strings(response, decode, ["x"]) == len(response)
    assert truncate_at_stop_strings(response[:2], decode, ["x", "€"]) == 2  # ends mid-character
    assert truncate_at_stop_strings(tokenizer.encode("a€b"), decode, ["€b"]) == 5


def test_special_tokens_are_left_out_of_the_text(tokenizer: Any, decode: Any) -> None:
    response = [*tokenizer.encode("the"), tokenizer.eos_token_id, *tokenizer.encode(" answer")]
    assert truncate_at_stop_strings(response, decode, ["the answer"]) == 3
    assert truncate_at_stop_strings(response, decode, ["eos"]) == 3


def test_agrees_with_a_token_by_token_search(tokenizer: Any, decode: Any) -> None:
    rng = random.Random(0)
    vocabulary = list(range(3, len(tokenizer)))
    stops = ["is", " 4", "e t", "{", "€", "é!"]
    for _ in range(200):
        response = [rng.choice(vocabulary) for _ in range(rng.randint(0, 40))]
        chosen = rng.sample(stops, rng.randint(1, 3))
        expected = next(
            (
                k
                for k in range(1, len(response) + 1)
                if any(s in decode(response[:k]) for s in chosen)
            ),
            len(response),
        )
        assert truncate_at_stop_strings(response, decode, chosen) == expected


def test_a_512_token_response_takes_about_log2_decodes(tokenizer: Any, decode: Any) -> None:
    response = tokenizer.encode("a b c d e " * 103)[:511] + tokenizer.encode("4")
    assert len(response) == 512
    calls: list[int] = []

    def counting(token_ids: list[int]) -> str:
        calls.append(len(token_ids))
        return str(decode(token_ids))

    assert truncate_at_stop_strings(response, counting, ["4"]) == 512
    assert len(calls) <= 1 + 9 + 1
    calls.clear()
    assert truncate_at_stop_strings(response, counting, ["x"]) == 512
    assert len(calls) == 1


def spec_with(**algorithm: Any) -> Any:
    spec = load_job(EXAMPLE).spec
    return spec.model_copy(update={"algorithm": spec.algorithm.model_copy(update=algorithm)})


def test_stop_strings_need_a_tokenizer(tokenizer: Any) -> None:
    with pytest.raises(
        ValueError, match=r"algorithm.stopStrings needs a tokenizer \(spec.model.tokenizer\)"
    ):
        check_stop_strings(spec_with(stop_strings=["</answer>"]), None)
    check_stop_strings(spec_with(stop_strings=["</answer>"]), tokenizer)
    check_stop_strings(spec_with(stop_strings=[]), None)
