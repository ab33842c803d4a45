"""The arithmetic task: disjoint, seeded splits whose records `exact_answer` scores unchanged.

Scoring goes the trainer's way: the JSON lines are read by `load_jsonl_prompts` (chat messages
rendered with a tiny tokenizer's template), and `exact_answer` is loaded by name into a
`RuleReward` that decodes response token ids and passes each record's metadata.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers")

from rlhf_local.tiny_models import save_tiny_tokenizer
from rlhf_trainer.data import arithmetic
from rlhf_trainer.data.prompts import load_jsonl_prompts
from rlhf_trainer.data.tokenizer import decoder
from rlhf_trainer.rewards.functions import RuleReward


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def question_key(record: dict[str, Any]) -> tuple[str, frozenset[str] | tuple[str, ...]]:
    """The question regardless of operand order where order does not matter."""
    a, symbol, b = record["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split()
    operands = (a, b)
    return symbol, frozenset(operands) if symbol in "+*" else operands


def test_splits_are_disjoint_balanced_and_well_formed(tmp_path: Path) -> None:
    train_path, test_path = arithmetic.write_splits(tmp_path, train=3000, test=300, seed=7)
    train, test = read(train_path), read(test_path)
    assert (len(train), len(test)) == (3000, 300)
    train_keys, test_keys = {question_key(r) for r in train}, {question_key(r) for r in test}
    assert len(train_keys) == 3000 and len(test_keys) == 300  # no question twice in a split
    assert not train_keys & test_keys
    assert Counter(r["data_source"] for r in test) == {
        "arithmetic/add": 100,
        "arithmetic/sub": 100,
        "arithmetic/mul": 100,
    }
    for record in train + test:
        assert set(record) == {"prompt", "answer", "data_source"}
        [message] = record["prompt"]
        assert message["role"] == "user"
        assert message["content"].endswith(arithmetic.INSTRUCTION)
        a, symbol, b = message["content"].removeprefix("What is ").split("?")[0].split()
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[symbol]
        assert record["answer"] == str(expected)
        assert int(record["answer"]) >= 0


def test_splits_depend_only_on_the_seed(tmp_path: Path) -> None:
    first = arithmetic.write_splits(tmp_path / "a", train=200, test=50, seed=3)
    again = arithmetic.write_splits(tmp_path / "b", train=200, test=50, seed=3)
    other = arithmetic.write_splits(tmp_path / "c", train=200, test=50, seed=4)
    for path, same, different in zip(first, again, other, strict=True):
        assert path.read_bytes() == same.read_bytes()
        assert path.read_bytes() != different.read_bytes()


def test_more_questions_than_there_are_is_refused() -> None:
    available = sum(len(op.pairs()) for op in arithmetic.OPERATIONS)
    arithmetic.splits(train=available - 10, test=10)  # every question, once
    with pytest.raises(ValueError, match=f"there are {available}"):
        arithmetic.splits(train=available - 9, test=10)


def test_exact_answer_scores_the_records_as_the_trainer_calls_it(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path / "tokenizer"))
    _, test_path = arithmetic.write_splits(tmp_path / "data", train=10, test=6, seed=0)
    items = load_jsonl_prompts(test_path, "prompt", tokenizer)
    assert {item.metadata["data_source"] for item in items} == {
        f"arithmetic/{op.name}" for op in arithmetic.OPERATIONS
    }
    reward = RuleReward.from_spec("rlhf_trainer.rewards.text:exact_answer", decoder(tokenizer))

    def score(responses: list[str]) -> list[float]:
        return reward(
            [item.prompt for item in items],
            [tokenizer.encode(text) for text in responses],
            [item.metadata for item in items],
        )

    answers = [item.metadata["answer"] for item in items]
    assert score(answers) == [1.0] * len(items)
    assert score([f"{a} - 0 = {a}" for a in answers]) == [1.0] * len(items)
    assert score([str(int(a) + 1) for a in answers]) == [0.0] * len(items)
    assert score(["I do not know." for _ in answers]) == [0.0] * len(items)


def test_the_command_line_writes_both_files(tmp_path: Path) -> None:
    command = ["-m", "rlhf_trainer.data.arithmetic", str(tmp_path), "--train", "30", "--test", "9"]
    result = subprocess.run(
        [sys.executable, *command, "--seed", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(tmp_path / "train.jsonl"), str(tmp_path / "test.jsonl")]
    assert read(tmp_path / "test.jsonl") == arithmetic.splits(train=30, test=9, seed=1)[1]
