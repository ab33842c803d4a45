"""Prompt datasets load strictly, shuffle deterministically and resume at the exact prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlhf_trainer.data.prompts import (
    DataPosition,
    PromptItem,
    PromptIterator,
    load_jsonl_prompts,
    load_parquet_prompts,
    load_prompts,
    synthetic_prompts,
)
from rlhf_trainer.data.tasks import get_task


class FakeCharTokenizer:
    """Test double for a tokenizer: one token per character (its code point)."""

    def encode(self, text: str) -> list[int]:
        return [ord(character) for character in text]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def numbered_items(count: int) -> list[PromptItem]:
    return [PromptItem(prompt=[i + 1], metadata={"i": i}) for i in range(count)]


def ids(batch: list[PromptItem]) -> list[int]:
    return [item.metadata["i"] for item in batch]


# -------------------------------------------------------------------------------- loading


def test_jsonl_token_prompts_with_metadata(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "prompts.jsonl",
        ['{"prompt": [5, 6, 7], "answer": 3}', "", '{"prompt": [1], "answer": 4, "tag": "x"}'],
    )
    assert load_jsonl_prompts(path) == [
        PromptItem(prompt=[5, 6, 7], metadata={"answer": 3}),
        PromptItem(prompt=[1], metadata={"answer": 4, "tag": "x"}),
    ]


def test_jsonl_with_another_field_name_and_text_prompts(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ['{"question": "hi", "id": 1}'])
    items = load_jsonl_prompts(path, prompt_field="question", tokenizer=FakeCharTokenizer())
    assert items == [PromptItem(prompt=[104, 105], metadata={"id": 1})]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"prompt": "text"}', "prompt is text, but no tokenizer was given"),
        ('{"other": [1]}', "no 'prompt' field"),
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"prompt": []}', "prompt is empty"),
        ('{"prompt": [1.5]}', "prompt must be a list of token ids or a string"),
        ('{"prompt": [true]}', "prompt must be a list of token ids or a string"),
        ('{"prompt": 7}', "prompt must be a list of token ids or a string"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, line: str, problem: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": [1]}', line])
    with pytest.raises(ValueError) as info:
        load_jsonl_prompts(path)
    assert str(info.value).startswith(f"{path}:2: {problem}")


def test_load_prompts_from_a_synthetic_task() -> None:
    items = load_prompts("synthetic:target_token", synthetic_count=10, seed=3)
    task = get_task("target_token")
    assert [item.prompt for item in items] == task.make_prompts(10, seed=3)
    assert all(item.metadata == {"task": "target_token"} for item in items)
    assert items == synthetic_prompts("target_token", 10, seed=3)


def test_load_prompts_from_a_file_path(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ['{"text": [9]}'])
    assert load_prompts(str(path), prompt_field="text") == [PromptItem(prompt=[9])]


def test_unknown_synthetic_task() -> None:
    with pytest.raises(ValueError, match="unknown synthetic task 'nope'"):
        load_prompts("synthetic:nope")


# ----------------------------------------------------------------------------- positions


def test_position_round_trips_through_json() -> None:
    position = DataPosition(epoch=3, index=17)
    text = json.dumps(position.to_json())
    assert text == '{"epoch": 3, "index": 17}'
    assert DataPosition.from_json(json.loads(text)) == position


@pytest.mark.parametrize(
    "data",
    [{}, {"epoch": 1}, {"epoch": -1, "index": 0}, {"epoch": 0, "index": "3"}, None, [0, 1]],
)
def test_invalid_positions_are_rejected(data: object) -> None:
    with pytest.raises(ValueError, match="not a data position"):
        DataPosition.from_json(data)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ iteration


def test_each_epoch_serves_every_prompt_once_in_a_seeded_order() -> None:
    iterator = PromptIterator(numbered_items(10), seed=1)
    first_epoch = ids(iterator.next_batch(10))
    second_epoch = ids(iterator.next_batch(10))
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(10))
    assert first_epoch != second_epoch  # reshuffled
    assert iterator.position == DataPosition(epoch=2, index=0)

    same_seed = PromptIterator(numbered_items(10), seed=1)
    assert ids(same_seed.next_batch(20)) == first_epoch + second_epoch
    other_seed = PromptIterator(numbered_items(10), seed=2)
    assert ids(other_seed.next_batch(10)) != first_epoch


def test_without_shuffle_the_file_order_is_kept() -> None:
    iterator = PromptIterator(numbered_items(3), seed=1, shuffle=False)
    assert ids(iterator.next_batch(5)) == [0, 1, 2, 0, 1]


def test_batches_run_across_epoch_boundaries() -> None:
    iterator = PromptIterator(numbered_items(5), seed=0)
    order0, order1 = iterator.epoch_order(0), iterator.epoch_order(1)
    assert ids(iterator.next_batch(3)) == order0[:3]
    assert ids(iterator.next_batch(3)) == order0[3:] + order1[:1]
    assert iterator.position == DataPosition(epoch=1, index=1)


def test_resuming_from_a_json_position_serves_the_same_prompts() -> None:
    items = numbered_items(5)
    straight = PromptIterator(items, seed=7)
    uninterrupted = [ids(straight.next_batch(3)) for _ in range(7)]

    first_run = PromptIterator(items, seed=7)
    served = [ids(first_run.next_batch(3)) for _ in range(3)]
    saved = json.dumps(first_run.position.to_json())  # what goes into the checkpoint manifest
    resumed = PromptIterator(items, seed=7, position=DataPosition.from_json(json.loads(saved)))
    served += [ids(resumed.next_batch(3)) for _ in range(4)]

    assert served == uninterrupted


def test_a_position_at_the_end_of_an_epoch_starts_the_next() -> None:
    iterator = PromptIterator(numbered_items(4), seed=0, position=DataPosition(epoch=2, index=4))
    assert iterator.position == DataPosition(epoch=3, index=0)
    assert ids(iterator.next_batch(4)) == iterator.epoch_order(3)


def test_a_position_past_the_end_means_the_dataset_changed() -> None:
    with pytest.raises(ValueError, match="dataset changed"):
        PromptIterator(numbered_items(4), seed=0, position=DataPosition(epoch=0, index=5))


def test_empty_dataset_and_bad_batch_size() -> None:
    with pytest.raises(ValueError, match="empty"):
        PromptIterator([], seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        PromptIterator(numbered_items(2), seed=0).next_batch(0)


# --------------------------------------------------------------------------------- Parquet


def write_parquet(path: Path, records: list[dict[str, Any]]) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def write_jsonl_records(path: Path, records: list[dict[str, Any]]) -> Path:
    return write_jsonl(path, [json.dumps(record) for record in records])


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer

    from rlhf_local.tiny_models import save_tiny_tokenizer

    return AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


RECORDS: list[dict[str, Any]] = [
    {
        "ids": [5, 6, 7],
        "text": "hello world",
        "chat": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "answer": 3,
        "tags": ["a", "b"],
        "info": {"level": 2, "source": "x"},
    },
    {
        "ids": [1],
        "text": "what is two plus two",
        "chat": [{"role": "user", "content": "the answer is"}],
        "answer": 4,
        "tags": [],
        "info": {"level": 1, "source": "y"},
    },
]


def test_parquet_token_text_and_chat_prompts_with_metadata(
    tmp_path: Path, tiny_tokenizer: Any
) -> None:
    path = write_parquet(tmp_path / "p.parquet", RECORDS)
    by_ids = load_parquet_prompts(path, "ids", tiny_tokenizer)
    assert by_ids[0] == PromptItem(
        prompt=[5, 6, 7],
        metadata={
            "text": "hello world",
            "chat": RECORDS[0]["chat"],
            "answer": 3,
            "tags": ["a", "b"],
            "info": {"level": 2, "source": "x"},
        },
    )
    assert type(by_ids[0].metadata["answer"]) is int  # plain Python, not numpy or Arrow scalars
    by_text = load_parquet_prompts(path, "text", tiny_tokenizer)
    assert [item.prompt for item in by_text] == [
        tiny_tokenizer.encode("hello world"),
        tiny_tokenizer.encode("what is two plus two"),
    ]
    by_chat = load_parquet_prompts(path, "chat", tiny_tokenizer)
    assert tiny_tokenizer.decode(by_chat[0].prompt) == "<|system|>be brief<|user|>hi<|assistant|>"
    assert by_chat[1].metadata["ids"] == [1]


@pytest.mark.parametrize("prompt_field", ["ids", "text", "chat"])
def test_the_same_records_as_parquet_and_json_lines_give_identical_items(
    tmp_path: Path, tiny_tokenizer: Any, prompt_field: str
) -> None:
    parquet = write_parquet(tmp_path / "p.parquet", RECORDS)
    jsonl = write_jsonl_records(tmp_path / "p.jsonl", RECORDS)
    from_parquet = load_prompts(str(parquet), prompt_field, tiny_tokenizer)
    assert from_parquet == load_prompts(str(jsonl), prompt_field, tiny_tokenizer)
    assert from_parquet == load_jsonl_prompts(jsonl, prompt_field, tiny_tokenizer)


def test_load_prompts_dispatches_on_the_parquet_suffix(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "P.PARQUET", [{"text": [9]}])
    assert load_prompts(str(path), prompt_field="text") == [PromptItem(prompt=[9])]


def test_chat_messages_in_parquet_leave_out_the_fields_a_struct_leaves_null(
    tmp_path: Path, tiny_tokenizer: Any
) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi", "name": "ann"},
    ]
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": messages}])
    seen: list[Any] = []

    class Recording:
        def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
            seen.append(conversation)
            return tiny_tokenizer.apply_chat_template(conversation, **kwargs)

    load_parquet_prompts(path, "prompt", Recording())  # type: ignore[arg-type]
    assert seen == [messages]


def test_a_missing_parquet_column_names_the_field_and_the_columns(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "p.parquet", [{"question": [1], "answer": 2}])
    with pytest.raises(ValueError) as info:
        load_parquet_prompts(path)
    assert str(info.value) == f"{path}: no 'prompt' field (the columns are: question, answer)"


@pytest.mark.parametrize(
    ("prompts", "row", "problem"),
    [
        (["text"], 1, "prompt is text, but no tokenizer was given"),
        ([[1], []], 2, "prompt is empty"),
        ([[1], None], 2, "prompt must be a list of token ids or a string"),
        ([[1], [1, None]], 2, "prompt must be a list of token ids or a string"),
        ([[1.5]], 1, "prompt must be a list of token ids or a string"),
        ([[{"role": "user", "content": "hi"}]], 1, "prompt is chat messages, but no tokenizer"),
    ],
)
def test_parquet_errors_name_file_and_row(
    tmp_path: Path, prompts: list[Any], row: int, problem: str
) -> None:
    path = write_parquet(tmp_path / "bad.parquet", [{"prompt": prompt} for prompt in prompts])
    with pytest.raises(ValueError) as info:
        load_parquet_prompts(path)
    assert str(info.value).startswith(f"{path}: row {row}: {problem}")


def test_a_file_that_is_not_parquet_is_refused_naming_it(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    path = tmp_path / "p.parquet"
    path.write_text('{"prompt": [1]}\n')
    with pytest.raises(ValueError, match=rf"{path}: cannot read the Parquet file"):
        load_prompts(str(path))
    with pytest.raises(FileNotFoundError):
        load_prompts(str(tmp_path / "missing.parquet"))


def test_a_resumed_iterator_over_a_parquet_dataset_continues_where_it_stopped(
    tmp_path: Path,
) -> None:
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": [i + 1], "i": i} for i in range(7)])
    straight = PromptIterator(load_prompts(str(path)), seed=7)
    uninterrupted = [straight.next_batch(3) for _ in range(6)]

    first_run = PromptIterator(load_prompts(str(path)), seed=7)
    served = [first_run.next_batch(3) for _ in range(4)]
    saved = json.dumps(first_run.position.to_json())
    reloaded = load_prompts(str(path))  # the restarted driver reads the file again
    resumed = PromptIterator(reloaded, seed=7, position=DataPosition.from_json(json.loads(saved)))
    served += [resumed.next_batch(3) for _ in range(2)]

    assert served == uninterrupted
    assert reloaded == load_jsonl_prompts(
        write_jsonl_records(tmp_path / "p.jsonl", [{"prompt": [i + 1], "i": i} for i in range(7)])
    )
