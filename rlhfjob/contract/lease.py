"""The heartbeat Lease report (design decision 4): what the trainer tells the operator.

The trainer driver writes a `LeaseReport` into the annotations of a Lease named after the job
(`to_annotations`); the operator reads it back (`from_annotations`). Each field is declared
once, here: its annotation, its codec and its meaning, so a new field is one declaration plus its
round-trip test, and the table in the docs comes from `LeaseReport.describe`. Decoding
is lenient both ways: a key the reader does not know is ignored (a newer trainer), a missing or
unreadable one is None (an older trainer, a hand edit), never an error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any, NamedTuple

from rlhfjob.api import GROUP

PHASE_STARTING = "starting"
"""`phase` while the driver boots its actors, before the first step."""
PHASE_EXITING = "exiting"
"""`phase` once done (trained, drained or failed): drawing its curve, taking its actors down,
then leaving. Ray's verdict on the job follows; the operator gives it `EXIT_GRACE_SECONDS` beyond
the heartbeat timeout before it calls the driver hung."""
EXIT_GRACE_SECONDS = 60
LEASE_STOP_REQUESTED_AT = f"{GROUP}/stop-requested-at"
"""The one annotation the operator writes (RFC 3339): "finish your step, checkpoint it and exit"
(a drain before the cluster is released). The trainer sees it at its next renewal, answers in
`checkpoint_requested_at` with the same time, and ignores a request it (or an earlier driver)
already answered; the operator removes it when the drain ends."""


def format_time(moment: datetime) -> str:
    """RFC 3339 in UTC with a ``Z`` suffix, the form Kubernetes writes."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(value: str | None) -> datetime | None:
    """The inverse of `format_time`; also reads Kubernetes' own timestamps."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


class EngineCount(NamedTuple):
    """Live and desired members of an elastic role (rollout engines, reward models); on the wire
    ``<live>/<desired>``."""

    live: int
    desired: int

    def __str__(self) -> str:
        return f"{self.live}/{self.desired}"

    @classmethod
    def parse(cls, value: str) -> EngineCount:
        live, _, desired = value.partition("/")
        return cls(int(live), int(desired))


@dataclass(frozen=True)
class _Codec:
    encode: Callable[[Any], str]
    decode: Callable[[str], Any]


_INT = _Codec(str, int)
_FLOAT = _Codec(lambda value: f"{value:.6g}", float)
_TEXT = _Codec(str, str)
_TIME = _Codec(format_time, parse_time)
_ENGINES = _Codec(str, EngineCount.parse)


def _annotation(name: str, codec: _Codec, doc: str) -> Any:
    """A field of the report: its annotation ``rlhf.dev/<name>``, how its value is written
    there, and what it means (the one declaration of each; `LeaseReport.describe` lists them)."""
    return field(default=None, metadata={"key": f"{GROUP}/{name}", "codec": codec, "doc": doc})


@dataclass(frozen=True, kw_only=True)
class LeaseReport:
    """The trainer's progress as the Lease carries it; None fields are not written."""

    step: int | None = _annotation("step", _INT, "Last completed training step.")
    step_changed: datetime | None = _annotation(
        "step-time", _TIME, "When `step` first had its current value: stalled versus slow."
    )
    total_steps: int | None = _annotation("total-steps", _INT, "Steps the run is configured for.")
    phase: str | None = _annotation(
        "phase",
        _TEXT,
        "What the driver does now: `generate`, `update`, ..., `starting`, `exiting`.",
    )
    checkpoint_step: int | None = _annotation(
        "checkpoint-step", _INT, "Step of the newest complete checkpoint."
    )
    checkpoint_path: str | None = _annotation(
        "checkpoint-path", _TEXT, "Directory (or bucket prefix) of that checkpoint."
    )
    attempt: int | None = _annotation(
        "attempt",
        _INT,
        "Which restart wrote it (`$RLHF_ATTEMPT`): the operator ignores a stale one.",
    )
    rollout_engines: EngineCount | None = _annotation(
        "rollout-engines", _ENGINES, "`<live>/<desired>` rollout engines it generates with."
    )
    reward_models: EngineCount | None = _annotation(
        "reward-models", _ENGINES, "`<live>/<desired>` reward-model replicas it scores with."
    )
    reward_mean: float | None = _annotation(
        "reward-mean", _FLOAT, "Mean reward of the last step: the job's status shows it."
    )
    tokens_per_second: float | None = _annotation(
        "tokens-per-second", _FLOAT, "Generation throughput of the last step's rollout."
    )
    checkpoint_requested_at: datetime | None = _annotation(
        "checkpoint-requested-at",
        _TIME,
        "When it saw a request to checkpoint now (`stop-requested-at`): its acknowledgement.",
    )
    checkpoint_saved_step: int | None = _annotation(
        "checkpoint-saved-step", _INT, "Step of the checkpoint saved in answer: then pods may go."
    )
    eval_step: int | None = _annotation(
        "eval-step", _INT, "Step of the latest held-out evaluation (0: before the first)."
    )
    eval_score: float | None = _annotation(
        "eval-score", _FLOAT, "Its mean reward of greedy responses."
    )
    eval_accuracy: float | None = _annotation(
        "eval-accuracy", _FLOAT, "Its fraction of prompts whose greedy response passed."
    )
    eval_pass_at_k: float | None = _annotation(
        "eval-pass-at-k", _FLOAT, "Its fraction of prompts with a passing sampled response."
    )
    export_step: int | None = _annotation(
        "export-step", _INT, "Step of the policy exported as a Hugging Face directory."
    )
    export_path: str | None = _annotation(
        "export-path", _TEXT, "Where that directory is (on the checkpoint volume, or a bucket)."
    )
    tracking_failures: int | None = _annotation(
        "tracking-failures", _INT, "Calls to experiment trackers given up so far (never fatal)."
    )

    def __post_init__(self) -> None:
        for name in ("rollout_engines", "reward_models"):  # "1/2" and (1, 2) are accepted too
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, EngineCount.parse(value))
            elif isinstance(value, tuple) and not isinstance(value, EngineCount):
                object.__setattr__(self, name, EngineCount(*value))

    @classmethod
    def key(cls, name: str) -> str:
        """The annotation of field `name`."""
        return str(next(f for f in fields(cls) if f.name == name).metadata["key"])

    @classmethod
    def keys(cls) -> frozenset[str]:
        """Every field's annotation: the part of the Lease a driver reports."""
        return frozenset(f.metadata["key"] for f in fields(cls))

    @classmethod
    def describe(cls) -> list[tuple[str, str]]:
        """(annotation, meaning) of every field, in order: the table the docs show."""
        return [(f.metadata["key"], f.metadata["doc"]) for f in fields(cls)]

    def to_annotations(self) -> dict[str, str]:
        encoded = {}
        for f in fields(LeaseReport):
            value = getattr(self, f.name)
            if value is not None:
                encoded[f.metadata["key"]] = f.metadata["codec"].encode(value)
        return encoded

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, str]) -> LeaseReport:
        decoded: dict[str, Any] = {}
        for f in fields(LeaseReport):
            text = annotations.get(f.metadata["key"])
            if text is None:
                continue
            with contextlib.suppress(ValueError):  # unreadable counts as missing
                decoded[f.name] = f.metadata["codec"].decode(text)
        return LeaseReport(**decoded)

    def updated(self, **changes: Any) -> LeaseReport:
        """A copy with `changes` (field names) applied; a change of None keeps the field."""
        return replace(self, **{name: v for name, v in changes.items() if v is not None})
