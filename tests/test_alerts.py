"""The chart's alerts, rendered by helm with their default durations, under `promtool test rules`.

Each alert gets synthetic series (as Prometheus stores them after scraping the operator with the
chart's ServiceMonitor) that must fire it, and series that must not. The e2e tier sees them fire
on a real Prometheus during the fault cases (`e2e/tests/test_faults.py`).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_local import prometheus
from rlhf_local.build import cached_tool

HELM, PROMTOOL = cached_tool("helm"), cached_tool("promtool")
pytestmark = pytest.mark.skipif(
    HELM is None or PROMTOOL is None,
    reason="helm or promtool missing: `python -m rlhf_local.build --tools` (task unit runs it)",
)

OPERATOR = {"job": "rlhfjob-metrics", "instance": "10.0.0.7:8080", "namespace": "rlhfjob-system"}
"""The operator's target labels under the chart's ServiceMonitor (release rlhfjob)."""
JOB = {**OPERATOR, "namespace": "team-a", "rlhfjob": "grpo"}
"""A per-job series: the job's own namespace (honor_labels) and name."""
OTHER = {**JOB, "rlhfjob": "ppo"}


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ", ".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    return {"series": f"{name}{{{inner}}}", "values": values}


@pytest.fixture(scope="module")
def rules() -> dict[str, Any]:
    assert HELM is not None
    return prometheus.render_rules(HELM)


def expected(rule: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    """The alert's labels and its annotations with `{{ $labels.x }}` filled in."""

    def fill(text: str) -> str:
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)

    annotations = {key: fill(value) for key, value in rule["annotations"].items()}
    return {"exp_labels": {**labels, **rule["labels"]}, "exp_annotations": annotations}


def rule_named(rules: dict[str, Any], alert: str) -> dict[str, Any]:
    return next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == alert)


