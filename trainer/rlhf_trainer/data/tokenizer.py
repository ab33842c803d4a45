"""The job's tokenizer: where it comes from and which tokens end a response.

`spec.model.tokenizer` names a Hugging Face tokenizer directory; without it the policy's
directory is used when it holds a tokenizer. A `randomInit` policy has none unless one is named:
synthetic tasks work on token ids alone. Text and chat prompts (`rlhf_trainer.data.prompts`), text
rewards (`rlhf_trainer.rewards.functions`), stopping at the end-of-sequence token and stop strings
need one.

Stop strings (`algorithm.stopStrings`): a response ends with the token that completes the first
occurrence of any stop string in its decoded text. The stop string is kept, as a stop token is
kept; the tokens after that token are dropped (they are neither rewarded nor trained on), so the
response's length, and its mask, are those of the kept tokens. Only the response's text is
searched: a stop string in the prompt, or one that starts in the prompt, does not count. The
search is engine-independent: it runs on the generated token ids after generation
(`rlhf_trainer.rollout.base.truncate_completions`), whichever engine sampled them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlhf_trainer.modeling.pretrained import holds_tokenizer
from rlhfjob.api import RLHFJobSpec


def load_tokenizer(spec: RLHFJobSpec) -> Any | None:
    """The job's tokenizer, or None. A named `spec.model.tokenizer` that cannot be loaded
    raises ``ValueError`` naming it. transformers is imported only when there is one to load
    (importing it takes seconds, and a warm restart of a token-id job should not pay them)."""
    model = spec.model
    if model.tokenizer is not None:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(model.tokenizer)
        except (OSError, ValueError) as error:
            raise ValueError(f"spec.model.tokenizer {model.tokenizer!r}: {error}") from error
    if model.policy is not None and holds_tokenizer(Path(model.policy)):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(model.policy)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"the tokenizer in spec.model.policy {model.policy!r}: {error}"
            ) from error
    return None


def stop_token_ids(spec: RLHFJobSpec, tokenizer: Any | None) -> tuple[int, ...]:
    """The token ids that end a response: `algorithm.stopTokenIds`, plus with `stopAtEos` the
    tokenizer's end-of-sequence token and those of the policy's ``generation_config.json``
    (chat models often end a turn with a token of their own)."""
    algorithm = spec.algorithm
    ids = set(algorithm.stop_token_ids)
    if algorithm.stop_at_eos and tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        ids.update(_generation_config_eos(spec))
    return tuple(sorted(ids))


def _generation_config_eos(spec: RLHFJobSpec) -> list[int]:
    if spec.model.policy is None:
        return []
    path = Path(spec.model.policy) / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    if isinstance(eos, int) and not isinstance(eos, bool):
        return [eos]
    if isinstance(eos, list):
        return [token for token in eos if isinstance(token, int) and not isinstance(token, bool)]
    return []


def decoder(tokenizer: Any) -> Any:
    """Token ids to text with `tokenizer`, special tokens left out (for text rewards)."""

    def decode(token_ids: list[int]) -> str:
        return str(tokenizer.decode(token_ids, skip_special_tokens=True))

    return decode


STOP_STRINGS_NEED_A_TOKENIZER = "algorithm.stopStrings needs a tokenizer (spec.model.tokenizer)"


def check_stop_strings(spec: RLHFJobSpec, tokenizer: Any | None) -> None:
    """Refuse `algorithm.stopStrings` without a tokenizer (``ValueError``): stop strings are
    found in decoded text. Called at start, with the result of `load_tokenizer`."""
    if spec.algorithm.stop_strings and tokenizer is None:
        raise ValueError(STOP_STRINGS_NEED_A_TOKENIZER)


def truncate_at_stop_strings(
    token_ids: Sequence[int], decode: Callable[[list[int]], str], stop_strings: Sequence[str]
) -> int:
    """How many of a response's `token_ids` to keep: up to and including the token that
    completes the first occurrence of any of `stop_strings` in the text `decode` gives, or all
    of them when none occurs (see the module docstring).

    The search decodes the whole response once, and only when a stop string occurs there
    searches the shortest prefix whose text holds one by bisection: about log2(n) more decodes
    rather than one per token. It relies on a prefix's text being the start of the longer text,
    up to an incomplete character at its end (a byte-level token that holds part of a UTF-8
    character decodes to U+FFFD until the rest arrives), which holds for Hugging Face decoders;
    so a stop string that itself holds U+FFFD may be found a little late.
    """
    stops = tuple(stop_strings)
    if not stops:
        return len(token_ids)
    if not all(stops):
        raise ValueError("a stop string must not be empty")
    ids = list(token_ids)

    def holds_stop(length: int) -> bool:
        text = decode(ids[:length])
        return any(stop in text for stop in stops)

    if not ids or not holds_stop(len(ids)):
        return len(ids)
    low, high = 0, len(ids)  # the text of `low` tokens holds no stop string, that of `high` does
    while high - low > 1:
        middle = (low + high) // 2
        if holds_stop(middle):
            high = middle
        else:
            low = middle
    return high
