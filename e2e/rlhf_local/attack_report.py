"""A pytest plugin: `pytest -p rlhf_local.attack_report --attack-report=PATH …` writes each test
marked `attack(what, blocked_by)` to PATH as JSON, with whether the attack was blocked (the test
passed). `benchmarks/security.py` turns it into `benchmarks/results/security.json`."""

from __future__ import annotations

import json
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

_results: list[dict[str, Any]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--attack-report", default=None, help="write the attack tests' outcomes here")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome: Any = yield
    report = outcome.get_result()
    # The call's outcome, or a setup that failed or skipped (then the call never runs).
    if report.when == "call" or (report.when == "setup" and not report.passed):
        for mark in item.iter_markers("attack"):
            what, blocked_by = mark.args
            _results.append(
                {"attack": what, "blocked_by": blocked_by, "test": item.nodeid,
                 "blocked": report.passed}
            )  # fmt: skip


def pytest_sessionfinish(session: pytest.Session) -> None:
    if path := session.config.getoption("--attack-report"):
        Path(path).write_text(json.dumps(_results, indent=1) + "\n")
