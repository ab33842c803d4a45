"""The soak's figures (`rlhf_local.soak`) from step logs and samples made up here: goodput
and where the rest went, and the memory growth per hour."""

from __future__ import annotations

import pytest

from rlhf_local import soak


def step(number: int, at: float, attempt: int = 0, seconds: float = 1.0) -> dict[str, object]:
    return {"step": number, "time": at, "step_seconds": seconds, "attempt": attempt}


def test_goodput_counts_each_kept_step_once_and_says_where_the_rest_went() -> None:
    # Steps 1-10 each take 1 s from t=0; a fault at t=10.5 kills the driver; the next attempt
    # resumes from the checkpoint at step 8 and trains steps 9-12 from t=20.
    records = [step(n, n) for n in range(1, 11)]
    records += [step(n, 20 + (n - 8), attempt=1) for n in range(9, 13)]
    fault = soak.FaultResult("kill_driver", 10.5, recovered=True, recovered_s=10.5)  # at t=21
    figures = soak.goodput(records, [fault], ended=24.0)
    assert figures["steps_kept"] == 12 and figures["steps_trained"] == 14
    assert figures["kept_training_s"] == 12.0
    assert figures["retrained_s"] == 2.0  # steps 9 and 10, trained twice
    assert figures["wall_s"] == 24.0
    assert figures["recovering_s"] == pytest.approx(9.5)  # 10.5 s less step 9's second second
    assert figures["goodput"] == pytest.approx(0.5)


def test_growth_per_hour_is_the_slope_after_the_warm_up() -> None:
    # 10 MiB more every 360 s (100 MiB an hour), after a first sample far above the line.
    samples = [{"t": 0.0, "operator": {"rss_mb": 900.0}}]
    samples += [{"t": 360.0 * i, "operator": {"rss_mb": 100.0 + 10 * i}} for i in range(1, 11)]
    assert soak.operator_growth(samples, 0.0, 3600.0) == pytest.approx(100.0)
    assert soak.slope_per_hour([(0.0, 5.0), (10.0, 5.0), (20.0, 5.0)]) == 0.0
    assert soak.slope_per_hour([(0.0, 1.0)]) is None


def test_the_trainers_growth_is_of_its_longest_lived_processes() -> None:
    """A drain replaces the policy rank: each process is judged on its own lifetime, and one
    too short to say anything is listed but not judged."""
    samples = [
        {"t": float(t), "policy_rank": {"pid": 1, "rss_mb": 500.0 + t / 3600 * 12}}
        for t in range(0, 1800, 60)
    ]
    samples += [
        {"t": float(t), "policy_rank": {"pid": 2, "rss_mb": 900.0 + t}}
        for t in range(1800, 1900, 30)
    ]
    slope, segments = soak.trainer_growth(samples)
    assert slope == pytest.approx(12.0)
    assert [s["pid"] for s in segments] == [1, 2]
    assert segments[1]["slope_mb_per_hour"] is None


class Logged:
    """What `recovered_at` reads of a soak: the step log (the live job's, here made up)."""

    def __init__(self, records: list[dict[str, object]]) -> None:
        self.records = records

    def steps_after(self, when: float) -> list[dict[str, object]]:
        return [r for r in self.records if float(r["time"]) > when]  # type: ignore[arg-type]


def test_a_drained_job_recovers_with_its_first_step_after_the_drain_same_attempt() -> None:
    # Steps to t=10; the drain strikes at 10.5 and returns at 12 (the driver checkpointed and
    # stopped); the job trains on from t=30 on another cluster, attempt number unchanged.
    records = [step(n, n) for n in range(1, 11)] + [step(n, 20 + n) for n in range(11, 14)]
    assert soak.recovered_at(Logged(records), "node_drain", 0, 10.5, 12.0) == 31.0
    assert soak.recovered_at(Logged(records[:10]), "node_drain", 0, 10.5, 12.0) is None
    # A killed driver's recovery is a new attempt's step: the same log shows none.
    assert soak.recovered_at(Logged(records), "kill_driver", 0, 10.5, 12.0) is None


def test_a_short_leak_check_compares_the_last_sample_with_the_first_that_has_the_process() -> None:
    samples = [
        {"t": 0.0, "operator": None},  # the API server was the fault of the moment
        {"t": 1.0, "operator": {"rss_mb": 100.0, "fds": 20, "threads": 12}},
        {"t": 2.0, "operator": {"rss_mb": 101.0, "fds": 31, "threads": 12}},
        {"t": 3.0, "operator": {"rss_mb": 101.0, "fds": 23, "threads": 13}},
    ]
    assert soak.process_growth(samples, "operator") == {"fds": 3, "threads": 1}
    assert soak.process_growth(samples[:2], "operator") is None


def test_a_plan_strikes_every_fault_in_turn_unless_told_and_refuses_unknown_ones() -> None:
    assert soak.Plan(10, 2).in_turn == tuple(soak.FAULTS)
    assert soak.Plan(10, 2, ("kill_driver",)).in_turn == ("kill_driver",)
    with pytest.raises(ValueError, match="unknown faults \\['reboot'\\]"):
        soak.Plan(10, 2, ("kill_driver", "reboot"))
