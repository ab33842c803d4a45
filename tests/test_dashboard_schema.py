"""The shipped Grafana dashboards against grafana-foundation-sdk's models, and what they leave out.

No Grafana server runs here, so this is the closest the unit tier comes to Grafana loading them
(`dashboard_schema` says what is checked). Each rejection test mutates a copy of a shipped
dashboard, so every check is shown to catch the shape it guards, not only to pass today.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dashboard_schema import (
    SDK,
    SDK_VERSION,
    all_panels,
    check_model,
    datasource_errors,
    id_errors,
    layout_errors,
    schema_errors,
    unit_errors,
)
from grafana_foundation_sdk.models import dashboard

from rlhf_local import dashboards
from rlhf_local.paths import REPO_ROOT

PATHS = dashboards.paths()
PANELS = [(path, panel) for path in PATHS for panel in all_panels(dashboards.load(path))]
Board = dict[str, Any]


def training() -> Board:
    """A fresh copy of a shipped dashboard, for a test to spoil."""
    board = dashboards.load(dashboards.DASHBOARD_DIR / "training.json")
    assert schema_errors(board) == []
    return board


def panel(board: Board, n: int = 0) -> dict[str, Any]:
    """The n-th panel that is not a row."""
    return [p for p in all_panels(board) if p["type"] != "row"][n]


def own_errors(board: Board) -> list[str]:
    return datasource_errors(board) + id_errors(board) + layout_errors(board) + unit_errors(board)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_every_shipped_dashboard_conforms_to_the_sdk_models(path: Path) -> None:
    assert schema_errors(dashboards.load(path)) == []


@pytest.mark.parametrize(
    ("path", "panel_json"), PANELS, ids=[f"{p.stem}-{q['id']}" for p, q in PANELS]
)
def test_every_panel_conforms_to_its_model(path: Path, panel_json: dict[str, Any]) -> None:
    """Each panel against `Panel` (and its plugin's models) or `RowPanel`, one case apiece."""
    model = dashboard.RowPanel if panel_json["type"] == "row" else dashboard.Panel
    assert check_model(panel_json, model, panel_json["title"]) == []


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_templated_datasource_unique_ids_a_clear_grid_and_grafana_units(path: Path) -> None:
    assert own_errors(dashboards.load(path)) == []


def _set(getter: Callable[[Board], dict[str, Any]], **values: Any) -> Callable[[Board], None]:
    return lambda board: getter(board).update(values)


SCHEMA_BREAKS = {
    "gridPos not an object": (_set(panel, gridPos="0,0,12,8"), ".gridPos"),
    "gridPos width a string": (_set(lambda b: panel(b)["gridPos"], w="12"), ".gridPos.w"),
    "datasource a bare name": (_set(panel, datasource="Prometheus"), ".datasource"),
    "datasource uid a number": (_set(lambda b: panel(b)["datasource"], uid=7), ".datasource.uid"),
    "query of an unknown source": (
        _set(lambda b: panel(b)["targets"][0], datasource={"type": "influxdb", "uid": "x"}),
        "no query model for data source type 'influxdb'",
    ),
    "misspelt panel field": (
        _set(panel, gridpos={"h": 8}),
        "gridpos: not a field of dashboard.Panel",
    ),
    "misspelt query field": (
        _set(lambda b: panel(b)["targets"][0], exp="up"),
        "exp: not a field of prometheus.Dataquery",
    ),
    "legend placement unknown": (
        _set(lambda b: panel(b)["options"]["legend"], placement="top"),
        ".options.legend.placement",
    ),
    "panel type with no model": (_set(panel, type="graph"), "no model for panel type 'graph'"),
    "variable hidden an unknown way": (
        _set(lambda b: b["templating"]["list"][1], hide=3),
        ".templating.list[1].hide",
    ),
    "refresh a number": (_set(lambda b: b, refresh=30), "dashboard.refresh"),
    "panel id a string": (_set(panel, id="2"), ".id"),
}


@pytest.mark.parametrize(("mutate", "where"), SCHEMA_BREAKS.values(), ids=SCHEMA_BREAKS.keys())
def test_the_schema_rejects(mutate: Callable[[Board], None], where: str) -> None:
    board = training()
    mutate(board)
    errors = schema_errors(board)
    assert any(where in error for error in errors), errors


def _second_datasource(board: Board) -> None:
    board["templating"]["list"].append(
        {"name": "other", "type": "datasource", "query": "prometheus"}
    )


OWN_BREAKS = {
    "panel on a fixed source": (
        _set(lambda b: panel(b)["datasource"], uid="prometheus-main"),
        "data source",
    ),
    "query on another source": (
        _set(lambda b: panel(b)["targets"][0], datasource={"type": "loki", "uid": "${datasource}"}),
        "query A: data source",
    ),
    "variable on a fixed source": (
        _set(lambda b: b["templating"]["list"][1], datasource={"type": "prometheus", "uid": "p"}),
        "variable namespace",
    ),
    "two source variables": (_second_datasource, "2 Prometheus data source variables"),
    "repeated panel id": (lambda b: panel(b, 1).update(id=panel(b, 0)["id"]), "repeated panel ids"),
    "overlapping panels": (_set(lambda b: panel(b, 1)["gridPos"], x=6), "overlaps"),
    "panel past the grid": (_set(lambda b: panel(b, 1)["gridPos"], w=13), "runs past column 24"),
    "unknown unit": (
        _set(lambda b: panel(b)["fieldConfig"]["defaults"], unit="seconds"),
        "unit 'seconds'",
    ),
    "unknown unit in an override": (
        _set(
            lambda b: panel(b)["fieldConfig"],
            overrides=[{"matcher": {"id": "byName"}, "properties": [{"id": "unit", "value": "B"}]}],
        ),
        "unit 'B'",
    ),
}


@pytest.mark.parametrize(("mutate", "where"), OWN_BREAKS.values(), ids=OWN_BREAKS.keys())
def test_the_checks_beyond_the_schema_reject(mutate: Callable[[Board], None], where: str) -> None:
    """What the SDK's models allow but Grafana would show wrongly (or not on another install)."""
    board = training()
    assert own_errors(board) == []
    mutate(board)
    errors = own_errors(board)
    assert any(where in error for error in errors), errors
    assert schema_errors(board) == [], "a case the schema already catches proves nothing here"


def test_the_pin_the_installed_sdk_and_the_docs_agree() -> None:
    """The README and the operations page name the SDK version the tests really check with."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    pin = f"{SDK}=={SDK_VERSION}"
    assert pin in pyproject["project"]["optional-dependencies"]["dev"]
    for page in ("README.md", "docs/operations.md"):
        assert f"{SDK} {SDK_VERSION}" in (REPO_ROOT / page).read_text(), page
