"""Generate the RLHFJob CustomResourceDefinition from the pydantic models.

Pydantic emits JSON Schema 2020-12 with `$ref`s; Kubernetes wants a *structural* OpenAPI v3
schema: everything inlined, `nullable` instead of `null` unions, int-or-string for quantities,
`exclusiveMinimum` as a boolean, no `additionalProperties: false`. `to_structural` does exactly
that translation and nothing else, so every fact stays in `rlhfjob.api`.

    python -m rlhfjob.crdgen write   # rewrite crds/ and the chart's copy
    python -m rlhfjob.crdgen check   # exit 1 when either is stale
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pydantic
import yaml

from rlhfjob import api

REPO_ROOT = Path(__file__).resolve().parent.parent
CRD_FILENAME = f"{api.GROUP}_{api.PLURAL}.yaml"
CRD_PATHS = (
    REPO_ROOT / "crds" / CRD_FILENAME,
    REPO_ROOT / "charts" / "rlhfjob" / "crds" / CRD_FILENAME,
)

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "integer", "jsonPath": ".status.currentStep"},
    {"name": "Total", "type": "integer", "jsonPath": ".status.totalSteps"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restartCount"},
    {
        "name": "Checkpoint",
        "type": "integer",
        "description": "Step of the last complete checkpoint",
        "jsonPath": ".status.lastCheckpoint.step",
    },
    {
        "name": "ETA",
        "type": "string",
        "description": "When the last step should finish at the current rate",
        "jsonPath": ".status.progress.eta",
    },
    {
        "name": "Steps/s",
        "type": "number",
        "jsonPath": ".status.progress.stepsPerSecond",
        "priority": 1,
    },
    {"name": "Reward", "type": "number", "jsonPath": ".status.progress.rewardMean", "priority": 1},
    {
        "name": "Held-out",
        "type": "number",
        "description": "Latest held-out evaluation's greedy accuracy (spec.evaluation)",
        "jsonPath": ".status.evaluation.accuracy",
        "priority": 1,
    },
    {"name": "Algorithm", "type": "string", "jsonPath": ".spec.algorithm.name", "priority": 1},
    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_DROPPED_KEYS = {"title", "$defs", "discriminator"}


def to_structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Translate one pydantic JSON schema node into a Kubernetes structural schema node."""
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return to_structural(merged, defs)

    variants = schema.get("anyOf")
    if variants and not schema.get("x-kubernetes-int-or-string"):
        non_null = [v for v in variants if v.get("type") != "null"]
        if len(non_null) == 1 and len(non_null) < len(variants):
            rest = {k: v for k, v in schema.items() if k != "anyOf"}
            node = to_structural({**non_null[0], **rest}, defs)
            node["nullable"] = True
            node.pop("default", None) if node.get("default") is None else None
            return node
        raise ValueError(f"cannot express this union structurally: {variants}")

    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DROPPED_KEYS or (key == "default" and value is None):
            continue
        if key == "properties":
            out[key] = {name: to_structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = to_structural(value, defs)
        elif key == "additionalProperties":
            if value is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, dict):
                out[key] = to_structural(value, defs)
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "const":
            out["enum"] = [value]
        elif key == "anyOf":
            out[key] = [{k: v for k, v in variant.items() if k != "title"} for variant in value]
        else:
            out[key] = value

    if out.get("type") == "array" and "default" in out and out["default"] == []:
        del out["default"]
    if out.get("type") == "object" and out.get("default") == {} and "properties" not in out:
        del out["default"]
    return out


def add_section_defaults(model: type[pydantic.BaseModel], node: dict[str, Any]) -> None:
    """Defaulted sub-objects (`liveness: {}` and the like) get their full default object.

    The server applies nested defaults only inside an object that exists, and it checks each
    default against the CEL rules as written, so `default: {}` would not do.
    """
    for name, field in model.model_fields.items():
        prop = node.get("properties", {}).get(field.alias or name)
        if prop is None:
            continue
        if field.default_factory is not None:
            value = field.default_factory()  # type: ignore[call-arg]
            if isinstance(value, api.ApiModel):
                prop["default"] = value.wire()
        nested = field.annotation
        if isinstance(nested, type) and issubclass(nested, pydantic.BaseModel):
            add_section_defaults(nested, prop)


def default_text(value: Any) -> str | None:
    """How a default reads in a description (YAML's spelling); None for an object, a list or
    an empty string, whose fields or absence say more."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str) and value:
        return value
    return None


def unwrap(text: str) -> str:
    """A docstring as one paragraph per paragraph: `kubectl explain` keeps every newline, and
    a docstring's are only where its source lines wrap."""
    paragraphs = re.split(r"\n\s*\n", text.strip())
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)


def document(node: dict[str, Any]) -> None:
    """Unwrap every description and append "Default: X." to that of every property with a
    scalar default, so `kubectl explain` shows it: the one place defaults are spelt out."""
    if isinstance(node.get("description"), str):
        node["description"] = unwrap(node["description"])
    for prop in node.get("properties", {}).values():
        document(prop)
        text = default_text(prop.get("default"))
        if text is not None and prop.get("description"):
            sentence = prop["description"]
            prop["description"] = (
                f"{sentence if sentence.endswith('.') else sentence + '.'} Default: {text}."
            )
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            document(node[key])


def _model_schema(model: type[api.ApiModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    schema = to_structural(raw, raw.get("$defs", {}))
    add_section_defaults(model, schema)
    document(schema)
    return schema


def build_crd() -> dict[str, Any]:
    """The CRD as a plain dict (deterministic: same models, same bytes)."""
    job_schema = _model_schema(api.RLHFJob)
    properties = job_schema["properties"]
    root = {
        "type": "object",
        "description": unwrap(api.RLHFJob.__doc__ or ""),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # The only metadata a CRD may constrain. The name becomes a label value, the
            # RayCluster's name and the stem of every derived name (api.MAX_NAME_LENGTH).
            "metadata": {
                "type": "object",
                "properties": {
                    "name": {
                        "type": "string",
                        "maxLength": api.MAX_NAME_LENGTH,
                        "pattern": api.NAME_PATTERN,
                    }
                },
            },
            "spec": properties["spec"],
            "status": {k: v for k, v in properties["status"].items() if k != "nullable"},
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": api.SHORT_NAMES,
                "categories": ["all", "rlhf"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def render_crd() -> str:
    header = "# Generated from rlhfjob/api/ by `task crds`. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def print_write_or_check(argv: list[str], text: str, paths: tuple[Path, ...], module: str) -> int:
    """The command line of a generated file: print it, write it, or fail when it is stale."""
    command = argv[0] if argv else "print"
    if command == "print":
        sys.stdout.write(text)
        return 0
    if command == "write":
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO_ROOT)}")
        return 0
    if command == "check":
        stale = [p for p in paths if not p.exists() or p.read_text() != text]
        for path in stale:
            print(f"stale: {path.relative_to(REPO_ROOT)} (run `task crds`)", file=sys.stderr)
        return 1 if stale else 0
    print(f"usage: python -m {module} [print|write|check], not {command!r}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    return print_write_or_check(argv, render_crd(), CRD_PATHS, "rlhfjob.crdgen")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