def promtool(rules: dict[str, Any], tmp_path: Path, tests: list[dict[str, Any]]) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    suite = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(suite))
    assert PROMTOOL is not None
    run = subprocess.run(
        [str(PROMTOOL), "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr


def case(input_series: list[dict[str, str]], *checks: tuple[str, str, list[Any]]) -> dict[str, Any]:
    return {
        "interval": "1m",
        "input_series": input_series,
        "alert_rule_test": [
            {"eval_time": at, "alertname": alert, "exp_alerts": alerts}
            for at, alert, alerts in checks
        ],
    }


def test_every_alert_is_tested_here(rules: dict[str, Any]) -> None:
    names = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert names == set(prometheus.ALERTS)


def test_the_rules_pass_promtools_check(rules: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    assert PROMTOOL is not None
    run = subprocess.run([str(PROMTOOL), "check", "rules", str(tmp_path / "rules.yaml")],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_hung_or_stalled_trainers_restart_fires_for_the_window(
    rules: dict[str, Any], tmp_path: Path
) -> None:
    rule = rule_named(rules, "RLHFJobTrainerHung")
    hung = {**JOB, "reason": "TrainerHung"}
    failed = {**OTHER, "reason": "TrainerFailed"}
    tests = case(
        [
            series("rlhf_operator_job_restarts_total", hung, "0x10 1x80"),
            series("rlhf_operator_job_restarts_total", failed, "0x10 1x80"),
        ],
        ("5m", "RLHFJobTrainerHung", []),
        ("15m", "RLHFJobTrainerHung", [expected(rule, hung)]),
        ("80m", "RLHFJobTrainerHung", []),  # the window (30m) has passed
    )
    promtool(rules, tmp_path, [tests])


def test_restarts_close_to_max_restarts_fire_until_the_job_ends(
    rules: dict[str, Any], tmp_path: Path
) -> None:
    rule = rule_named(rules, "RLHFJobRestartsNearlyExhausted")
    finished = {**JOB, "rlhfjob": "done"}
    tests = case(
        [
            series("rlhf_operator_job_restart_count", JOB, "0x10 3x20"),
            series("rlhf_operator_job_max_restarts", JOB, "4x30"),
            series("rlhf_operator_job_phase", {**JOB, "phase": "Running"}, "1x30"),
            series("rlhf_operator_job_restart_count", OTHER, "1x30"),  # 1 of 4: fine
            series("rlhf_operator_job_max_restarts", OTHER, "4x30"),
            series("rlhf_operator_job_phase", {**OTHER, "phase": "Running"}, "1x30"),
            series("rlhf_operator_job_restart_count", finished, "4x30"),  # Failed: over
            series("rlhf_operator_job_max_restarts", finished, "4x30"),
            series("rlhf_operator_job_phase", {**finished, "phase": "Failed"}, "1x30"),
        ],
        ("5m", "RLHFJobRestartsNearlyExhausted", []),
        ("15m", "RLHFJobRestartsNearlyExhausted", [expected(rule, JOB)]),
    )
    promtool(rules, tmp_path, [tests])


def test_degraded_and_provisioning_fire_only_after_their_durations(
    rules: dict[str, Any], tmp_path: Path
) -> None:
    degraded, stuck = (
        rule_named(rules, "RLHFJobDegraded"),
        rule_named(rules, "RLHFJobProvisioningStuck"),
    )
    condition = {**JOB, "condition": "Degraded"}
    provisioning = {**OTHER, "phase": "Provisioning"}
    tests = case(
        [
            series("rlhf_operator_job_condition", condition, "0x5 1x60"),
            series("rlhf_operator_job_condition", {**OTHER, "condition": "Degraded"}, "0x60"),
            series("rlhf_operator_job_phase", provisioning, "1x60"),
        ],
        ("20m", "RLHFJobDegraded", []),
        ("40m", "RLHFJobDegraded", [expected(degraded, condition)]),
        ("20m", "RLHFJobProvisioningStuck", []),
        ("40m", "RLHFJobProvisioningStuck", [expected(stuck, provisioning)]),
    )
    promtool(rules, tmp_path, [tests])


def test_a_running_job_whose_step_stopped_fires_no_progress(
    rules: dict[str, Any], tmp_path: Path
) -> None:
    rule = rule_named(rules, "RLHFJobNoStepProgress")
    running = {**JOB, "phase": "Running"}
    tests = case(
        [
            series("rlhf_operator_job_phase", running, "1x100"),
            series("rlhf_operator_job_step", JOB, "0+1x10 10x90"),  # stops at 10m
            series("rlhf_operator_job_phase", {**OTHER, "phase": "Running"}, "1x100"),
            series("rlhf_operator_job_step", OTHER, "0+1x100"),  # always moving
        ],
        ("50m", "RLHFJobNoStepProgress", []),  # still within for: 30m
        ("75m", "RLHFJobNoStepProgress", [expected(rule, running)]),
    )
    promtool(rules, tmp_path, [tests])


def test_the_operator_down_or_never_scraped_fires(rules: dict[str, Any], tmp_path: Path) -> None:
    rule = rule_named(rules, "RLHFJobOperatorDown")
    down = case(
        [series("up", OPERATOR, "1x10 0x30")],
        ("8m", "RLHFJobOperatorDown", []),
        ("20m", "RLHFJobOperatorDown", [expected(rule, OPERATOR)]),
    )
    absent_labels = {"job": OPERATOR["job"], "namespace": OPERATOR["namespace"]}
    never = case(
        [series("up", {**OPERATOR, "job": "something-else"}, "1x30")],
        ("10m", "RLHFJobOperatorDown", [expected(rule, absent_labels)]),
    )
    promtool(rules, tmp_path, [down, never])


def test_failing_reconciles_fire_above_the_ratio(rules: dict[str, Any], tmp_path: Path) -> None:
    rule = rule_named(rules, "RLHFJobOperatorReconcileErrors")
    labels = {"job": OPERATOR["job"], "namespace": OPERATOR["namespace"]}
    tests = case(
        [
            series("rlhf_operator_reconciles_total", {**OPERATOR, "result": "ok"}, "0+60x90"),
            # One error a minute (1 in 61: below 0.1) for 20m, then 30 a minute.
            series(
                "rlhf_operator_reconciles_total", {**OPERATOR, "result": "error"}, "0+1x20 20+30x70"
            ),
        ],
        ("19m", "RLHFJobOperatorReconcileErrors", []),
        ("30m", "RLHFJobOperatorReconcileErrors", []),  # above the ratio, not yet for 15m
        ("50m", "RLHFJobOperatorReconcileErrors", [expected(rule, labels)]),
    )
    promtool(rules, tmp_path, [tests])
