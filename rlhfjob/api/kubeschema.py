"""Kubernetes types the API embeds, checked against Kubernetes' own schema (issue 28).

A role's `affinity` is a Kubernetes `Affinity`, passed through to the pods. Accepted as a
free-form object it let a misspelt field or a wrong type through `rlhfjob validate` and the
API server, to be dropped or refused only when the operator built the RayCluster. Its schema
comes from the Kubernetes Python client's models (`rlhfjob.kubegen`, `task crds`), committed as
`kubernetes-affinity.json` beside this module: the CRD carries it (so the API server checks it,
as KubeRay's CRD carries the pod template's) and the models check a value against it here,
without importing the client at run time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).resolve().parent / "kubernetes-affinity.json"


def load_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
    return schema


JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}
"""The Python values of a schema's `type` as the API server reads JSON."""


def schema_problems(schema: dict[str, Any], value: Any, path: str = "") -> list[tuple[str, str]]:
    """(field path, message) for each way `value` breaks a structural `schema`: a wrong type,
    a required field missing, a field the type does not have (which the API server would
    drop)."""
    if value is None:
        return [] if schema.get("nullable") else [(path, "must not be null")]
    expected = schema.get("type")
    if expected and (
        not isinstance(value, JSON_TYPES[expected])
        or (expected in ("integer", "number") and isinstance(value, bool))
    ):
        return [(path, f"must be of type {expected}")]
    problems: list[tuple[str, str]] = []
    if isinstance(value, dict):
        properties = schema.get("properties")
        for name in schema.get("required", []):
            if name not in value:
                problems.append((f"{path}.{name}", "required"))
        for name, item in value.items():
            child = f"{path}.{name}"
            if properties is not None and name in properties:
                problems += schema_problems(properties[name], item, child)
            elif isinstance(schema.get("additionalProperties"), dict):
                problems += schema_problems(schema["additionalProperties"], item, child)
            elif properties is not None:
                problems.append((child, f"unknown field {name!r}"))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            problems += schema_problems(schema.get("items", {}), item, f"{path}[{index}]")
    return problems
