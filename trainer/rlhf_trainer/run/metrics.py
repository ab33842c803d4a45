"""Trainer metrics: Prometheus ``rlhf_trainer_*`` series plus a JSON-lines log of every step.

Every metric name is a constant below; dashboards, alerts and tests refer to these, never to
string literals of their own. Names follow Prometheus conventions (design decision 11): base
units, counters end in ``_total``, durations are ``_seconds`` histograms.

Each :class:`TrainerMetrics` owns its own ``CollectorRegistry`` instead of the process-global
one, so several instances (tests, or a driver restarted in-process) never collide. Serve it with
:func:`serve_metrics`.

Typical use in the driver::

    metrics = TrainerMetrics(jsonl_path=run_dir / "metrics.jsonl")
    server = serve_metrics(metrics.registry, port=9400)
    with metrics.time_phase(PHASE_GENERATE):
        ...
    metrics.record_generation(num_tokens, seconds)
    metrics.end_step(step, reward_mean=..., reward_std=..., kl=..., policy_loss=...)
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rlhf_trainer.run.curves import EVALUATION_KIND
from rlhf_trainer.run.episode_metrics import EPISODE_METRIC_NAMES, EpisodeSeries

# Metric names: the single source of truth.
STEP = "rlhf_trainer_step"
STEP_DURATION_SECONDS = "rlhf_trainer_step_duration_seconds"
PHASE_DURATION_SECONDS = "rlhf_trainer_phase_duration_seconds"
GENERATED_TOKENS_PER_SECOND = "rlhf_trainer_generated_tokens_per_second"
GENERATED_TOKENS_TOTAL = "rlhf_trainer_generated_tokens_total"
WEIGHT_SYNC_DURATION_SECONDS = "rlhf_trainer_weight_sync_duration_seconds"
WEIGHT_SYNC_BYTES_TOTAL = "rlhf_trainer_weight_sync_bytes_total"
REWARD_MEAN = "rlhf_trainer_reward_mean"
REWARD_STD = "rlhf_trainer_reward_std"
REWARD_COMPONENT = "rlhf_trainer_reward_component"
REWARD_MODELS = "rlhf_trainer_reward_models"
KL = "rlhf_trainer_kl"
POLICY_LOSS = "rlhf_trainer_policy_loss"
VALUE_LOSS = "rlhf_trainer_value_loss"
POLICY_VERSION_LAG = "rlhf_trainer_policy_version_lag"
CHECKPOINTS_TOTAL = "rlhf_trainer_checkpoints_total"
CHECKPOINT_UPLOAD_SECONDS = "rlhf_trainer_checkpoint_upload_seconds"
CHECKPOINT_UPLOAD_FAILURES_TOTAL = "rlhf_trainer_checkpoint_upload_failures_total"
CHECKPOINT_UPLOADED_STEP = "rlhf_trainer_checkpoint_uploaded_step"
ROLLOUT_ENGINES = "rlhf_trainer_rollout_engines"
STARTUP_SECONDS = "rlhf_trainer_startup_seconds"
DATASET_PROMPTS = "rlhf_trainer_dataset_prompts"
EVALUATION = "rlhf_trainer_evaluation"
EVALUATION_STEP = "rlhf_trainer_evaluation_step"
TRACKING_FAILURES_TOTAL = "rlhf_trainer_tracking_failures_total"

METRIC_NAMES = (
    STEP,
    STEP_DURATION_SECONDS,
    PHASE_DURATION_SECONDS,
    GENERATED_TOKENS_PER_SECOND,
    GENERATED_TOKENS_TOTAL,
    WEIGHT_SYNC_DURATION_SECONDS,
    WEIGHT_SYNC_BYTES_TOTAL,
    REWARD_MEAN,
    REWARD_STD,
    REWARD_COMPONENT,
    REWARD_MODELS,
    KL,
    POLICY_LOSS,
    VALUE_LOSS,
    POLICY_VERSION_LAG,
    CHECKPOINTS_TOTAL,
    CHECKPOINT_UPLOAD_SECONDS,
    CHECKPOINT_UPLOAD_FAILURES_TOTAL,
    CHECKPOINT_UPLOADED_STEP,
    ROLLOUT_ENGINES,
    STARTUP_SECONDS,
    DATASET_PROMPTS,
    EVALUATION,
    EVALUATION_STEP,
    TRACKING_FAILURES_TOTAL,
    *EPISODE_METRIC_NAMES,
)

RAY_OBJECT_STORE_MEMORY = "ray_object_store_memory"
RAY_ACTORS = "ray_actors"
RAY_METRIC_NAMES = (RAY_OBJECT_STORE_MEMORY, RAY_ACTORS)
"""Ray's own metrics the dashboards show (every Ray node exports them on its `metrics` port,
which the chart's PodMonitor scrapes); Ray names them, this module only lists them."""

