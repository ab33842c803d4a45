"""Check a Grafana dashboard's JSON against grafana-foundation-sdk's typed models, offline.

No Grafana server can run where the unit tier runs, so the dashboards are held to the models
Grafana Labs generates from Grafana's own schemas: the dashboard kind, each core panel plugin's
options and field config, each data source's query. Every key must be a field of its model and
every value of that field's type (enums and literals included). The SDK's `from_json` decodes
leniently (it keeps whatever value it is given and drops unknown keys), so the types are checked
here against its annotations instead of trusted to it. The SDK does not say which fields are
required (each has a default), so presence is left to the checks below and the tests.

Beyond the schema: every panel and query uses the dashboard's templated Prometheus data source,
panel ids are unique, panels sit inside the 24-column grid without overlapping, and every unit is
one of Grafana's unit ids (the SDK's `units` module lists them).
"""

from __future__ import annotations

import enum
import functools
import importlib.metadata
import types
import typing
from typing import Any

from grafana_foundation_sdk.cog import plugins, runtime, variants
from grafana_foundation_sdk.models import dashboard, units

SDK = "grafana-foundation-sdk"
SDK_VERSION = importlib.metadata.version(SDK)
GRID_COLUMNS = 24
UNITS = frozenset(v for k, v in vars(units).items() if not k.startswith("_") and isinstance(v, str))
"""Grafana's unit ids, as the SDK generates them from Grafana's value formats."""

plugins.register_default_plugins()


class _Marker:
    """A value no model produces: which JSON key it comes out under names an attribute's key."""


@functools.cache
def fields(model: type) -> dict[str, Any]:
    """JSON key -> the type hint of the attribute the SDK writes under that key."""
    found = {}
    for attribute, hint in typing.get_type_hints(model).items():
        instance = model()
        marker = _Marker()
        setattr(instance, attribute, marker)
        keys = [key for key, value in instance.to_json().items() if value is marker]
        assert len(keys) == 1, f"{model.__name__}.{attribute}: written as {keys}"
        found[keys[0]] = hint
    return found


def _union(value: Any, arms: tuple[Any, ...], path: str) -> list[str]:
    if value is None and type(None) in arms:
        return []
    tried = [check(value, arm, path) for arm in arms if arm is not type(None)]
    return [] if any(not errors for errors in tried) else min(tried, key=len)


def _scalar(value: Any, hint: type, path: str) -> list[str]:
    wanted = (int, float) if hint is float else hint
    if isinstance(value, wanted) and (hint is bool or not isinstance(value, bool)):
        return []
    return [f"{path}: {value!r} is not of type {hint.__name__}"]


def check(value: Any, hint: Any, path: str) -> list[str]:
    """Why `value` (decoded JSON) is not of the SDK's type `hint`; empty when it is."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (Any, object) or hint is variants.Dataquery:  # queries: `plugin_errors`
        return []
    if origin in (typing.Union, types.UnionType):
        return _union(value, args, path)
    if origin is typing.Literal:
        return [] if value in args else [f"{path}: {value!r} is not one of {list(args)}"]
    if origin in (list, dict):
        if not isinstance(value, origin):
            return [f"{path}: {value!r} is not of type {origin.__name__}"]
        items = enumerate(value) if origin is list else value.items()
        return [e for key, item in items for e in check(item, args[-1], f"{path}[{key!r}]")]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        allowed = [member.value for member in hint]
        ok = any(value == a and type(value) is type(a) for a in allowed)
        return [] if ok else [f"{path}: {value!r} is not one of {allowed}"]
    if hint in (str, int, float, bool):
        return _scalar(value, hint, path)
    if isinstance(hint, type) and hasattr(hint, "from_json"):
        return check_model(value, hint, path)
    return [f"{path}: the SDK's type {hint!r} has no rule here"]


def _name(model: type) -> str:
    """`prometheus.Dataquery`: the SDK's module (a plugin or kind) and class."""
    return f"{model.__module__.rsplit('.', 1)[-1]}.{model.__name__}"


def check_model(value: Any, model: type, path: str) -> list[str]:
    if not isinstance(value, dict):
        return [f"{path}: {value!r} is not an object ({_name(model)})"]
    known = fields(model)
    errors: list[str] = []
    for key, item in value.items():
        if key not in known:
            errors.append(f"{path}.{key}: not a field of {_name(model)}")
        else:
            errors.extend(check(item, known[key], f"{path}.{key}"))
    if model is dashboard.Panel:
        errors.extend(plugin_errors(value, path))
    return errors


def _object(value: Any) -> dict[str, Any]:
    """`value` where it is an object, else an empty one (the schema reports the wrong shape)."""
    return value if isinstance(value, dict) else {}


def _hook_model(hook: Any) -> type:
    """The model class behind a plugin's `from_json` hook (a bound classmethod)."""
    return typing.cast(type, hook.__self__)


