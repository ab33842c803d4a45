"""Multiplication questions for agentic RL: products of larger numbers than a small model
computes in its head, to be worked out with a calculator tool (`spec.environment.name:
multiplication`).

Each record asks for a 3-4 digit number times a 2-3 digit one, with the product as its
``answer`` (the record form of `rlhf_trainer.data.arithmetic`, so `rewards.text:exact_answer`
scores it too)::

    {"prompt": [{"role": "user", "content": "What is 4821 * 67? Use the calculator, then
     answer with just the number."}], "answer": "323007", "data_source": "multiplication/4x2"}

Train and test never share a question (``a * b`` and ``b * a`` count as one), and both depend
only on the seed::

    python -m rlhf_trainer.data.multiplication OUT_DIR --train 2000 --test 200 --seed 0
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_trainer.data.arithmetic import splits_main, write_task_splits

INSTRUCTION = "Use the calculator, then answer with just the number."
LEFT = (100, 9999)
"""The first operand: 3 or 4 digits."""
RIGHT = (10, 999)
"""The second: 2 or 3 digits."""


def record(a: int, b: int) -> dict[str, Any]:
    """One JSON-lines record in the form `rlhf_trainer.data.prompts` reads."""
    return {
        "prompt": [{"role": "user", "content": f"What is {a} * {b}? {INSTRUCTION}"}],
        "answer": str(a * b),
        "data_source": f"multiplication/{len(str(a))}x{len(str(b))}",
    }


def splits(
    train: int, test: int, seed: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint train and test records: test is the first `test` questions of one seeded
    draw, train the next `train`."""
    if train < 0 or test < 0:
        raise ValueError(f"asked for {train} + {test} questions")
    rng = random.Random(f"rlhf-multiplication:{seed}")
    seen: set[tuple[int, int]] = set()
    records: list[dict[str, Any]] = []
    while len(records) < train + test:
        a, b = rng.randint(*LEFT), rng.randint(*RIGHT)
        key = (min(a, b), max(a, b))
        if key not in seen:
            seen.add(key)
            records.append(record(a, b))
    return records[test:], records[:test]


def write_splits(out_dir: Path | str, train: int, test: int, seed: int = 0) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` under `out_dir`; returns their paths."""
    return write_task_splits(splits, out_dir, train, test, seed)


def main(argv: Sequence[str] | None = None) -> int:
    return splits_main("multiplication", splits, argv)


if __name__ == "__main__":
    raise SystemExit(main())
