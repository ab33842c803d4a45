"""Experiment tracking against the real thing: TensorBoard's event files read back with its own
reader, a real MLflow server read back through the MLflow client, W&B's offline run read back
with W&B's record schema, and MLflow servers that refuse or never answer."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# Imported here so that no worker thread of the tracker pays for torch's import inside a test's
# close() deadline.
from torch.utils.tensorboard import SummaryWriter  # noqa: F401

from rlhf_local import tracking_server
from rlhf_local.procs import free_port
from rlhf_trainer.run.tracking import (
    MlflowConfig,
    Tracker,
    TrackingConfig,
    WandbConfig,
    flatten_metrics,
    flatten_params,
    mlflow_name,
    scrub,
)

SPEC = {
    "algorithm": {"name": "grpo", "groupSize": 8, "kl": {"coef": 0.05}},
    "rewards": [{"name": "format", "weight": 0.5}, {"name": "answer", "weight": 1.0}],
    "stop": ["\n\n"],
    "seed": None,
}
ROWS = [
    {"prompt": "2+2?", "response": "4 | sure\nok", "reward": 1.0},
    {"prompt": "3+3?", "response": "7", "reward": 0.0},
    {"prompt": "1+1?", "response": "2", "reward": 1.0, "note": "extra column"},
]
STEPS = (1, 2, 3)


def record(step: int) -> dict[str, Any]:
    """A step-log record as the trainer writes it: numbers, nested dicts, and a few non-metrics."""
    return {
        "step": step,
        "time": 1.7e9 + step,
        "reward_mean": 0.25 * step,
        "kl": None,
        "phase": "train",
        "reward_components": {"format": 0.5, "answer": float(step)},
        "staleness": {"0": 4},
    }


def config(tmp_path: Path, **fields: Any) -> TrackingConfig:
    return TrackingConfig(tensorboard_dir=str(tmp_path / "tensorboard"), **fields)


def log_run(tracker: Tracker, steps: tuple[int, ...] = STEPS, table_step: int = 2) -> None:
    tracker.log_params(SPEC)
    for step in steps:
        tracker.log_metrics(step, record(step))
        if step == table_step:
            tracker.log_table(step, ROWS)


def test_flattening_keys_params_and_metrics() -> None:
    assert flatten_params(SPEC) == {
        "algorithm.name": "grpo",
        "algorithm.groupSize": "8",
        "algorithm.kl.coef": "0.05",
        "rewards.0.name": "format",
        "rewards.0.weight": "0.5",
        "rewards.1.name": "answer",
        "rewards.1.weight": "1.0",
        "stop": '["\\n\\n"]',
        "seed": "null",
    }
    assert flatten_metrics(record(2)) == {
        "reward_mean": 0.5,
        "reward_components/format": 0.5,
        "reward_components/answer": 2.0,
        "staleness/0": 4.0,
    }


def test_scrub_removes_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-123456")
    text = scrub(
        "POST https://bob:pa55@mlflow.example/api failed; Authorization: Bearer abc.def "
        "?api_key=zzz&x=1 echo tok-123456"
    )
    for secret in ("pa55", "bob", "abc.def", "zzz", "tok-123456"):
        assert secret not in text
    assert "https://***@mlflow.example/api" in text


def test_config_from_spec_maps_the_api_fields(tmp_path: Path) -> None:
    spec = {
        "mlflow": {
            "trackingUri": "https://mlflow.example",
            "experiment": "exp",
            "credentialsSecret": "creds",
        },
        "wandb": {"project": "p", "entity": "team", "apiKeySecret": "wb", "mode": "offline"},
        "tableIntervalSteps": 0,
        "tableRows": 4,
    }
    built = TrackingConfig.from_spec(spec, run_dir=tmp_path, run_name="job-1", run_id="uid-1")
    assert built.tensorboard_dir == str(tmp_path / "tensorboard")
    assert built.mlflow == MlflowConfig("https://mlflow.example", "exp", "job-1", "creds")
    assert built.wandb == WandbConfig(
        "p", "team", "job-1", "offline", str(tmp_path / "wandb"), "wb", "uid-1"
    )
    assert (built.table_interval_steps, built.table_rows) == (0, 4)
    bare = TrackingConfig.from_spec(None, run_dir=tmp_path, run_name="job-1")
    assert (bare.mlflow, bare.wandb, bare.table_interval_steps) == (None, None, 10)


def test_tensorboard_event_files_hold_the_logged_values(tmp_path: Path) -> None:
    reported: list[tuple[str, str]] = []
    tracker = Tracker(config(tmp_path, table_interval_steps=2), lambda *f: reported.append(f))
    assert [step for step in range(7) if tracker.table_due(step)] == [0, 2, 4, 6]
    log_run(tracker)
    tracker.log_metrics(4, None)  # type: ignore[arg-type]  # reported, never raised
    assert tracker.close(timeout_s=120)
    assert [backend for backend, _ in reported] == ["tracker"]
    assert tracker.failures == {"tensorboard": 0} and tracker.dropped == {"tensorboard": 0}

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"reward_mean", "reward_components/answer", "staleness/0"} <= scalars
    assert not scalars & {"step", "time", "kl", "phase"}
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [
        (1, 0.25),
        (2, 0.5),
        (3, 0.75),
    ]
    [table] = events.Tensors("samples/text_summary")
    text = table.tensor_proto.string_val[0].decode()
    assert table.step == 2
    assert "| prompt | response | reward | note" in text
    assert "4 \\| sure<br>ok" in text and "extra column" in text
    [params] = events.Tensors("params/text_summary")
    assert "| algorithm.groupSize | 8" in params.tensor_proto.string_val[0].decode()


def test_a_refusing_mlflow_reports_and_never_holds_up_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "env-secret-value")
    reported: list[tuple[str, str]] = []
    failed = threading.Event()

    def on_failure(backend: str, error: str) -> None:
        reported.append((backend, error))
        failed.set()

    uri = f"http://alice:hunter2@127.0.0.1:{free_port()}"  # nothing listens there
    mlflow = MlflowConfig(uri, run_name="refused")
    tracker = Tracker(config(tmp_path, mlflow=mlflow, max_attempts=2, backoff_s=0.01), on_failure)
    slowest = 0.0
    for step in range(200):
        start = time.monotonic()
        tracker.log_metrics(step, record(step))
        tracker.log_table(step, ROWS)
        slowest = max(slowest, time.monotonic() - start)
    assert slowest < 1.0  # a queue append; generous for a loaded machine

    assert failed.wait(timeout=300)
    start = time.monotonic()
    tracker.close(timeout_s=3)
    assert time.monotonic() - start < 3 + 2
    assert tracker.failures["mlflow"] >= 1 and tracker.failures["tensorboard"] == 0
    assert {backend for backend, _ in reported} == {"mlflow"}
    ours = [r.getMessage() for r in caplog.records if r.name == "rlhf_trainer.run.tracking"]
    for text in [error for _, error in reported] + ours:
        assert "hunter2" not in text and "env-secret-value" not in text
    assert any("Connection" in error or "connect" in error for _, error in reported)


def test_a_hung_mlflow_is_abandoned_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that accepts connections and never answers: the worker stays blocked in its
    first request while the queue stays bounded and TensorBoard goes on."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "600")
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)  # the kernel completes connections; nobody ever reads them
        mlflow = MlflowConfig(f"http://127.0.0.1:{hung.getsockname()[1]}", run_name="hung")
        tracker = Tracker(config(tmp_path, mlflow=mlflow, queue_size=5))
        start = time.monotonic()
        for step in range(50):
            tracker.log_metrics(step, record(step))
        assert time.monotonic() - start < 5.0
        assert tracker.dropped["mlflow"] >= 50 - 5 - 1  # one may be in flight

        start = time.monotonic()
        assert not tracker.close(timeout_s=3)
        assert time.monotonic() - start < 3 + 2
    assert tracker.dropped["mlflow"] >= 49 and tracker.failures["tensorboard"] == 0
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Scalars("reward_mean")[-1].step == 49  # the same bound, but TensorBoard drains


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    with tracking_server.mlflow_server(tmp_path / "mlflow") as uri:
        yield uri


@pytest.mark.slow
def test_mlflow_run_holds_params_metrics_and_table(tmp_path: Path, mlflow_server: str) -> None:
    from mlflow.tracking import MlflowClient

    reported: list[tuple[str, str]] = []
    mlflow = MlflowConfig(mlflow_server, experiment="tracking-test", run_name="job-1")
    tracker = Tracker(config(tmp_path, mlflow=mlflow), lambda *failure: reported.append(failure))
    log_run(tracker)
    assert tracker.close(timeout_s=300), tracker.dropped
    assert reported == [] and tracker.failures == {"tensorboard": 0, "mlflow": 0}

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("tracking-test")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    assert (run.info.run_name, run.info.status) == ("job-1", "FINISHED")
    assert run.data.params["algorithm.groupSize"] == "8"
    assert run.data.params["rewards.1.name"] == "answer"
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5), (3, 0.75)]
    answer = client.get_metric_history(run.info.run_id, "reward_components/answer")
    assert sorted((m.step, m.value) for m in answer) == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert "kl" not in run.data.metrics and "step" not in run.data.metrics
    path = client.download_artifacts(run.info.run_id, "tables/step_00000002.json", str(tmp_path))
    table = json.loads(Path(path).read_text())
    assert table["columns"] == ["prompt", "response", "reward", "note"]
    assert table["data"][0] == ["2+2?", "4 | sure\nok", 1.0, ""]

    # A restarted driver resumes the run of the same name and goes on from its step.
    tracker = Tracker(config(tmp_path, mlflow=mlflow))
    tracker.log_metrics(4, record(4))
    assert tracker.close(timeout_s=300) and tracker.failures["mlflow"] == 0
    [resumed] = client.search_runs([experiment.experiment_id])
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` file: LevelDB's log format (32 KiB blocks of chunks with a
    7-byte header) after a 7-byte ``:W&B`` header, each record a W&B protobuf ``Record``. This
    wandb release ships no Python reader, so the framing is read here and the schema is wandb's."""
    from wandb.proto.wandb_internal_pb2 import Record  # type: ignore[attr-defined]

    data, block, position, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's zero-filled tail
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL, FIRST / MIDDLE, LAST
        if kind in (1, 4):
            parsed = Record()
            parsed.ParseFromString(pending)
            yield parsed


