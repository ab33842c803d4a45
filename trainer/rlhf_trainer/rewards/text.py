"""Rule rewards on text, ready to name in `reward.function` (they need the job's tokenizer).

* ``rlhf_trainer.rewards.text:exact_answer`` — 1 when the response's final answer equals the
  record's ``answer`` field, else 0. The final answer is the last ``\\boxed{...}``, else what
  follows the last "answer:" / "answer is", else the last number in the response.
* ``rlhf_trainer.rewards.text:boxed_format`` — 1 when the response gives its answer in
  ``\\boxed{...}``, else 0 (a format reward to add to a correctness reward).

Both follow the keyword signature of `rlhf_trainer.rewards.functions` (they declare
``response_texts``).
"""

from __future__ import annotations

import re
from typing import Any

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_AFTER_ANSWER = re.compile(r"answer(?:\s+is)?\s*[:=]?\s*([^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> str | None:
    """The answer a response commits to, or None (see the module docstring)."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1]
    after = _AFTER_ANSWER.findall(text)
    if after:
        return after[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalise(answer: Any) -> str:
    """Case, surrounding space and punctuation, thousands separators and a trailing ``.0``
    do not make answers differ."""
    text = str(answer).strip().strip(".").strip().lower().replace(",", "")
    text = re.sub(r"\s+", " ", text)
    return re.sub(r"^(-?\d+)\.0+$", r"\1", text)


def exact_answer(response_texts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
    """1.0 where the final answer equals ``metadata[i]["answer"]`` (normalised), else 0.0; a
    record without an answer scores 0."""
    rewards = []
    for text, record in zip(response_texts, metadata, strict=True):
        answer = final_answer(text)
        expected = record.get("answer")
        matched = answer is not None and expected is not None
        rewards.append(1.0 if matched and normalise(answer) == normalise(expected) else 0.0)
    return rewards


def boxed_format(response_texts: list[str]) -> list[float]:
    """1.0 where the response puts an answer in ``\\boxed{...}``, else 0.0."""
    return [1.0 if _BOXED.search(text) else 0.0 for text in response_texts]
