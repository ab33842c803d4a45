"""Kubernetes types the API embeds, checked against Kubernetes' own schema (issue 28).

A role's `affinity` is a Kubernetes `Affinity`, passed through to the pods. Accepted as a
free-form object it let a misspelt field or a wrong type through `rlhfjob validate` and the
API server, to be dropped or refused only when the operator built the RayCluster. Its schema
now comes from the Kubernetes Python client's models (pydantic models of the API server's
OpenAPI definitions, pinned with the client), made structural by `crdgen.to_structural`, and
committed as `rlhfjob/api/kubernetes-affinity.json`: the CRD carries it (so the API server
checks it, as KubeRay's CRD carries the pod template's) and the models check a value against
it (`schema_problems`), without importing the client at run time.

    python -m rlhfjob.kubetypes write   # regenerate the JSON (task crds)
    python -m rlhfjob.kubetypes check   # exit 1 when it is stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).resolve().parent / "api" / "kubernetes-affinity.json"


def generate() -> str:
    """The structural schema of `io.k8s.api.core.v1.Affinity`, as JSON text."""
    from kubernetes.client import V1Affinity

    from rlhfjob.crdgen import to_structural

    schema = V1Affinity.model_json_schema(by_alias=True, mode="validation")
    structural = _tidy(to_structural(schema, schema.get("$defs", {})))
    structural["description"] = "A Kubernetes affinity (io.k8s.api.core.v1.Affinity)."
    return json.dumps(structural, indent=1, sort_keys=True) + "\n"


def _tidy(node: Any) -> Any:
    """The client's models end their descriptions with their Python attributes: cut that."""
    if isinstance(node, dict):
        tidy = {key: _tidy(value) for key, value in node.items()}
        if isinstance(tidy.get("description"), str):
            tidy["description"] = tidy["description"].split("\n\nAttributes:")[0].strip()
        return tidy
    if isinstance(node, list):
        return [_tidy(item) for item in node]
    return node


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


def main(argv: list[str]) -> int:
    from rlhfjob.crdgen import print_write_or_check

    return print_write_or_check(argv, generate(), (SCHEMA_PATH,), "rlhfjob.kubetypes")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