def plugin_errors(panel: dict[str, Any], path: str) -> list[str]:
    """A panel's plugin parts, against the models of its panel type and data source type."""
    kind = panel.get("type")
    config = runtime.panelcfg_config(kind) if isinstance(kind, str) else None
    if config is None:
        return [f"{path}.type: no model for panel type {panel.get('type')!r}"]
    errors: list[str] = []
    if "options" in panel and config.options_from_json_hook is not None:
        options = _hook_model(config.options_from_json_hook)
        errors.extend(check_model(panel["options"], options, f"{path}.options"))
    custom = _object(_object(panel.get("fieldConfig")).get("defaults")).get("custom")
    if custom is not None and config.field_config_from_json_hook is not None:
        model = _hook_model(config.field_config_from_json_hook)
        errors.extend(check_model(custom, model, f"{path}.fieldConfig.defaults.custom"))
    default_type = _object(panel.get("datasource")).get("type", "")
    queries = runtime.Runtime().dataquery_variants
    targets = panel.get("targets")
    for i, target in enumerate(targets if isinstance(targets, list) else []):
        where = f"{path}.targets[{i}]"
        source = _object(_object(target).get("datasource")).get("type") or default_type
        if not isinstance(source, str) or source not in queries:
            errors.append(f"{where}: no query model for data source type {source!r}")
            continue
        errors.extend(check_model(target, _hook_model(queries[source].from_json_hook), where))
    return errors


def schema_errors(board: dict[str, Any]) -> list[str]:
    """Why the dashboard does not conform to the SDK's models; empty when it does."""
    return check_model(board, dashboard.Dashboard, "dashboard")


def all_panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows and the panels inside them too."""
    return [p for top in board.get("panels", []) for p in [top, *top.get("panels", [])]]


def datasource_errors(board: dict[str, Any]) -> list[str]:
    """Panels, queries and query variables that do not use the templated Prometheus source.

    A fixed data source uid would work only on the Grafana it was exported from.
    """
    variables = board.get("templating", {}).get("list", [])
    names = [
        v.get("name")
        for v in variables
        if v.get("type") == "datasource" and v.get("query") == "prometheus"
    ]
    if len(names) != 1:
        return [f"templating: {len(names)} Prometheus data source variables, not 1"]
    wanted = {"type": "prometheus", "uid": "${" + str(names[0]) + "}"}
    errors = [
        f"variable {v.get('name')}: data source {v.get('datasource')!r}, not {wanted}"
        for v in variables
        if v.get("type") == "query" and v.get("datasource") != wanted
    ]
    for panel in all_panels(board):
        if panel.get("type") == "row":
            continue
        title = panel.get("title")
        if panel.get("datasource") != wanted:
            errors.append(f"{title}: data source {panel.get('datasource')!r}, not {wanted}")
        for target in panel.get("targets", []):
            if target.get("datasource", wanted) != wanted:
                errors.append(f"{title}, query {target.get('refId')}: data source not {wanted}")
    return errors


def id_errors(board: dict[str, Any]) -> list[str]:
    """Panel ids missing or repeated (Grafana keys panel state, links and edits by id)."""
    ids = [p.get("id") for p in all_panels(board)]
    errors = [f"{p.get('title')}: no id" for p in all_panels(board) if p.get("id") is None]
    repeated = sorted({i for i in ids if i is not None and ids.count(i) > 1})
    return errors + ([f"repeated panel ids: {repeated}"] if repeated else [])


def _overlap(a: dict[str, int], b: dict[str, int]) -> bool:
    return (
        a["x"] < b["x"] + b["w"]
        and b["x"] < a["x"] + a["w"]
        and a["y"] < b["y"] + b["h"]
        and b["y"] < a["y"] + a["h"]
    )


def layout_errors(board: dict[str, Any]) -> list[str]:
    """Panels off the 24-column grid or on top of one another.

    Top-level panels (rows included) share one grid; the panels inside a row share another (a
    collapsed row's panels keep their places for when it opens). Wrong types are the schema's.
    """
    top = board.get("panels", [])
    groups = [top, *(row.get("panels", []) for row in top if row.get("type") == "row")]
    errors: list[str] = []
    for group in groups:
        placed: list[tuple[str, dict[str, int]]] = []
        for panel in group:
            title, box = panel.get("title"), panel.get("gridPos")
            if not isinstance(box, dict) or not all(
                isinstance(box.get(k), int) for k in ("x", "y", "w", "h")
            ):
                errors.append(f"{title}: no grid position of four integers")
                continue
            if min(box["x"], box["y"]) < 0 or min(box["w"], box["h"]) < 1:
                errors.append(f"{title}: grid position {box} has a negative place or empty size")
            if box["x"] + box["w"] > GRID_COLUMNS:
                errors.append(f"{title}: {box} runs past column {GRID_COLUMNS}")
            errors.extend(f"{title} overlaps {other}" for other, b in placed if _overlap(box, b))
            placed.append((title, box))
    return errors


def unit_errors(board: dict[str, Any]) -> list[str]:
    """Units that are not Grafana unit ids (Grafana shows an unknown one as a bare suffix).

    Custom units (`suffix:`, `currency:` ...) are refused too: none is used, and a misspelt id
    would pass for one.
    """
    errors: list[str] = []
    for panel in all_panels(board):
        config = panel.get("fieldConfig", {})
        used = [config.get("defaults", {}).get("unit")]
        used += [
            prop.get("value")
            for override in config.get("overrides", [])
            for prop in override.get("properties", [])
            if prop.get("id") == "unit"
        ]
        errors.extend(
            f"{panel.get('title')}: unit {u!r} is not a Grafana unit id"
            for u in used
            if u is not None and u not in UNITS
        )
    return errors
