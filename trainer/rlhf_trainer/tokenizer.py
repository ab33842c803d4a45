"""The job's tokenizer: where it comes from and which tokens end a response.

`spec.model.tokenizer` names a Hugging Face tokenizer directory; without it the policy's
directory is used when it holds a tokenizer. A `randomInit` policy has none unless one is named:
synthetic tasks work on token ids alone. Text and chat prompts (`rlhf_trainer.data`), text
rewards (`rlhf_trainer.rewards`) and stopping at the end-of-sequence token need one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhfjob.api import RLHFJobSpec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these in a directory means it holds a tokenizer."""


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
    if model.policy is not None and _holds_tokenizer(Path(model.policy)):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(model.policy)
        except (OSError, ValueError) as error:
            raise ValueError(
                f"the tokenizer in spec.model.policy {model.policy!r}: {error}"
            ) from error
    return None


def _holds_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


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
