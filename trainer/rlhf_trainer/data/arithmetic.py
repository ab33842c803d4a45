"""Arithmetic questions: a real text task for GRPO on a small instruct model.

Each record is one chat turn asking for a sum, difference or product of small integers, with the
number as its ``answer``, so ``rlhf_trainer.rewards.text:exact_answer`` scores responses as they
are (the last number of the response, or what follows "answer:", must equal it)::

    {"prompt": [{"role": "user", "content": "What is 12 + 7? Answer with just the number."}],
     "answer": "19", "data_source": "arithmetic/add"}

Point ``dataset.source`` at ``train.jsonl`` with ``dataset.promptField: prompt``.

The ranges are chosen so that SmolLM2-135M-Instruct starts low but not at zero: greedy with 16
new tokens on CPU it answered 22 of the 150 questions of the seed-0 test split (0.15; sums 0.14,
differences 0.08, products 0.22), mostly by opening with "To solve this, ..." and running out
of tokens, which GRPO can train away. Operands up to 50 with times tables scored 0.35, up to 20
0.42, three-digit ones 0.02. Train and test never share a question (``a + b`` and ``b + a``
count as the same one), and both depend only on the seed. There are 153 products: beyond about
460 records a split holds only sums and differences.

    python -m rlhf_trainer.data.arithmetic OUT_DIR --train 2000 --test 200 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INSTRUCTION = "Answer with just the number."
"""Asks for a short final answer: 16 new tokens are then enough, and the number is the last one."""


@dataclass(frozen=True)
class Operation:
    """One kind of question: its symbol, the operand range (inclusive) and whether order matters."""

    name: str
    symbol: str
    low: int
    high: int
    commutative: bool

    def apply(self, a: int, b: int) -> int:
        if self.name == "add":
            return a + b
        if self.name == "sub":
            return a - b
        return a * b

    def pairs(self) -> list[tuple[int, int]]:
        """Every distinct question once: ``a >= b`` (sums and products are symmetric, and a
        difference of ``a >= b`` is never negative)."""
        span = range(self.low, self.high + 1)
        return [(a, b) for a in span for b in span if a >= b]


OPERATIONS = (
    Operation("add", "+", 10, 99, commutative=True),
    Operation("sub", "-", 10, 99, commutative=False),
    Operation("mul", "*", 3, 19, commutative=True),
)
"""Two-digit sums and differences and products up to 19 x 19 (see the module docstring)."""


def question(operation: Operation, a: int, b: int) -> str:
    return f"What is {a} {operation.symbol} {b}? {INSTRUCTION}"


def record(operation: Operation, a: int, b: int) -> dict[str, Any]:
    """One JSON-lines record in the form `rlhf_trainer.data.prompts` reads."""
    return {
        "prompt": [{"role": "user", "content": question(operation, a, b)}],
        "answer": str(operation.apply(a, b)),
        "data_source": f"arithmetic/{operation.name}",
    }


def _interleaved(seed: int, operations: Sequence[Operation]) -> Iterator[dict[str, Any]]:
    """Every question of every operation, shuffled by ``seed`` and taken from the operations in
    turn, so any prefix is balanced across them."""
    rng = random.Random(seed)
    queues = []
    for operation in operations:
        pairs = operation.pairs()
        rng.shuffle(pairs)
        # A commutative question shows its operands in either order.
        queues.append(
            [
                (operation, *((b, a) if operation.commutative and rng.random() < 0.5 else (a, b)))
                for a, b in pairs
            ]
        )
    for position in range(max(len(queue) for queue in queues)):
        for queue in queues:
            if position < len(queue):
                yield record(*queue[position])


def splits(
    train: int, test: int, seed: int = 0, operations: Sequence[Operation] = OPERATIONS
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint train and test records: test is the first ``test`` of one seeded order, train the
    next ``train``. ValueError when there are not that many distinct questions."""
    available = sum(len(operation.pairs()) for operation in operations)
    if train < 0 or test < 0 or train + test > available:
        raise ValueError(f"asked for {train} + {test} questions; there are {available}")
    records = _interleaved(seed, operations)
    test_records = [next(records) for _ in range(test)]
    train_records = [next(records) for _ in range(train)]
    return train_records, test_records


def write_jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as out:
        for item in records:
            out.write(json.dumps(item) + "\n")


Records = list[dict[str, Any]]
SplitsFn = Callable[[int, int, int], tuple[Records, Records]]


def write_task_splits(
    splits_of: SplitsFn, out_dir: Path | str, train: int, test: int, seed: int = 0
) -> tuple[Path, Path]:
    """Write a task's ``train.jsonl`` and ``test.jsonl`` (from `splits_of`) under `out_dir`;
    returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_records, test_records = splits_of(train, test, seed)
    train_path, test_path = out_dir / "train.jsonl", out_dir / "test.jsonl"
    write_jsonl(train_path, train_records)
    write_jsonl(test_path, test_records)
    return train_path, test_path


def write_splits(out_dir: Path | str, train: int, test: int, seed: int = 0) -> tuple[Path, Path]:
    """Write the arithmetic task's ``train.jsonl`` and ``test.jsonl`` under ``out_dir``."""
    return write_task_splits(splits, out_dir, train, test, seed)


def splits_main(task: str, splits_of: SplitsFn, argv: Sequence[str] | None) -> int:
    """``python -m rlhf_trainer.data.<task> OUT_DIR --train N --test N --seed S``."""
    parser = argparse.ArgumentParser(
        prog=f"python -m rlhf_trainer.data.{task}",
        description=f"Write {task} train.jsonl and test.jsonl (disjoint questions).",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        paths = write_task_splits(splits_of, args.out_dir, args.train, args.test, args.seed)
    except ValueError as error:
        parser.error(str(error))
    for path in paths:
        print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return splits_main("arithmetic", splits, argv)


if __name__ == "__main__":
    raise SystemExit(main())