PHASE_LABEL = "phase"
STATE_LABEL = "state"
OUTCOME_LABEL = "outcome"
COMPONENT_LABEL = "component"
FIGURE_LABEL = "figure"
SOURCE_LABEL = "source"
BACKEND_LABEL = "backend"
PROMPT_OUTCOMES = ("kept", "truncated", "skipped")
"""What loading did with each prompt (dataset.overlongPrompts)."""
ENGINES_LIVE = "live"
ENGINES_DESIRED = "desired"
PHASE_GENERATE = "generate"
PHASE_REWARD = "reward"
PHASE_REFERENCE = "reference"
PHASE_ADVANTAGE = "advantage"
PHASE_UPDATE = "update"
PHASE_SYNC = "sync"
PHASE_CHECKPOINT = "checkpoint"
PHASE_EVALUATE = "evaluate"
PHASES = (
    PHASE_GENERATE,
    PHASE_REWARD,
    PHASE_REFERENCE,
    PHASE_ADVANTAGE,
    PHASE_UPDATE,
    PHASE_SYNC,
    PHASE_CHECKPOINT,
    PHASE_EVALUATE,
)

ALL_SOURCES = "all"
"""The `source` label of figures over the whole held-out set."""


def evaluation_figures(record: dict[str, Any]) -> dict[str, float]:
    """An evaluation record's figures over the whole set: score, accuracy, pass@k, mean@k."""
    return {
        key: float(value)
        for key, value in record.items()
        if key in ("score", "accuracy") or key.startswith(("pass@", "mean@"))
    }


# From tiny CPU steps (milliseconds) to large GPU generations (tens of minutes).
DURATION_BUCKETS_SECONDS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600
)  # fmt: skip


_STANDARD_RECORD_KEYS = frozenset(
    {
        "step",
        "time",
        "step_seconds",
        "reward_mean",
        "reward_std",
        "kl",
        "policy_loss",
        "value_loss",
        "policy_version_lag",
        "generated_tokens_per_second",
        "phase_seconds",
        "generated_tokens",
        "weight_sync_seconds",
        "weight_sync_bytes",
        "checkpoints",
        "upload_seconds",
        "rollout_engines",
        "reward_components",
        "attempt",
    }
)
"""Keys of every JSON-lines record (see :meth:`TrainerMetrics.end_step`)."""


def _counter_base(name: str) -> str:
    """prometheus_client appends ``_total`` to counters itself."""
    return name.removesuffix("_total")


