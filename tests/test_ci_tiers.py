"""`task test`'s tier runner (`rlhf_local/tiers.py`) and the CI-time record
(`benchmarks/ci_time.py`): what they count, on made-up runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from rlhf_local import tiers

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ci_time() -> Any:
    path = REPO / "benchmarks" / "ci_time.py"
    spec = importlib.util.spec_from_file_location("ci_time", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ci_time"] = module
    spec.loader.exec_module(module)
    return module


def test_a_tier_records_its_time_exit_code_and_pytests_counts() -> None:
    line = "===== 3 passed, 1 skipped in 2.50s ====="
    tier = tiers.Tier("unit", [sys.executable, "-c", f"print({line!r}); raise SystemExit(3)"])
    tiers.run_tier(tier)
    assert tier.exit_code == 3
    assert tier.summary == "3 passed, 1 skipped"
    assert tier.seconds is not None and tier.seconds > 0


def test_the_table_shows_every_tier_and_fails_when_one_did_or_did_not_run() -> None:
    run = tiers.Run(tiers.tiers([]))
    assert [t.name for t in run.tiers] == [
        *("setup", "tools", "lint", "unit", "build", "images", "e2e")
    ]
    for tier in run.tiers[:3]:
        tier.seconds, tier.exit_code = 60.0, 0
    run.tiers[3].seconds, run.tiers[3].exit_code = 120.0, 1
    table = tiers.table(run)
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[1:]}
    assert rows["unit"] == ["2.0", "exit", "1"]
    assert rows["e2e"] == ["-", "not", "run"]
    assert table.splitlines()[-1].split() == ["total", "5.0", "FAILED"]
    for tier in run.tiers:
        tier.exit_code = 0
    assert run.passed


def test_the_last_line_adds_up_every_pytest_tier() -> None:
    run = tiers.Run(tiers.tiers([]))
    run.tiers[3].summary = "1248 passed, 2 skipped"
    run.tiers[6].summary = "2 failed, 56 passed, 1 error"
    assert tiers.closing_line(run) == "tests: 1304 passed, 3 failed, 2 skipped"
    run.tiers[6].summary = None
    assert tiers.closing_line(run) == "tests: 1248 passed, 0 failed, 2 skipped"


def run_record(kind: str, green: bool, failed: list[str] | None = None) -> dict[str, Any]:
    return {"kind": kind, "minutes": 40.0 if kind == "cold" else 30.0, "green": green,
            "date": "2026-12-03T00:00:00+00:00", "failed_tests": failed or []}  # fmt: skip


def test_green_runs_count_since_the_last_red_one_and_its_failures_are_flakes(ci_time: Any) -> None:
    runs = [
        run_record("cold", True),
        run_record("warm", False, ["e2e/tests/test_faults.py::test_4"]),
        run_record("warm", True),
        run_record("warm", True),
    ]
    summary = ci_time.summarise("abc", runs)
    assert summary["consecutive_green_runs"] == 2
    assert summary["flaky_tests"] == 1
    assert summary["flaky_test_names"] == ["e2e/tests/test_faults.py::test_4"]
    assert (summary["cold_minutes"], summary["warm_minutes"]) == (40.0, 30.0)


def test_a_failure_no_run_passed_is_a_failure_not_a_flake(ci_time: Any) -> None:
    summary = ci_time.summarise("abc", [run_record("cold", False, ["tests/test_x.py::test_y"])])
    assert (summary["consecutive_green_runs"], summary["flaky_tests"]) == (0, 0)
    assert summary["warm_minutes"] is None
