"""Trainer metrics: names follow Prometheus conventions, values show up in the exposition."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rlhf_trainer.run import metrics as m
from rlhf_trainer.run.metrics import TrainerMetrics, serve_metrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class FakeClock:
    """Test double for ``time.monotonic``: advances only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def parse_exposition(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(metrics: TrainerMetrics) -> Samples:
    return parse_exposition(generate_latest(metrics.registry).decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_names_follow_prometheus_conventions() -> None:
    assert len(set(m.METRIC_NAMES)) == len(m.METRIC_NAMES)
    assert all(name.startswith("rlhf_trainer_") for name in m.METRIC_NAMES)
    families = {
        family.name: family.type
        for family in text_string_to_metric_families(
            generate_latest(TrainerMetrics().registry).decode()
        )
    }
    for name in m.METRIC_NAMES:
        family = name.removesuffix("_total")
        assert family in families, name
        kind = families[family]
        assert (kind == "counter") == name.endswith("_total"), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name


def test_every_phase_is_exposed_before_it_is_observed() -> None:
    samples = scrape(TrainerMetrics())
    for phase in m.PHASES:
        assert value(samples, m.PHASE_DURATION_SECONDS + "_count", phase=phase) == 0


def test_phase_timing(clock: FakeClock) -> None:
    metrics = TrainerMetrics(clock=clock)
    with metrics.time_phase(m.PHASE_GENERATE):
        clock.advance(2.5)
    with pytest.raises(RuntimeError), metrics.time_phase(m.PHASE_UPDATE):
        clock.advance(0.75)
        raise RuntimeError("OOM")  # a failed phase is still timed
    metrics.observe_phase(m.PHASE_GENERATE, 1.5)

    samples = scrape(metrics)
    generate_count = value(samples, m.PHASE_DURATION_SECONDS + "_count", phase="generate")
    assert generate_count == 2
    assert value(samples, m.PHASE_DURATION_SECONDS + "_sum", phase="generate") == 4.0
    assert value(samples, m.PHASE_DURATION_SECONDS + "_sum", phase="update") == 0.75
    # 2.5 s lands in the le=2.5 bucket, 1.5 s too; neither is <= 1
    assert value(samples, m.PHASE_DURATION_SECONDS + "_bucket", phase="generate", le="1.0") == 0
    assert value(samples, m.PHASE_DURATION_SECONDS + "_bucket", phase="generate", le="2.5") == 2


def test_unknown_phase_is_rejected() -> None:
    metrics = TrainerMetrics()
    with pytest.raises(ValueError, match="unknown phase 'rollout'"):
        metrics.observe_phase("rollout", 1.0)
    with pytest.raises(ValueError, match="unknown phase"), metrics.time_phase("rollout"):
        pass


def test_generation_sync_and_checkpoint_counters() -> None:
    metrics = TrainerMetrics()
    metrics.record_generation(num_tokens=1000, seconds=4.0)
    metrics.record_generation(num_tokens=300, seconds=0.5)
    metrics.record_weight_sync(seconds=0.2, num_bytes=4096)
    metrics.record_weight_sync(seconds=0.3, num_bytes=1024)
    metrics.record_checkpoint()

    samples = scrape(metrics)
    assert value(samples, m.GENERATED_TOKENS_TOTAL) == 1300
    assert value(samples, m.GENERATED_TOKENS_PER_SECOND) == 600  # the last rollout: 300 / 0.5
    assert value(samples, m.WEIGHT_SYNC_BYTES_TOTAL) == 5120
    assert value(samples, m.WEIGHT_SYNC_DURATION_SECONDS + "_count") == 2
    assert value(samples, m.WEIGHT_SYNC_DURATION_SECONDS + "_sum") == pytest.approx(0.5)
    assert value(samples, m.CHECKPOINTS_TOTAL) == 1


def test_end_step_sets_gauges_and_keeps_unreported_ones(clock: FakeClock) -> None:
    metrics = TrainerMetrics(clock=clock)
    clock.advance(3.0)
    metrics.end_step(
        5, reward_mean=0.5, reward_std=0.25, kl=0.01, policy_loss=-0.2, value_loss=1.5,
        policy_version_lag=1,
    )  # fmt: skip
    clock.advance(2.0)
    metrics.end_step(6, reward_mean=0.75, reward_std=0.125)

    samples = scrape(metrics)
    assert value(samples, m.STEP) == 6
    assert value(samples, m.REWARD_MEAN) == 0.75
    assert value(samples, m.REWARD_STD) == 0.125
    assert value(samples, m.KL) == 0.01  # not reported in step 6: keeps the last value
    assert value(samples, m.POLICY_LOSS) == -0.2
    assert value(samples, m.VALUE_LOSS) == 1.5
    assert value(samples, m.POLICY_VERSION_LAG) == 0
    assert value(samples, m.STEP_DURATION_SECONDS + "_count") == 2
    assert value(samples, m.STEP_DURATION_SECONDS + "_sum") == 5.0


def test_jsonl_log_has_one_line_per_step_with_the_same_numbers(
    tmp_path: Path, clock: FakeClock
) -> None:
    log = tmp_path / "run" / "metrics.jsonl"
    metrics = TrainerMetrics(jsonl_path=log, clock=clock)
    metrics.begin_step()
    with metrics.time_phase(m.PHASE_GENERATE):
        clock.advance(2.0)
    metrics.record_generation(num_tokens=500, seconds=2.0)
    metrics.record_weight_sync(seconds=0.5, num_bytes=100)
    metrics.record_checkpoint()
    clock.advance(1.0)
    first = metrics.end_step(
        1, reward_mean=0.5, reward_std=0.1, kl=0.02, policy_loss=0.3, extra={"entropy": 2.0}
    )
    metrics.end_step(2, reward_mean=0.6, reward_std=0.1)

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0] == first
    assert first["step"] == 1
    assert first["step_seconds"] == 3.0
    assert first["phase_seconds"] == {"generate": 2.0}
    assert first["generated_tokens"] == 500
    assert first["generated_tokens_per_second"] == 250.0
    assert first["weight_sync_seconds"] == 0.5
    assert first["weight_sync_bytes"] == 100
    assert first["checkpoints"] == 1
    assert (first["reward_mean"], first["kl"], first["policy_loss"]) == (0.5, 0.02, 0.3)
    assert first["value_loss"] is None
    assert first["entropy"] == 2.0
    # per-step accumulators start again at zero
    second = lines[1]
    assert second["step"] == 2
    assert second["phase_seconds"] == {}
    assert (second["generated_tokens"], second["checkpoints"]) == (0, 0)
    assert second["generated_tokens_per_second"] is None
    assert set(first) - {"entropy"} == set(second) == m._STANDARD_RECORD_KEYS


def test_rollout_engines_and_the_attempt_are_in_every_record(tmp_path) -> None:
    log = tmp_path / "metrics.jsonl"
    metrics = TrainerMetrics(jsonl_path=log, attempt=3)
    first = metrics.end_step(1, reward_mean=0.0, reward_std=0.0)
    assert (first["rollout_engines"], first["attempt"]) == (None, 3)  # not reported yet
    metrics.set_rollout_engines(live=1, desired=2)
    second = metrics.end_step(2, reward_mean=0.0, reward_std=0.0)
    assert (second["rollout_engines"], second["attempt"]) == (1, 3)
    assert [json.loads(line)["rollout_engines"] for line in log.read_text().splitlines()] == [
        None,
        1,
    ]
    samples = scrape(metrics)
    assert value(samples, m.ROLLOUT_ENGINES, state="live") == 1
    assert value(samples, m.ROLLOUT_ENGINES, state="desired") == 2
    metrics.record_startup(4.5)
    assert value(scrape(metrics), m.STARTUP_SECONDS) == 4.5
    metrics.record_dataset(kept=7, truncated=2, skipped=0)
    assert value(scrape(metrics), m.DATASET_PROMPTS, outcome="kept") == 7
    assert value(scrape(metrics), m.DATASET_PROMPTS, outcome="truncated") == 2
    assert value(scrape(metrics), m.DATASET_PROMPTS, outcome="skipped") == 0


def test_extra_fields_cannot_shadow_standard_ones() -> None:
    with pytest.raises(ValueError, match="reward_mean"):
        TrainerMetrics().end_step(1, reward_mean=0.0, reward_std=0.0, extra={"reward_mean": 1.0})


def test_instances_do_not_share_state() -> None:
    first, second = TrainerMetrics(), TrainerMetrics()
    first.record_checkpoint()
    assert value(scrape(first), m.CHECKPOINTS_TOTAL) == 1
    assert value(scrape(second), m.CHECKPOINTS_TOTAL) == 0


def test_served_over_http() -> None:
    metrics = TrainerMetrics()
    metrics.end_step(42, reward_mean=0.9, reward_std=0.0)
    server = serve_metrics(metrics.registry, port=0, address="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            samples = parse_exposition(response.read().decode())
    finally:
        server.stop()
    assert value(samples, m.STEP) == 42
    assert value(samples, m.REWARD_MEAN) == 0.9
