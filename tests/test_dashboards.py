"""Grafana dashboards only query metrics the operator and trainer really export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlhf_operator.metrics import OperatorMetrics

DASHBOARDS = sorted((Path(__file__).parent.parent / "charts/rlhfjob/dashboards").glob("*.json"))
METRIC = re.compile(r"\brlhf_[a-z_]+\b")


SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}


def series_names(registry) -> set[str]:
    """Every series name a registry can export, labelled children or not."""
    return {
        family.name + suffix
        for family in registry.collect()
        for suffix in SUFFIXES.get(family.type, [""])
    }


def exported_series_names() -> set[str]:
    names = series_names(OperatorMetrics().registry)
    try:
        from rlhf_trainer.metrics import TrainerMetrics  # type: ignore[attr-defined]
    except ImportError:
        return names
    return names | series_names(TrainerMetrics().registry)


def queries(path: Path) -> list[str]:
    dashboard = json.loads(path.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_queries_name_exported_metrics(path: Path) -> None:
    exported = exported_series_names()
    used = {name for expr in queries(path) for name in METRIC.findall(expr)}
    assert used, "a dashboard without rlhf_* queries"
    assert used <= exported, f"unknown metrics: {sorted(used - exported)}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_panels_have_unique_ids_and_titles(path: Path) -> None:
    panels = json.loads(path.read_text())["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(p["title"] for p in panels)