class TrainerSeries:
    """The Prometheus series a trainer exports, each defined once; `TrainerMetrics` records
    into them."""

    def _step_series(self, registry: CollectorRegistry) -> None:
        """How fast steps and their phases, generation and weight syncs go."""
        self.step = Gauge(STEP, "Last completed training step.", registry=registry)
        self.step_duration = Histogram(
            STEP_DURATION_SECONDS,
            "Wall time of one training step.",
            buckets=DURATION_BUCKETS_SECONDS,
            registry=registry,
        )
        self.phase_duration = Histogram(
            PHASE_DURATION_SECONDS,
            "Wall time of one phase of a training step.",
            [PHASE_LABEL],
            buckets=DURATION_BUCKETS_SECONDS,
            registry=registry,
        )
        self.generated_tokens_per_second = Gauge(
            GENERATED_TOKENS_PER_SECOND,
            "Generation throughput of the last rollout, in tokens per second.",
            registry=registry,
        )
        self.generated_tokens = Counter(
            _counter_base(GENERATED_TOKENS_TOTAL),
            "Tokens generated by rollouts.",
            registry=registry,
        )
        self.weight_sync_duration = Histogram(
            WEIGHT_SYNC_DURATION_SECONDS,
            "Wall time of one trainer-to-rollout weight sync.",
            buckets=DURATION_BUCKETS_SECONDS,
            registry=registry,
        )
        self.weight_sync_bytes = Counter(
            _counter_base(WEIGHT_SYNC_BYTES_TOTAL),
            "Bytes broadcast by weight syncs.",
            registry=registry,
        )
        for phase in PHASES:  # expose every phase from the start, so dashboards see zeros
            self.phase_duration.labels(phase)

    def _score_series(self, registry: CollectorRegistry) -> None:
        """What the last step scored: rewards, KL, losses, staleness; the held-out set."""
        self.evaluation = Gauge(
            EVALUATION,
            "Latest held-out evaluation: score, accuracy, pass@k, mean@k, by data source.",
            [FIGURE_LABEL, SOURCE_LABEL],
            registry=registry,
        )
        self.evaluation_step = Gauge(
            EVALUATION_STEP, "Step of the latest held-out evaluation.", registry=registry
        )
        self.tracking_failures = Counter(
            _counter_base(TRACKING_FAILURES_TOTAL),
            "Calls to an experiment tracker given up (training goes on).",
            [BACKEND_LABEL],
            registry=registry,
        )
        self.reward_mean = Gauge(REWARD_MEAN, "Mean reward of the last step.", registry=registry)
        self.reward_std = Gauge(
            REWARD_STD, "Standard deviation of rewards in the last step.", registry=registry
        )
        self.reward_component = Gauge(
            REWARD_COMPONENT,
            "Mean score of each part of the reward in the last step, before weighting.",
            [COMPONENT_LABEL],
            registry=registry,
        )
        self.reward_models = Gauge(
            REWARD_MODELS,
            "Reward-model replicas: live (scoring) and desired (the role's replicas).",
            [STATE_LABEL],
            registry=registry,
        )
        self.kl = Gauge(KL, "Mean KL(policy || reference) in the last step.", registry=registry)
        self.policy_loss = Gauge(POLICY_LOSS, "Policy loss of the last step.", registry=registry)
        self.value_loss = Gauge(
            VALUE_LOSS, "Critic loss of the last step (PPO only).", registry=registry
        )
        self.policy_version_lag = Gauge(
            POLICY_VERSION_LAG,
            "Policy versions between the trainer and the weights that generated the samples.",
            registry=registry,
        )

    def _run_series(self, registry: CollectorRegistry) -> None:
        """The run around the steps: checkpoints, uploads, roles' actors, start-up, dataset."""
        self.checkpoints = Counter(
            _counter_base(CHECKPOINTS_TOTAL), "Checkpoints completed.", registry=registry
        )
        self.upload_duration = Histogram(
            CHECKPOINT_UPLOAD_SECONDS,
            "Seconds each checkpoint took to upload to the bucket (in the background).",
            buckets=DURATION_BUCKETS_SECONDS,
            registry=registry,
        )
        self.upload_failures = Counter(
            _counter_base(CHECKPOINT_UPLOAD_FAILURES_TOTAL),
            "Checkpoint uploads given up (training goes on; the next one is uploaded).",
            registry=registry,
        )
        self.uploaded_step = Gauge(
            CHECKPOINT_UPLOADED_STEP,
            "Step of the newest checkpoint complete in the bucket.",
            registry=registry,
        )
        self.rollout_engines = Gauge(
            ROLLOUT_ENGINES,
            "Rollout engines: live (generating) and desired (the role's slots).",
            [STATE_LABEL],
            registry=registry,
        )
        self.startup_seconds = Gauge(
            STARTUP_SECONDS,
            "Seconds the driver took to start or adopt its actors (last start).",
            registry=registry,
        )
        self.dataset_prompts = Gauge(
            DATASET_PROMPTS,
            "Prompts of the dataset by what loading did with them (dataset.overlongPrompts).",
            [OUTCOME_LABEL],
            registry=registry,
        )


