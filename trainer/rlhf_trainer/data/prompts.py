"""Prompt datasets and a seeded, resumable batch iterator.

Prompts come from a JSON-lines file, a Parquet file (``.parquet``: one record a row) or from a
synthetic task (``synthetic:<name>``, see :mod:`rlhf_trainer.data.tasks`). A record's prompt is
token ids, text (encoded with the job's tokenizer) or chat messages (rendered with the tokenizer's
chat template and its generation prompt); `fit_prompts` then applies ``dataset.overlongPrompts``.
:class:`PromptIterator` walks them epoch by epoch in an order that depends only on
``(seed, epoch)``, and its :class:`DataPosition` round-trips through JSON, so a run resumed from
a checkpoint sees exactly the prompts the uninterrupted run would have seen, whatever the file's
format (the iterator works on the loaded list).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rlhf_trainer.data.tasks import get_task

SYNTHETIC_PREFIX = "synthetic:"
PARQUET_SUFFIX = ".parquet"
PARQUET_BATCH_ROWS = 4096
"""Rows converted to Python at a time when reading a Parquet file (bounds the memory it takes)."""


@dataclass(frozen=True)
class PromptItem:
    """One prompt as token ids, with the rest of its record (passed to the reward function)."""

    prompt: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)


class Tokenizer(Protocol):
    """Turns text into token ids and back; a Hugging Face tokenizer qualifies."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


NO_TOKENIZER = (
    "no tokenizer was given (set spec.model.tokenizer, or use a policy directory with one)"
)


def load_jsonl_prompts(
    path: Path,
    prompt_field: str = "prompt",
    tokenizer: Tokenizer | None = None,
    chat_template: bool = True,
) -> list[PromptItem]:
    """Read one JSON object per line; ``prompt_field`` holds the prompt.

    The prompt is a list of token ids, a string, or chat messages (``[{"role": ...,
    "content": ...}, ...]``, rendered with the chat template when `chat_template` is on); text
    and messages need a ``tokenizer``. Every other field of the record becomes the item's
    metadata. Blank lines are skipped; anything else malformed raises ``ValueError`` naming the
    file and line.
    """
    return [
        _record_item(record, prompt_field, tokenizer, chat_template, where)
        for where, record in _jsonl_records(Path(path), prompt_field)
    ]


