"""Text in, text rewards out, on a tiny tokenizer trained here (no downloads).

The tokenizer is a byte-level BPE with an end-of-sequence token and a chat template, saved as a
Hugging Face directory, so every path a real `model.tokenizer: /models/...` takes runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers")

from rlhf_local.tiny_models import save_tiny_tokenizer
from rlhf_trainer.data.prompts import PromptItem, fit_prompts, load_jsonl_prompts
from rlhf_trainer.data.tokenizer import decoder, load_tokenizer, stop_token_ids
from rlhf_trainer.rewards import text as text_rewards
from rlhf_trainer.rewards.functions import RewardFunctionError, RuleReward, keyword_parameters
from rlhf_trainer.run.startup import NonRetryableError, load_inputs
from rlhfjob.config import load_job

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-tiny-cpu.yaml"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def job_spec(**updates: Any) -> Any:
    """The tiny CPU example with `updates` merged into its sections (model, dataset, ...)."""
    spec = load_job(EXAMPLE).spec
    sections = {
        name: getattr(spec, name).model_copy(update=fields) for name, fields in updates.items()
    }
    return spec.model_copy(update=sections)


# ---------------------------------------------------------------------------------- prompts


def test_text_prompts_are_encoded_with_the_tokenizer(tmp_path: Path, tokenizer: Any) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "hello world", "answer": "x"}])
    [item] = load_jsonl_prompts(path, "question", tokenizer)
    assert item.prompt == tokenizer.encode("hello world")
    assert item.metadata == {"answer": "x"}


def test_chat_messages_get_the_chat_template_and_its_generation_prompt(
    tmp_path: Path, tokenizer: Any
) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": messages}])
    [item] = load_jsonl_prompts(path, "prompt", tokenizer)
    assert tokenizer.decode(item.prompt) == "<|system|>be brief<|user|>hi<|assistant|>"


def test_chat_messages_are_refused_without_the_template_or_a_tokenizer(
    tmp_path: Path, tokenizer: Any
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"d.jsonl:1: .*dataset.chatTemplate is off"):
        load_jsonl_prompts(path, "prompt", tokenizer, chat_template=False)
    with pytest.raises(ValueError, match=r"d.jsonl:1: .*no tokenizer was given"):
        load_jsonl_prompts(path, "prompt", None)


def test_overlong_prompts_are_truncated_to_their_end_or_skipped_and_counted() -> None:
    items = [PromptItem([1, 2]), PromptItem([1, 2, 3, 4, 5]), PromptItem([7, 8, 9])]
    truncated, counts = fit_prompts(items, 3, "truncate")
    assert [item.prompt for item in truncated] == [[1, 2], [3, 4, 5], [7, 8, 9]]
    assert (counts.kept, counts.truncated, counts.skipped) == (2, 1, 0)
    skipped, counts = fit_prompts(items, 3, "skip")
    assert [item.prompt for item in skipped] == [[1, 2], [7, 8, 9]]
    assert (counts.kept, counts.truncated, counts.skipped) == (2, 0, 1)
    with pytest.raises(ValueError, match="every one of the 3 prompts is longer"):
        fit_prompts(items, 1, "skip")


# -------------------------------------------------------------------------- the tokenizer


def test_the_tokenizer_comes_from_the_named_directory_or_the_policys(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    assert load_tokenizer(job_spec()) is None  # randomInit, none named: token ids only
    named = load_tokenizer(job_spec(model={"tokenizer": str(tokenizer_dir)}))
    assert named is not None and named.eos_token_id is not None
    policy = job_spec(model={"random_init": None, "policy": str(tokenizer_dir)})
    assert load_tokenizer(policy) is not None  # the policy's directory holds one
    weights_only = job_spec(model={"random_init": None, "policy": str(tmp_path)})
    assert load_tokenizer(weights_only) is None
    with pytest.raises(ValueError, match=r"spec.model.tokenizer .*"):
        load_tokenizer(job_spec(model={"tokenizer": str(tmp_path / "missing")}))


def test_responses_stop_at_eos_and_the_extra_stop_tokens(tmp_path: Path, tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    assert stop_token_ids(job_spec(algorithm={"stop_token_ids": [5]}), tokenizer) == tuple(
        sorted({eos, 5})
    )
    off = job_spec(algorithm={"stop_at_eos": False, "stop_token_ids": [5]})
    assert stop_token_ids(off, tokenizer) == (5,)
    assert stop_token_ids(job_spec(), None) == ()  # no tokenizer: no EOS to stop at
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 9]}))
    chat_model = job_spec(model={"random_init": None, "policy": str(tmp_path)})
    assert stop_token_ids(chat_model, tokenizer) == tuple(sorted({eos, 9}))


# ----------------------------------------------------------------------------- text rewards


def test_a_reward_that_declares_texts_gets_the_decoded_texts(tokenizer: Any) -> None:
    seen: dict[str, Any] = {}

    def spy(prompt_texts: list[str], response_texts: list[str], responses: list[list[int]]):  # type: ignore[no-untyped-def]
        seen.update(prompt_texts=prompt_texts, response_texts=response_texts, responses=responses)
        return [1.0] * len(responses)

    reward = RuleReward(
        spec="x:spy",
        function=spy,
        keywords=keyword_parameters("x:spy", spy),
        decode=decoder(tokenizer),
    )
    prompt = tokenizer.encode("what is two plus two")
    response = [*tokenizer.encode("the answer is 4"), tokenizer.eos_token_id]
    assert reward([prompt], [response], [{}]) == [1.0]
    assert seen == {
        "prompt_texts": ["what is two plus two"],
        "response_texts": ["the answer is 4"],  # the EOS is a special token: left out
        "responses": [response],
    }


def test_text_rewards_need_a_tokenizer_and_known_parameters() -> None:
    with pytest.raises(RewardFunctionError, match="takes text, which needs a tokenizer"):
        RuleReward.from_spec("rlhf_trainer.rewards.text:exact_answer", None)

    def unknown(response_texts: list[str], weights: list[float]) -> list[float]:
        return weights

    with pytest.raises(RewardFunctionError, match="parameter 'weights' is not one"):
        keyword_parameters("x:unknown", unknown)
    # The positional form (any names) is unchanged.
    assert keyword_parameters("x:f", lambda p, r, m: [0.0] * len(r)) is None


@pytest.mark.parametrize(
    ("text", "answer", "reward"),
    [
        ("so \\boxed{42}", "42", 1.0),
        ("first \\boxed{1} then \\boxed{ 42. }", "42", 1.0),  # the last box counts
        ("The answer is 1,000.", "1000", 1.0),
        ("we get 3 then 7", "7", 1.0),  # no box, no 'answer': the last number
        ("the answer is 8", "7", 0.0),
        ("no idea", "7", 0.0),
    ],
)
def test_exact_answer(text: str, answer: str, reward: float) -> None:
    assert text_rewards.exact_answer([text], [{"answer": answer}]) == [reward]


def test_exact_answer_without_an_expected_answer_and_the_format_reward() -> None:
    assert text_rewards.exact_answer(["\\boxed{1}"], [{}]) == [0.0]
    assert text_rewards.boxed_format(["\\boxed{1}", "1"]) == [1.0, 0.0]


# ----------------------------------------------------------------------- a run's inputs


def test_a_text_dataset_with_a_text_reward_loads_at_start(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    data = write_jsonl(
        tmp_path / "math.jsonl",
        [
            {"question": "what is two plus two", "answer": "4"},
            {"question": [{"role": "user", "content": "hello world"}], "answer": "x"},
            {"question": "a b c d e " * 20, "answer": "y"},  # longer than maxPromptLength
        ],
    )
    spec = job_spec(
        model={"tokenizer": str(tokenizer_dir)},
        dataset={"source": str(data), "prompt_field": "question", "overlong_prompts": "skip"},
        reward={"function": "rlhf_trainer.rewards.text:exact_answer"},
        algorithm={"max_prompt_length": 24},
    )
    logged: list[str] = []
    inputs = load_inputs(spec, check_model=False, log=logged.append)
    assert len(inputs.prompts) == 2 and inputs.prompt_counts is not None
    assert inputs.prompt_counts.skipped == 1
    assert logged == ["1 of 3 prompts are longer than maxPromptLength (24): 1 skipped"]
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    assert inputs.stop_token_ids == (eos,)
    right = AutoTokenizer.from_pretrained(tokenizer_dir).encode("\\boxed{4}")
    assert inputs.reward([inputs.prompts[0].prompt], [right], [inputs.prompts[0].metadata]) == [1.0]


def test_a_text_dataset_without_a_tokenizer_fails_at_start_naming_the_field(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hello"}])
    with pytest.raises(NonRetryableError, match=r"spec\.model\.tokenizer"):
        load_inputs(job_spec(dataset={"source": str(data)}), check_model=False)


def test_stop_strings_need_a_tokenizer_and_reach_the_loop_with_its_decoder(
    tokenizer_dir: Path,
) -> None:
    spec = job_spec(algorithm={"stop_strings": ["</answer>"]})
    with pytest.raises(NonRetryableError, match=r"algorithm\.stopStrings needs a tokenizer"):
        load_inputs(spec, check_model=False)
    with_tokenizer = job_spec(
        algorithm={"stop_strings": ["</answer>"]}, model={"tokenizer": str(tokenizer_dir)}
    )
    inputs = load_inputs(with_tokenizer, check_model=False)
    assert inputs.decode is not None and inputs.decode([]) == ""


def test_a_reward_model_or_remote_reward_without_a_tokenizer_fails_at_start() -> None:
    model = job_spec(reward={"type": "model", "function": None})
    with pytest.raises(NonRetryableError, match="needs a tokenizer"):
        load_inputs(model, check_model=False)
    remote = job_spec(
        reward={"type": "remote", "function": None, "remote": {"url": "http://rm:8000/score"}}
    )
    with pytest.raises(NonRetryableError, match=r"spec\.model\.tokenizer"):
        load_inputs(remote, check_model=False)
