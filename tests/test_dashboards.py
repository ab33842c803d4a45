"""The Grafana dashboards, linted: structure, metric names, units, descriptions, variables.

Every metric a query names must be one the operator or the trainer exports (their metrics
modules name them once) or one of Ray's the trainer's module lists; every per-job series is
filtered by the namespace and job variables. The e2e tier runs every query on a real Prometheus
that scraped a fault case (`e2e/tests/test_faults.py`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlhf_local import dashboards
from rlhf_operator import metrics as operator_metrics
from rlhf_operator.metrics import OperatorMetrics
from rlhf_trainer.run import metrics as trainer_metrics
from rlhf_trainer.run.metrics import TrainerMetrics

PATHS = dashboards.paths()
METRIC = re.compile(r"\b((?:rlhf|ray)_[a-z_]+)\b(\{[^}]*\})?")
SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
PER_JOB = ("rlhf_operator_job_", "rlhf_trainer_", "ray_")
"""Series of one job (the rest are the operator's own)."""
TRAINING_UID = "rlhfjob-training"


def series_names(registry) -> set[str]:  # type: ignore[no-untyped-def]
    """Every series name a registry can export, labelled children or not."""
    return {
        family.name + suffix
        for family in registry.collect()
        for suffix in SUFFIXES.get(family.type, [""])
    }


def known_series() -> set[str]:
    exported = series_names(OperatorMetrics().registry) | series_names(TrainerMetrics().registry)
    return exported | set(trainer_metrics.RAY_METRIC_NAMES)


def test_every_metric_name_constant_is_exported() -> None:
    """The modules' name constants are the registries' names (one place for each name)."""
    families = {f.name for f in OperatorMetrics().registry.collect()}
    assert {n.removesuffix("_total") for n in operator_metrics.METRIC_NAMES} == families
    families = {f.name for f in TrainerMetrics().registry.collect()}
    assert {n.removesuffix("_total") for n in trainer_metrics.METRIC_NAMES} == families


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_the_dashboard_is_valid_json_with_unique_panel_ids(path: Path) -> None:
    board = json.loads(path.read_text())
    panels = dashboards.panels(board)
    ids = [p["id"] for p in panels]
    assert len(set(ids)) == len(ids), f"repeated panel ids: {sorted(ids)}"
    assert all(p["title"] for p in panels)
    assert board["uid"] and board["title"]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_queries_name_only_exported_metrics(path: Path) -> None:
    known = known_series()
    used = {m.group(1) for q in dashboards.queries(path) for m in METRIC.finditer(q.expr)}
    assert used, "a dashboard without queries"
    assert used <= known, f"unknown metrics: {sorted(used - known)}"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_every_panel_has_a_unit_a_description_and_the_datasource_variable(path: Path) -> None:
    for panel in dashboards.panels(json.loads(path.read_text())):
        if panel["type"] == "row":
            continue
        title = panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{title}: no unit"
        assert len(panel.get("description", "")) > 20, f"{title}: no description"
        assert panel["datasource"]["uid"] == "${datasource}", title
        assert panel["targets"], f"{title}: no query"
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), title


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_every_per_job_series_is_filtered_by_namespace_and_job(path: Path) -> None:
    assert dashboards.variables(json.loads(path.read_text())) == ["datasource", "namespace", "job"]
    for query in dashboards.queries(path):
        for match in METRIC.finditer(query.expr):
            name, selector = match.group(1), match.group(2) or ""
            if not name.startswith(PER_JOB):
                continue
            assert re.search(r'namespace=~?"\$namespace"', selector), f"{query.panel}: {name}"
            assert re.search(r'rlhfjob=~?"\$job"', selector), f"{query.panel}: {name}"


def test_the_overview_links_to_the_per_job_view() -> None:
    overview = dashboards.load(dashboards.DASHBOARD_DIR / "operator.json")
    assert any(TRAINING_UID in link["url"] for link in overview["links"])
    per_job = [p for p in dashboards.panels(overview) if "rlhf_operator_job_" in json.dumps(p)]
    assert per_job
    for panel in per_job:
        links = panel["fieldConfig"]["defaults"].get("links", [])
        assert any(TRAINING_UID in link["url"] and "var-job=" in link["url"] for link in links), (
            panel["title"]
        )
    training = dashboards.load(dashboards.DASHBOARD_DIR / "training.json")
    assert training["uid"] == TRAINING_UID


def test_variables_fill_in_as_grafana_would() -> None:
    query = dashboards.Query(
        "d", "p", 'rate(x{rlhfjob="$job", ns="${namespace}"}[$__rate_interval])'
    )
    filled = query.filled({"job": "a", "namespace": "b", "__rate_interval": "30s"})
    assert filled == 'rate(x{rlhfjob="a", ns="b"}[30s])'


def test_the_operations_page_lists_every_panel_and_query() -> None:
    text = dashboards.LISTING_PAGE.read_text()
    assert dashboards.page_with_listing(text) == text, (
        "docs/operations.md's dashboard list is stale: python -m rlhf_local.dashboards write"
    )