def _jsonl_records(path: Path, prompt_field: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each record of a JSON-lines file with where it is (``file:line``)."""
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: invalid JSON: {error}") from error
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object")
            if prompt_field not in record:
                raise ValueError(f"{where}: no {prompt_field!r} field")
            yield where, record


def read_records(source: str, prompt_field: str = "prompt") -> Iterator[tuple[str, dict[str, Any]]]:
    """Each record of a JSON-lines or Parquet file as it is (none rendered), with where it is:
    what an environment starts its trajectories from (`rlhf_trainer.environments`)."""
    path = Path(source)
    if path.suffix.lower() != PARQUET_SUFFIX:
        yield from _jsonl_records(path, prompt_field)
        return
    for row_number, record in enumerate(_parquet_records(path, prompt_field), start=1):
        record[prompt_field] = _without_null_message_fields(record[prompt_field])
        yield f"{path}: row {row_number}", record


def load_parquet_prompts(
    path: Path,
    prompt_field: str = "prompt",
    tokenizer: Tokenizer | None = None,
    chat_template: bool = True,
) -> list[PromptItem]:
    """Read a Parquet file; each row is a record exactly like a line of a JSON-lines file.

    The ``prompt_field`` column holds token ids (a list of integers), text, or chat messages (a
    list of ``{role, content}`` structs; a null struct field counts as absent, as a key missing
    from a JSON object would). Every other column becomes the item's metadata as plain Python
    values (lists, dicts for structs and maps, None for nulls). A missing column raises
    ``ValueError`` naming the field and the columns there are; a bad prompt raises the error
    :func:`load_jsonl_prompts` raises, naming the file and the row (counting from 1). pyarrow is
    imported only here.
    """
    path = Path(path)
    items = []
    for row_number, record in enumerate(_parquet_records(path, prompt_field), start=1):
        where = f"{path}: row {row_number}"
        record[prompt_field] = _without_null_message_fields(record[prompt_field])
        items.append(_record_item(record, prompt_field, tokenizer, chat_template, where))
    return items


def _parquet_records(path: Path, prompt_field: str) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ValueError(
            f"{path}: reading a Parquet dataset needs pyarrow (the trainer extra): {error}"
        ) from error
    try:
        parquet = pq.ParquetFile(path)
        columns = parquet.schema_arrow.names
        if prompt_field not in columns:
            raise ValueError(
                f"{path}: no {prompt_field!r} field (the columns are: {', '.join(columns)})"
            )
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            yield from batch.to_pylist(maps_as_pydicts="lossy")
    except pa.ArrowException as error:
        if isinstance(error, OSError) and not path.is_file():
            raise
        raise ValueError(f"{path}: cannot read the Parquet file: {error}") from error


def _without_null_message_fields(value: Any) -> Any:
    """Chat messages read from Parquet without the fields a struct leaves null (a message with
    a ``name`` gives every message of the column a ``name`` field)."""
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return [{key: item for key, item in m.items() if item is not None} for m in value]
    return value


def _record_item(
    record: Mapping[str, Any],
    prompt_field: str,
    tokenizer: Tokenizer | None,
    chat_template: bool,
    where: str,
) -> PromptItem:
    metadata = {key: value for key, value in record.items() if key != prompt_field}
    prompt = _prompt_token_ids(record[prompt_field], tokenizer, chat_template, where)
    return PromptItem(prompt=prompt, metadata=metadata)


def _prompt_token_ids(
    value: Any, tokenizer: Tokenizer | None, chat_template: bool, where: str
) -> list[int]:
    if isinstance(value, str):
        if tokenizer is None:
            raise ValueError(f"{where}: prompt is text, but {NO_TOKENIZER}")
        token_ids = list(tokenizer.encode(value))
    elif _is_chat(value):
        if not chat_template:
            raise ValueError(
                f"{where}: the prompt is chat messages, but dataset.chatTemplate is off"
            )
        if tokenizer is None:
            raise ValueError(f"{where}: prompt is chat messages, but {NO_TOKENIZER}")
        token_ids = render_chat(tokenizer, value, where)
    elif isinstance(value, list) and all(
        isinstance(token, int) and not isinstance(token, bool) for token in value
    ):
        token_ids = value
    else:
        raise ValueError(
            f"{where}: prompt must be a list of token ids or a string, or chat messages "
            '([{"role": ..., "content": ...}, ...])'
        )
    if not token_ids:
        raise ValueError(f"{where}: prompt is empty")
    return token_ids


def _is_chat(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    )


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], where: str) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template, ending with the prompt for
    the assistant's turn."""
    try:
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
    except ValueError as error:  # transformers: the tokenizer has no chat template
        raise ValueError(f"{where}: cannot apply the chat template: {error}") from error
    ids = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered
    return [int(token) for token in ids]


@dataclass(frozen=True)
class PromptCounts:
    """What `fit_prompts` did with the dataset (logged and exported at start)."""

    kept: int
    truncated: int
    skipped: int


def fit_prompts(
    items: Sequence[PromptItem], max_length: int, overlong: str
) -> tuple[list[PromptItem], PromptCounts]:
    """Apply ``dataset.overlongPrompts`` to prompts longer than `max_length`: ``truncate``
    keeps their last `max_length` tokens (the end holds the question and the generation
    prompt), ``skip`` leaves them out."""
    if overlong not in ("truncate", "skip"):
        raise ValueError(f"unknown overlongPrompts {overlong!r}")
    fitted: list[PromptItem] = []
    truncated = skipped = 0
    for item in items:
        if len(item.prompt) <= max_length:
            fitted.append(item)
        elif overlong == "skip":
            skipped += 1
        else:
            truncated += 1
            fitted.append(PromptItem(item.prompt[-max_length:], item.metadata))
    if not fitted:
        raise ValueError(
            f"every one of the {len(items)} prompts is longer than maxPromptLength "
            f"({max_length}) and dataset.overlongPrompts is skip"
        )
    return fitted, PromptCounts(kept=len(fitted) - truncated, truncated=truncated, skipped=skipped)


def synthetic_prompts(task_name: str, count: int, seed: int) -> list[PromptItem]:
    """``count`` prompts of the synthetic task ``task_name``, with ``{"task": name}`` metadata."""
    task = get_task(task_name)
    return [
        PromptItem(prompt=prompt, metadata={"task": task_name})
        for prompt in task.make_prompts(count, seed)
    ]


def load_prompts(
    source: str,
    prompt_field: str = "prompt",
    tokenizer: Tokenizer | None = None,
    synthetic_count: int = 1024,
    seed: int = 0,
    chat_template: bool = True,
) -> list[PromptItem]:
    """Prompts from ``"synthetic:<task>"`` (``synthetic_count`` of them), a Parquet file (a path
    ending in ``.parquet``, any case) or a JSON-lines file (any other path)."""
    if source.startswith(SYNTHETIC_PREFIX):
        return synthetic_prompts(source.removeprefix(SYNTHETIC_PREFIX), synthetic_count, seed)
    path = Path(source)
    if path.suffix.lower() == PARQUET_SUFFIX:
        return load_parquet_prompts(path, prompt_field, tokenizer, chat_template)
    return load_jsonl_prompts(path, prompt_field, tokenizer, chat_template)


@dataclass(frozen=True)
class DataPosition:
    """Where the iterator stands: the next prompt served is ``order(epoch)[index]``."""

    epoch: int = 0
    index: int = 0

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DataPosition:
        """Inverse of :meth:`to_json`; raises ``ValueError`` on anything else."""
        try:
            epoch, index = data["epoch"], data["index"]
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a data position: {data!r}") from error
        if not all(_is_count(value) for value in (epoch, index)):
            raise ValueError(f"not a data position: {data!r}")
        return cls(epoch=epoch, index=index)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class PromptIterator:
    """Serves fixed-size batches of prompts forever, reshuffling each epoch.

    Batches are always ``batch_size`` long: a batch that reaches the end of an epoch continues
    with the start of the next epoch's order. The order of epoch ``e`` is a permutation that
    depends only on ``(seed, e)`` (or the file order when ``shuffle`` is off).
    """

    def __init__(
        self,
        items: Sequence[PromptItem],
        seed: int,
        position: DataPosition | None = None,
        shuffle: bool = True,
    ) -> None:
        if not items:
            raise ValueError("the prompt dataset is empty")
        self.items = items
        self.seed = seed
        self.shuffle = shuffle
        position = position or DataPosition()
        if position.index > len(items):
            raise ValueError(
                f"data position {position.to_json()} is past the end of a dataset of "
                f"{len(items)} prompts; was the dataset changed since the checkpoint?"
            )
        self._epoch = position.epoch
        self._index = position.index
        self._order = self.epoch_order(self._epoch)
        self._wrap_if_at_end()

    @property
    def position(self) -> DataPosition:
        """The position to store in a checkpoint to resume right after the last batch served."""
        return DataPosition(epoch=self._epoch, index=self._index)

    def epoch_order(self, epoch: int) -> list[int]:
        """Indices into ``items`` in the order epoch ``epoch`` serves them."""
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(f"rlhf-data:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, batch_size: int) -> list[PromptItem]:
        """The next ``batch_size`` prompts, advancing the position."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        batch: list[PromptItem] = []
        while len(batch) < batch_size:
            batch.append(self.items[self._order[self._index]])
            self._index += 1
            self._wrap_if_at_end()
        return batch

    def _wrap_if_at_end(self) -> None:
        if self._index == len(self.items):
            self._epoch += 1
            self._index = 0
            self._order = self.epoch_order(self._epoch)
