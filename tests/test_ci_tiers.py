"""`task test`'s tier runner (`rlhf_local/tiers.py`) and the CI-time record
(`benchmarks/ci_time.py`): what they count, on made-up runs."""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import time
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
    assert [t.name for t in run.tiers] == ["setup", "tools", "lint", "unit", "build", "e2e"]
    for tier in run.tiers[:3]:
        tier.seconds, tier.exit_code = 60.0, 0
    run.tiers[3].seconds, run.tiers[3].exit_code = 120.0, 1
    table = tiers.table(run)
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[1:]}
    assert rows["unit"] == ["2.0", "exit", "1", "beside", "the", "tiers", "after", "it"]
    assert rows["e2e"] == ["-", "not", "run"]
    run.clock -= 300  # the wall time, not the tiers' sum: background tiers overlap the others
    assert table_total(run) == ["total", "5.0", "FAILED", "(wall)"]
    for tier in run.tiers:
        tier.exit_code = 0
    assert run.passed


def table_total(run: Any) -> list[str]:
    return tiers.table(run).splitlines()[-1].split()


def test_a_background_tier_runs_beside_the_next_at_the_lowest_priority(tmp_path: Path) -> None:
    gate = tmp_path / "foreground-ran"
    # The background tier waits for the foreground one to have run: they overlap.
    script = (
        "import os, pathlib, time\n"
        f"gate = pathlib.Path({str(gate)!r})\n"
        "deadline = time.monotonic() + 60\n"
        "while not gate.exists() and time.monotonic() < deadline: time.sleep(0.05)\n"
        "group = pathlib.Path('/proc/self/autogroup')\n"
        "print('nice', os.nice(0), group.read_text().split()[-1] if group.exists() else 'none')\n"
        "print('===== 2 passed in 0.10s =====')\n"
        "raise SystemExit(0 if gate.exists() else 4)\n"
    )
    background = tiers.Tier("unit", [sys.executable, "-c", script], True, log_dir=tmp_path)
    foreground = tiers.Tier("e2e", [sys.executable, "-c", f"open({str(gate)!r}, 'w')"])
    job = tiers.start_background(background)
    try:
        tiers.run_tier(foreground)
        tiers.finish_background(job)
    finally:
        tiers.stop_background(job)
    assert (foreground.exit_code, background.exit_code) == (0, 0)
    assert background.seconds is not None and background.seconds > 0
    assert background.summary == "2 passed"
    nice, group = background.log.read_text().splitlines()[0].split()[1:]
    assert nice == "19" and group in ("19", "none"), (nice, group)


def test_the_record_ci_time_reads_is_written_whatever_the_tiers_hold(tmp_path: Path) -> None:
    run = tiers.Run(tiers.tiers([]))
    run.tiers[3].seconds, run.tiers[3].exit_code, run.tiers[3].summary = 90.0, 0, "3 passed"
    tiers.save(run, tmp_path / "ci-tiers.json")
    saved = json.loads((tmp_path / "ci-tiers.json").read_text())
    assert saved["passed"] is False  # the other tiers did not run
    unit = next(t for t in saved["tiers"] if t["name"] == "unit")
    assert (unit["seconds"], unit["summary"], unit["background"]) == (90.0, "3 passed", True)


def test_the_last_line_adds_up_every_pytest_tier() -> None:
    run = tiers.Run(tiers.tiers([]))
    run.tiers[3].summary = "1248 passed, 2 skipped"
    run.tiers[5].summary = "2 failed, 56 passed, 1 error"
    assert tiers.closing_line(run) == "tests: 1304 passed, 3 failed, 2 skipped"
    run.tiers[5].summary = None
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


def test_a_background_tier_stopped_early_takes_its_children_with_it(tmp_path: Path) -> None:
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    tier = tiers.Tier("unit", [sys.executable, "-c", script], True, log_dir=tmp_path)
    job = tiers.start_background(tier)
    deadline = time.monotonic() + 30
    while not tier.log.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(tier.log.read_text().split()[0])
    tiers.stop_background(job)
    job.waiter.join(timeout=30)
    assert tier.exit_code == -signal.SIGTERM
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the reaper (init) collects the orphan
    assert not Path(f"/proc/{child}").exists() or process_state(child) == "Z"  # a zombie


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (after the parenthesised command name)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