def test_wandb_offline_run_holds_the_logged_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    reported: list[tuple[str, str]] = []
    wandb = WandbConfig("tracking-test", run_name="job-1", dir=str(tmp_path / "wandb"))
    tracker = Tracker(config(tmp_path, wandb=wandb), lambda *failure: reported.append(failure))
    log_run(tracker)
    assert tracker.close(timeout_s=300), tracker.dropped
    assert reported == [] and tracker.failures == {"tensorboard": 0, "wandb": 0}

    [run_dir] = (tmp_path / "wandb" / "wandb").glob("offline-run-*")
    [log] = run_dir.glob("run-*.wandb")
    history: dict[int, dict[str, Any]] = {}
    config_values: dict[str, Any] = {}
    for item in wandb_records(log):
        kind = item.WhichOneof("record_type")
        if kind == "history":
            values = {i.key or "/".join(i.nested_key): i.value_json for i in item.history.item}
            history[item.history.step.num] = values
        elif kind == "config":
            config_values |= {
                u.key or ".".join(u.nested_key): u.value_json for u in item.config.update
            }
    assert json.loads(config_values["algorithm.groupSize"]) == "8"
    assert {step: json.loads(history[step]["reward_mean"]) for step in STEPS} == {
        1: 0.25,
        2: 0.5,
        3: 0.75,
    }
    assert json.loads(history[3]["reward_components/answer"]) == 3.0
    table_file = json.loads(history[2]["samples/path"])
    table = json.loads((run_dir / "files" / table_file).read_text())
    assert table["columns"] == ["prompt", "response", "reward", "note"]
    assert table["data"][1] == ["3+3?", "7", 0.0, ""]


def test_metric_names_mlflow_refuses_are_rewritten() -> None:
    assert mlflow_name("eval/pass@4") == "eval/pass_at_4"
    assert mlflow_name("eval/arithmetic/add:x") == "eval/arithmetic/add_x"
    assert mlflow_name("phase_seconds/update") == "phase_seconds/update"
