"""Experiment tracking: TensorBoard event files always, MLflow and Weights & Biases when configured.

Tracking is best effort and must never cost a training step: each backend gets a bounded queue
and a background thread of its own (a hung MLflow server holds up neither TensorBoard nor the
trainer). ``log_*`` only enqueue; a failing call is retried with exponential backoff a bounded
number of times, then counted in ``failures`` and reported through ``on_failure`` (a Prometheus
counter and the heartbeat, for the operator's Event). A full queue drops its oldest entry and
counts it in ``dropped``. ``close`` waits at most its timeout and never raises.

Credentials stay in the environment, where each client library reads them itself
(MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN, WANDB_API_KEY): nothing here passes,
logs or reports them, and every error text goes through :func:`scrub` first.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FailureCallback = Callable[[str, str], None]
"""``on_failure(backend, error)``: ``error`` is already scrubbed; backend ``tracker`` for a record
that could not be read."""

DEFAULT_EXPERIMENT = "rlhfjob"
_NOT_METRICS = frozenset({"step", "time"})  # the x-axis and the wall clock, which backends record
_SECRET_ENV = (
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_USERNAME",
    "WANDB_API_KEY",
)
# MLflow's defaults retry one request for minutes; the queue retries, so each try is kept short.
_MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
_MLFLOW_PARAM_CHUNK, _MLFLOW_METRIC_CHUNK, _MLFLOW_PARAM_LENGTH = 100, 1000, 6000
_MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class MlflowConfig:
    """``spec.tracking.mlflow``. The operator mounts the credentials Secret as environment
    variables; the name is kept only so the fields map 1:1."""

    tracking_uri: str
    experiment: str = DEFAULT_EXPERIMENT
    run_name: str | None = None
    credentials_secret: str | None = None


@dataclass(frozen=True)
class WandbConfig:
    """``spec.tracking.wandb``. ``mode`` None: online with WANDB_API_KEY, offline without.
    ``run_id`` (e.g. the job's UID) lets a restarted driver resume the same W&B run."""

    project: str
    entity: str | None = None
    run_name: str | None = None
    mode: str | None = None
    dir: str | None = None
    api_key_secret: str | None = None
    run_id: str | None = None


@dataclass(frozen=True)
class TrackingConfig:
    tensorboard_dir: str
    mlflow: MlflowConfig | None = None
    wandb: WandbConfig | None = None
    table_interval_steps: int = 10
    table_rows: int = 8
    queue_size: int = 1000
    max_attempts: int = 3
    backoff_s: float = 1.0

    @classmethod
    def from_spec(
        cls,
        tracking: Mapping[str, Any] | None,
        *,
        run_dir: str | Path,
        run_name: str,
        run_id: str | None = None,
    ) -> TrackingConfig:
        """From ``spec.tracking`` as the API spells it (camelCase); TensorBoard's event files and
        W&B's offline files go under ``run_dir``."""
        spec = tracking or {}
        ml, wb = spec.get("mlflow") or {}, spec.get("wandb") or {}
        mlflow = wandb = None
        if ml.get("trackingUri"):
            experiment = ml.get("experiment") or DEFAULT_EXPERIMENT
            secret = ml.get("credentialsSecret")
            mlflow = MlflowConfig(ml["trackingUri"], experiment, run_name, secret)
        if wb.get("project"):
            wandb_dir, secret = str(Path(run_dir) / "wandb"), wb.get("apiKeySecret")
            wandb = WandbConfig(
                wb["project"], wb.get("entity"), run_name, wb.get("mode"), wandb_dir, secret, run_id
            )
        interval, rows = spec.get("tableIntervalSteps"), spec.get("tableRows")
        return cls(
            tensorboard_dir=str(Path(run_dir) / "tensorboard"),
            mlflow=mlflow,
            wandb=wandb,
            table_interval_steps=cls.table_interval_steps if interval is None else int(interval),
            table_rows=cls.table_rows if rows is None else int(rows),
        )


def scrub(text: str) -> str:
    """``text`` without URL credentials, auth headers, secret query values or any value of the
    credential variables: error texts end up in Events, which many more people can read."""
    text = re.sub(r"(?<=://)[^/\s@]+@", "***@", text)
    text = re.sub(r"(?i)\b(bearer|basic|token)\s+[\w.~+/=-]+", r"\1 ***", text)
    text = re.sub(r"(?i)([?&](?:token|key|api_key|password|secret)=)[^&\s'\"]+", r"\1***", text)
    for name in _SECRET_ENV:
        if value := os.environ.get(name):
            text = text.replace(value, "***")
    return text[:_MAX_ERROR_CHARS]


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A spec as dotted keys (``algorithm.groupSize``); scalars and lists of scalars as JSON."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat |= flatten_params(value, name)
        elif isinstance(value, list | tuple) and any(isinstance(v, Mapping) for v in value):
            flat |= flatten_params({str(i): v for i, v in enumerate(value)}, name)
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return flat


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric fields of a step record, nested dicts joined with ``/``; the rest is skipped."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        if prefix or key not in _NOT_METRICS:
            name = f"{prefix}/{key}" if prefix else str(key)
            if isinstance(value, Mapping):
                flat |= flatten_metrics(value, name)
            elif _is_number(value):
                flat[name] = float(value)
    return flat


def mlflow_name(key: str) -> str:
    """`key` as MLflow accepts a metric name (letters, digits, ``_-. /``): ``pass@4`` is
    ``pass_at_4``; MLflow refuses a whole batch for one bad name."""
    return re.sub(r"[^\w\-. /]", "_", key.replace("@", "_at_"))


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _table(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Columns in order of first appearance; a column stays numeric only if all of it is (W&B
    types a column by its first value), otherwise it becomes text."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    numeric = {c: all(_is_number(r.get(c)) for r in rows) for c in columns}
    text = {c: ["" if r.get(c) is None else str(r.get(c)) for r in rows] for c in columns}
    cells = {c: [r.get(c) for r in rows] if numeric[c] else text[c] for c in columns}
    return columns, [[cells[c][i] for c in columns] for i in range(len(rows))]


def _markdown(columns: list[str], data: list[list[Any]]) -> str:
    """A Markdown table, which TensorBoard's text tab renders."""

    def line(cells: list[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", "<br>") for c in cells)

    return "\n".join([line(columns), "|" + " --- |" * len(columns), *map(line, data)])


class _TensorBoard:
    """Event files through torch's SummaryWriter (needs the ``tensorboard`` package)."""

    name = "tensorboard"

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.writer: Any = None

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=self.log_dir)

    def params(self, params: dict[str, str]) -> None:
        rows = [[key, params[key]] for key in sorted(params)]
        self.writer.add_text("params", _markdown(["key", "value"], rows))

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)

    def table(self, step: int, columns: list[str], data: list[list[Any]]) -> None:
        self.writer.add_text("samples", _markdown(columns, data), step)

    def close(self, failed: bool) -> None:
        self.writer.close()


class _Mlflow:
    """One MLflow run, resumed by name when the experiment has it (a restarted driver logs on
    into the same run). Tables are JSON artifacts in the ``split`` layout that
    ``MlflowClient.log_table`` writes, without needing pandas."""

    name = "mlflow"

    def __init__(self, config: MlflowConfig) -> None:
        self.config, self.run_id = config, ""
        self.client: Any = None

    def open(self) -> None:
        from mlflow.tracking import MlflowClient

        client, name = MlflowClient(tracking_uri=self.config.tracking_uri), self.config.run_name
        found = client.get_experiment_by_name(experiment := self.config.experiment)
        experiment = found.experiment_id if found else client.create_experiment(experiment)
        runs: list[Any] = []
        if name and "'" not in name:
            query = f"attributes.run_name = '{name}'"
            order = ["attributes.start_time DESC"]
            runs = client.search_runs([experiment], query, max_results=1, order_by=order)
        if runs:
            self.run_id = runs[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = client.create_run(experiment, run_name=name).info.run_id
        self.client = client

    def params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v[:_MLFLOW_PARAM_LENGTH]) for k, v in params.items()]
        for i in range(0, len(items), _MLFLOW_PARAM_CHUNK):
            self.client.log_batch(self.run_id, params=items[i : i + _MLFLOW_PARAM_CHUNK])

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(mlflow_name(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), _MLFLOW_METRIC_CHUNK):
            self.client.log_batch(self.run_id, metrics=items[i : i + _MLFLOW_METRIC_CHUNK])

    def table(self, step: int, columns: list[str], data: list[list[Any]]) -> None:
        table = {"columns": columns, "data": data}
        self.client.log_dict(self.run_id, table, f"tables/step_{step:08d}.json")

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class _Wandb:
    """One W&B run. wandb reads WANDB_API_KEY itself; without it the run is offline and its
    files stay under ``dir`` for a later ``wandb sync``."""

    name = "wandb"

    def __init__(self, config: WandbConfig) -> None:
        self.config = config
        self.run: Any = None

    def mode(self) -> str:
        online = bool(os.environ.get("WANDB_API_KEY"))
        mode = self.config.mode or ("online" if online else "offline")
        return "offline" if mode == "online" and not online else mode

    def open(self) -> None:
        import wandb

        config = self.config
        if config.dir:
            Path(config.dir).mkdir(parents=True, exist_ok=True)
        # console="off": the driver's log already goes to the pod's log, and wrapping stdout
        # from this thread would race the trainer's own writers.
        self.run = wandb.init(
            project=config.project,
            entity=config.entity,
            name=config.run_name,
            id=config.run_id,
            resume="allow" if config.run_id else None,
            dir=config.dir,
            mode=self.mode(),  # type: ignore[arg-type]
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )

    def params(self, params: dict[str, str]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def table(self, step: int, columns: list[Any], data: list[list[Any]]) -> None:
        import wandb

        self.run.log({"samples": wandb.Table(columns=columns, data=data)}, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


Backend = _TensorBoard | _Mlflow | _Wandb
_Op = tuple[str, tuple[Any, ...]]  # a backend method's name and its arguments


class _Channel:
    """One backend's bounded queue and the thread that drains it. The backend is opened there,
    lazily: imports and connections never happen on the caller's thread."""

    def __init__(self, backend: Backend, config: TrackingConfig, report: FailureCallback) -> None:
        self.backend, self.name, self.failures, self.dropped = backend, backend.name, 0, 0
        self._config, self._report = config, report
        self._items: deque[_Op] = deque()
        self._cond, self._abort = threading.Condition(), threading.Event()
        self._closing = self._opened = self._disabled = False
        self._thread = threading.Thread(target=self._run, name=f"tracking-{self.name}", daemon=True)
        self._thread.start()

    def put(self, op: _Op) -> None:
        with self._cond:
            if self._closing or self._disabled:
                return
            if len(self._items) >= self._config.queue_size:
                self._items.popleft()
                self.dropped += 1
            self._items.append(op)
            self._cond.notify()

    def close(self, failed: bool) -> None:
        with self._cond:
            if not self._closing:
                self._closing = True
                self._items.append(("close", (failed,)))  # beyond the bound: never dropped
                self._cond.notify()

    def join(self, timeout_s: float) -> bool:
        """Wait for the queue to drain; past the timeout, abandon what is left (counted)."""
        self._thread.join(max(0.0, timeout_s))
        if not self._thread.is_alive():
            return True
        with self._cond:
            self._abort.set()
            self._discard()
            self._cond.notify()
        return False

    def _discard(self) -> None:
        self.dropped += sum(op[0] != "close" for op in self._items)
        self._items.clear()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._abort.is_set():
                    self._cond.wait()
                if self._abort.is_set():
                    return
                op = self._items.popleft()
            if op[0] != "close" or self._opened:
                self._attempt(op)
            if op[0] == "close":
                return

    def _attempt(self, op: _Op) -> None:
        delay, error = self._config.backoff_s, ""
        for attempt in range(1, self._config.max_attempts + 1):
            try:
                if not self._opened:
                    self.backend.open()
                    self._opened = True
                getattr(self.backend, op[0])(*op[1])
                return
            except ImportError as exc:  # the client library is not installed: stop trying
                with self._cond:
                    self._disabled = True
                    self._discard()
                self._fail(f"{self.name} is not available: {exc}")
                return
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            if attempt < self._config.max_attempts and self._abort.wait(delay):
                break
            delay *= 2
        self._fail(error)

    def _fail(self, error: str) -> None:
        with self._cond:
            self.failures += 1
        self._report(self.name, scrub(error))


class Tracker:
    """One run's experiment tracking. Every method returns at once and never raises."""

    def __init__(self, config: TrackingConfig, on_failure: FailureCallback | None = None) -> None:
        self.config, self._on_failure = config, on_failure
        backends: list[Backend] = [_TensorBoard(config.tensorboard_dir)]
        if config.mlflow is not None:
            for key, value in _MLFLOW_HTTP_DEFAULTS.items():
                os.environ.setdefault(key, value)
            backends.append(_Mlflow(config.mlflow))
        if config.wandb is not None:
            backends.append(_Wandb(config.wandb))
        self._channels = {b.name: _Channel(b, config, self._report) for b in backends}

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self._channels)

    @property
    def failures(self) -> dict[str, int]:
        """Per backend: calls given up after every retry (or a client library missing)."""
        return {name: channel.failures for name, channel in self._channels.items()}

    @property
    def dropped(self) -> dict[str, int]:
        """Per backend: calls never made, pushed out of a full queue or left at close."""
        return {name: channel.dropped for name, channel in self._channels.items()}

    def table_due(self, step: int) -> bool:
        """Whether ``step`` is one to sample a table at (the caller builds rows only then)."""
        interval = self.config.table_interval_steps
        return interval > 0 and self.config.table_rows > 0 and step % interval == 0

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._submit("params", lambda: (flatten_params(params),))

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._submit("metrics", lambda: (step, flatten_metrics(metrics)))

    def log_table(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        if rows:
            self._submit("table", lambda: (step, *_table(rows[: self.config.table_rows])))

    def close(self, timeout_s: float = 30.0, *, failed: bool = False) -> bool:
        """Flush every backend within ``timeout_s`` in all; True when all of them finished."""
        deadline = time.monotonic() + timeout_s
        for channel in self._channels.values():
            channel.close(failed)
        flushed = True
        for channel in self._channels.values():
            flushed = channel.join(deadline - time.monotonic()) and flushed
        if not flushed:
            logger.warning("tracking not flushed in %.1fs; dropped %s", timeout_s, self.dropped)
        return flushed

    def _submit(self, method: str, build: Callable[[], tuple[Any, ...]]) -> None:
        """Snapshot the values now (the caller may reuse its dicts), then enqueue everywhere."""
        try:
            op = (method, build())
            for channel in self._channels.values():
                channel.put(op)
        except Exception as exc:  # a malformed record must not fail a training step
            self._report("tracker", scrub(f"{method}: {type(exc).__name__}: {exc}"))

    def _report(self, backend: str, error: str) -> None:
        logger.warning("tracking backend %s failed: %s", backend, error)
        if self._on_failure is not None:
            try:
                self._on_failure(backend, error)
            except Exception as exc:
                logger.warning("tracking: on_failure raised %s", type(exc).__name__)
