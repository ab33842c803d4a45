"""Steps per second, the ETA and the latest reward, from the heartbeat's step times."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from rlhf_operator.progress import SMOOTHING, advance, eta
from rlhfjob.api import Progress
from rlhfjob.contract import LeaseReport

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def beat(step: int | None, seconds: float | None, **more: float) -> LeaseReport:
    changed = at(seconds) if seconds is not None else None
    return LeaseReport(step=step, step_changed=changed, **more)  # type: ignore[arg-type]


def test_nothing_known_gives_no_progress() -> None:
    assert advance(None, None, LeaseReport(), 40) is None


def test_the_first_step_seen_sets_the_reference_but_no_rate() -> None:
    first = advance(None, None, beat(3, 10, reward_mean=0.2, tokens_per_second=900.0), 40)
    assert first == Progress(step_time=at(10), reward_mean=0.2, tokens_per_second=900.0)


def test_the_rate_is_measured_on_the_trainers_step_times_and_gives_the_eta() -> None:
    first = advance(None, None, beat(3, 10), 40)
    second = advance(first, 3, beat(7, 18), 40)  # 4 steps in 8 s, whenever the operator looked
    assert second is not None and second.steps_per_second == pytest.approx(0.5)
    assert second.eta == at(18 + 33 / 0.5)


def test_the_rate_is_a_moving_average() -> None:
    first = advance(None, None, beat(0, 0), 100)
    second = advance(first, 0, beat(10, 10), 100)  # 1 step/s
    third = advance(second, 10, beat(12, 14), 100)  # 0.5 step/s
    assert third is not None
    assert third.steps_per_second == pytest.approx(SMOOTHING * 0.5 + (1 - SMOOTHING) * 1.0)


def test_a_restart_moves_the_reference_without_counting_the_downtime() -> None:
    running = advance(advance(None, None, beat(0, 0), 40), 0, beat(10, 10), 40)  # 1 step/s
    resumed = advance(running, 10, beat(8, 100), 40)  # back to the step-8 checkpoint, 90 s later
    assert resumed is not None and resumed.steps_per_second == pytest.approx(1.0)
    assert resumed.step_time == at(100)
    again = advance(resumed, 8, beat(10, 102), 40)  # the new driver trains at 1 step/s
    assert again is not None and again.steps_per_second == pytest.approx(1.0)
    assert again.eta == at(102 + 30)


def test_the_same_step_again_keeps_the_rate() -> None:
    running = advance(advance(None, None, beat(0, 0), 40), 0, beat(10, 5), 40)
    drained = advance(running, 10, beat(10, 60), 40)  # a drained job's driver starts again
    assert drained is not None and drained.steps_per_second == pytest.approx(2.0)
    assert drained.step_time == at(60)


def test_a_finished_run_ends_when_its_last_step_did() -> None:
    assert eta(40, 40, 0.5, at(7)) == at(7)
    assert eta(40, 40, None, at(7)) == at(7)


def test_no_eta_without_a_rate_or_a_total() -> None:
    assert eta(3, None, 1.0, at(0)) is None
    assert eta(3, 40, None, at(0)) is None
    assert eta(3, 10**12, 1e-9, at(0)) is None, "too far out to mean anything"


def test_a_report_without_a_step_keeps_the_rate_and_updates_the_reward() -> None:
    running = advance(advance(None, None, beat(0, 0), 40), 0, beat(10, 10), 40)
    later = advance(running, 10, LeaseReport(reward_mean=0.9), 40)
    assert running is not None and later is not None
    assert later.steps_per_second == running.steps_per_second and later.reward_mean == 0.9


def test_numbers_the_api_cannot_store_are_dropped() -> None:
    shown = advance(None, None, beat(1, 1, reward_mean=float("nan"), tokens_per_second=2.0), 4)
    assert shown is not None and shown.reward_mean is None and shown.tokens_per_second == 2.0
    Progress.model_validate(shown.model_dump())