class TrainerMetrics(TrainerSeries, EpisodeSeries):
    """All trainer metrics for one run, plus the per-step JSON-lines record.

    Durations and counts reported during a step (phases, generation, weight sync, checkpoints)
    are accumulated and written, with the step's scalars, as one JSON object per line by
    :meth:`end_step`. A resumed run appends to the same file, so a step may appear twice; the
    later line wins. Every record carries the driver's `attempt` (so a log can be grouped by
    attempt) and the number of live rollout engines.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        jsonl_path: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        attempt: int = 0,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        self.attempt = attempt
        self._rollout_engines: int | None = None
        self._lock = threading.Lock()
        self.jsonl_path = Path(jsonl_path) if jsonl_path is not None else None
        if self.jsonl_path is not None:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)

        self._step_series(self.registry)
        self._score_series(self.registry)
        self._run_series(self.registry)
        self._episode_series(self.registry)
        self._step_started_at = self._clock()
        self._pending = self._empty_step_record()

    @staticmethod
    def _empty_step_record() -> dict[str, Any]:
        return {
            "phase_seconds": {},
            "generated_tokens": 0,
            "generation_seconds": 0.0,
            "weight_sync_seconds": 0.0,
            "weight_sync_bytes": 0,
            "checkpoints": 0,
            "upload_seconds": 0.0,
        }

    def begin_step(self) -> None:
        """Mark the start of a step (otherwise a step is timed from the previous ``end_step``)."""
        with self._lock:
            self._step_started_at = self._clock()

    def observe_phase(self, phase: str, seconds: float) -> None:
        """Record that ``phase`` (one of :data:`PHASES`) took ``seconds`` in this step."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        self.phase_duration.labels(phase).observe(seconds)
        with self._lock:
            phases = self._pending["phase_seconds"]
            phases[phase] = phases.get(phase, 0.0) + seconds

    @contextlib.contextmanager
    def time_phase(self, phase: str) -> Iterator[None]:
        """Time the block as ``phase`` (also when it raises: a failed phase still took time)."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        started = self._clock()
        try:
            yield
        finally:
            self.observe_phase(phase, self._clock() - started)

    def record_generation(self, num_tokens: int, seconds: float) -> None:
        """A rollout produced ``num_tokens`` new tokens in ``seconds`` of wall time."""
        self.generated_tokens.inc(num_tokens)
        if seconds > 0:
            self.generated_tokens_per_second.set(num_tokens / seconds)
        with self._lock:
            self._pending["generated_tokens"] += num_tokens
            self._pending["generation_seconds"] += seconds

    def record_weight_sync(self, seconds: float, num_bytes: int) -> None:
        """A weight sync broadcast ``num_bytes`` in ``seconds``."""
        self.weight_sync_duration.observe(seconds)
        self.weight_sync_bytes.inc(num_bytes)
        with self._lock:
            self._pending["weight_sync_seconds"] += seconds
            self._pending["weight_sync_bytes"] += num_bytes

    def set_rollout_engines(self, live: int, desired: int) -> None:
        """The rollout engines now live out of those desired (elastic rollout)."""
        self.rollout_engines.labels(ENGINES_LIVE).set(live)
        self.rollout_engines.labels(ENGINES_DESIRED).set(desired)
        with self._lock:
            self._rollout_engines = live

    def set_reward_models(self, live: int, desired: int) -> None:
        """The reward-model replicas now live out of those desired (an elastic role)."""
        self.reward_models.labels(ENGINES_LIVE).set(live)
        self.reward_models.labels(ENGINES_DESIRED).set(desired)

    def record_startup(self, seconds: float) -> None:
        """How long the driver took to have its actors ready."""
        self.startup_seconds.set(seconds)

    def record_dataset(self, kept: int, truncated: int, skipped: int) -> None:
        """How many prompts loading kept whole, truncated and left out."""
        for outcome, count in zip(PROMPT_OUTCOMES, (kept, truncated, skipped), strict=True):
            self.dataset_prompts.labels(outcome).set(count)

    def record_checkpoint(self) -> None:
        """A checkpoint completed."""
        self.checkpoints.inc()
        with self._lock:
            self._pending["checkpoints"] += 1

    def record_upload(self, step: int, seconds: float, ok: bool) -> None:
        """A background upload of checkpoint `step` ended (any thread): its time goes to the
        step during which it ended, so a step log shows which steps an upload overlapped."""
        if ok:
            self.upload_duration.observe(seconds)
            self.uploaded_step.set(step)
        else:
            self.upload_failures.inc()
        with self._lock:
            self._pending["upload_seconds"] += seconds

    def end_step(
        self,
        step: int,
        *,
        reward_mean: float,
        reward_std: float,
        kl: float | None = None,
        policy_loss: float | None = None,
        value_loss: float | None = None,
        policy_version_lag: int = 0,
        reward_components: Mapping[str, float] | None = None,
        extra: Mapping[str, float | Mapping[str, int]] | None = None,
    ) -> dict[str, Any]:
        """Publish the step's scalars and append its JSON line. Returns the record written.

        ``None`` leaves a gauge at its previous value and writes ``null`` to the log. ``extra``
        holds further numbers for the log only (entropy, clip fraction, learning rate, ...,
        and counts by key such as the staleness of the step's samples);
        its keys must not shadow the standard ones. ``reward_components`` is the mean score of
        each part of the reward, before weighting.
        """
        clashes = sorted(set(extra or {}) & _STANDARD_RECORD_KEYS)
        if clashes:
            raise ValueError(f"extra metrics shadow standard fields: {clashes}")
        now = self._clock()
        with self._lock:
            step_seconds = now - self._step_started_at
            self._step_started_at = now
            pending, self._pending = self._pending, self._empty_step_record()
            rollout_engines = self._rollout_engines

        self.step.set(step)
        self.step_duration.observe(step_seconds)
        self.reward_mean.set(reward_mean)
        self.reward_std.set(reward_std)
        self.policy_version_lag.set(policy_version_lag)
        for component, score in (reward_components or {}).items():
            self.reward_component.labels(component).set(score)
        for gauge, value in (
            (self.kl, kl),
            (self.policy_loss, policy_loss),
            (self.value_loss, value_loss),
        ):
            if value is not None:
                gauge.set(value)

        generation_seconds = pending.pop("generation_seconds")
        tokens_per_second = (
            pending["generated_tokens"] / generation_seconds if generation_seconds > 0 else None
        )
        record: dict[str, Any] = {
            "step": step,
            "time": time.time(),
            "step_seconds": step_seconds,
            "reward_mean": reward_mean,
            "reward_std": reward_std,
            "kl": kl,
            "policy_loss": policy_loss,
            "value_loss": value_loss,
            "policy_version_lag": policy_version_lag,
            "generated_tokens_per_second": tokens_per_second,
            "rollout_engines": rollout_engines,
            "reward_components": dict(reward_components or {}),
            "attempt": self.attempt,
            **pending,
            **dict(extra or {}),
        }
        self._append(record)
        return record

    def record_evaluation(self, record: dict[str, Any]) -> dict[str, Any]:
        """A held-out evaluation (`rlhf_trainer.run.evaluation`): its gauges and its line in the
        step log (`kind: evaluation`), with the seconds it took."""
        with self._lock:
            seconds = self._pending["phase_seconds"].pop(PHASE_EVALUATE, 0.0)
        record = {"kind": EVALUATION_KIND, "time": time.time(), "seconds": seconds} | record
        self.evaluation_step.set(record["step"])
        for figure, value in evaluation_figures(record).items():
            self.evaluation.labels(figure, ALL_SOURCES).set(value)
        for source, figures in (record.get("by_source") or {}).items():
            for figure, value in figures.items():
                self.evaluation.labels(figure, source).set(value)
        self._append(record)
        return record

    def record_tracking_failure(self, backend: str) -> None:
        self.tracking_failures.labels(backend).inc()

    def _append(self, record: dict[str, Any]) -> None:
        if self.jsonl_path is not None:
            # Opened per line: nothing to close, and every finished line is on disk.
            with self.jsonl_path.open("a", encoding="utf-8") as log:
                log.write(json.dumps(record) + "\n")


@dataclass
class MetricsServer:
    """A running ``/metrics`` HTTP endpoint."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def serve_metrics(
    registry: CollectorRegistry, port: int, address: str = "0.0.0.0"
) -> MetricsServer:
    """Serve ``registry`` for Prometheus on ``address:port`` from a daemon thread.

    ``port=0`` picks a free port (see :attr:`MetricsServer.port`).
    """
    server, thread = start_http_server(port, addr=address, registry=registry)
    return MetricsServer(server=server, thread=thread)
