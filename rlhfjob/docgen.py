"""Generate the RLHFJob field reference (`docs/api-reference.md`) from the pydantic models.

One section per object type, in the order a job reads, each listing where it sits in a job and
a row per field: type, default and the same description `kubectl explain` shows (the models'
attribute docstrings; the CRD adds "Default: X." where this table has its own column).

    python -m rlhfjob.docgen write   # rewrite docs/api-reference.md
    python -m rlhfjob.docgen check   # exit 1 when it is stale
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any

from rlhfjob import api
from rlhfjob.contract.lease import LEASE_STOP_REQUESTED_AT, LeaseReport
from rlhfjob.crdgen import REPO_ROOT, default_text, print_write_or_check

REFERENCE_PATH = REPO_ROOT / "docs" / "api-reference.md"

HEADER = f"""# RLHFJob API reference ({api.API_VERSION})

Generated from `rlhfjob/api/` by `python -m rlhfjob.docgen write` (`task crds`); do not edit.
`kubectl explain rlhfjob.spec.<field>` shows the same descriptions. Quantities are Kubernetes
quantities (`4`, `500m`, `16Gi`); times are RFC 3339. The cross-field rules the API server
enforces (CEL) are in the generated CRD, `crds/{api.GROUP}_{api.PLURAL}.yaml`.
"""


@dataclass
class _Section:
    name: str
    schema: dict[str, Any]
    paths: list[str] = field(default_factory=list)


def _def_name(node: dict[str, Any]) -> str | None:
    ref = node.get("$ref")
    return ref.rsplit("/", 1)[-1] if ref else None


def _non_null(node: dict[str, Any]) -> dict[str, Any]:
    """The schema of an optional field's value (pydantic writes `anyOf: [X, null]`)."""
    variants = node.get("anyOf")
    if variants and not node.get("x-kubernetes-int-or-string"):
        rest = [v for v in variants if v.get("type") != "null"]
        if len(rest) == 1:
            return rest[0]
    return node


def _anchor(name: str) -> str:
    return name.lower()


def _choices(values: list[Any]) -> str:
    quoted = [f"`{value}`" for value in values]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def _bounds(node: dict[str, Any]) -> str:
    low, high = node.get("minimum"), node.get("maximum")
    if (
        low is not None
        and high is not None
        and not ({"exclusiveMinimum", "exclusiveMaximum"} & set(node))
    ):
        return f", {low} to {high}"
    parts = []
    if "exclusiveMinimum" in node or low is not None:
        parts.append(
            f"above {node['exclusiveMinimum']}" if "exclusiveMinimum" in node else f"at least {low}"
        )
    if "exclusiveMaximum" in node or high is not None:
        parts.append(
            f"below {node['exclusiveMaximum']}" if "exclusiveMaximum" in node else f"at most {high}"
        )
    return "".join(f", {part}" for part in parts)


_ROLE_PATH = re.compile(r"^spec[.]roles[.](" + "|".join(api.ROLE_NAMES) + r")([.].*)?$")


def _every_role(paths: list[str]) -> list[str]:
    """`paths`, those under every role written once as `spec.roles.<role>...`."""
    under_roles: dict[str, set[str]] = {}
    for path in paths:
        if match := _ROLE_PATH.match(path):
            under_roles.setdefault(match.group(2) or "", set()).add(match.group(1))
    shown: list[str] = []
    for path in paths:
        match = _ROLE_PATH.match(path)
        rest = match.group(2) or "" if match else ""
        if match and under_roles.get(rest) == set(api.ROLE_NAMES):
            path = f"spec.roles.<role>{rest}"
        if path not in shown:
            shown.append(path)
    return shown


class _Reference:
    """Walks the models' JSON schema once: sections by first appearance, the paths of each."""

    def __init__(self) -> None:
        schema = api.RLHFJob.model_json_schema(by_alias=True, mode="validation")
        self.defs: dict[str, dict[str, Any]] = schema.get("$defs", {})
        self.sections: dict[str, _Section] = {}
        self._visit("RLHFJob", schema, "")

    def _is_enum(self, name: str) -> bool:
        return "enum" in self.defs[name] and "properties" not in self.defs[name]

    def _visit(self, name: str, schema: dict[str, Any], path: str) -> None:
        section = self.sections.get(name)
        if section is None:
            section = self.sections[name] = _Section(name, schema)
        if path:
            section.paths.append(path)
        for prop, node in schema.get("properties", {}).items():
            self._visit_value(_non_null(node), f"{path}.{prop}".lstrip("."))

    def _visit_value(self, node: dict[str, Any], path: str) -> None:
        name = _def_name(node)
        if name is not None and not self._is_enum(name):
            self._visit(name, self.defs[name], path)
        elif node.get("type") == "array" and isinstance(node.get("items"), dict):
            self._visit_value(_non_null(node["items"]), f"{path}[]")

    def type_text(self, node: dict[str, Any]) -> str:
        node = _non_null(node)
        name = _def_name(node)
        if name is not None:
            target = self.defs[name]
            return self.type_text(target) if self._is_enum(name) else f"[{name}](#{_anchor(name)})"
        if node.get("x-kubernetes-int-or-string"):
            return "quantity"
        if "enum" in node or "const" in node:
            return _choices(node.get("enum", [node.get("const")]))
        kind = node.get("type")
        if kind == "array":
            return f"list of {self.type_text(node.get('items', {}))}"
        if kind == "object":
            values = node.get("additionalProperties")
            if isinstance(values, dict):
                return f"map of string to {self.type_text(values)}"
            return "object" if node.get("properties") else "object (free-form)"
        if node.get("format") == "date-time":
            return "timestamp"
        return f"{kind}{_bounds(node)}" if kind else "any"

    def default(self, node: dict[str, Any], required: bool, of_model: bool) -> str:
        if required:
            return "required"
        if "default" not in node and of_model:  # a default factory: [], {} or a section
            value = _non_null(node)
            if _def_name(value) is not None:
                return "its fields' defaults"
            return "`[]`" if value.get("type") == "array" else "`{}`"
        text = default_text(node.get("default"))
        return f"`{text}`" if text is not None else ""

    def description(self, node: dict[str, Any]) -> str:
        text = node.get("description")
        if text is None and (name := _def_name(_non_null(node))) is not None:
            text = self.defs[name].get("description")
        return re.sub(r"\s+", " ", text or "").replace("|", "\\|").strip()

    def rows(self, schema: dict[str, Any], prefix: str = "") -> list[str]:
        """A row per field; the declared fields of a free-form object follow it, prefixed."""
        required = set(schema.get("required", []))
        lines = []
        for prop, node in schema.get("properties", {}).items():
            lines.append(
                f"| `{prefix}{prop}` | {self.type_text(node)} | "
                f"{self.default(node, prop in required, not prefix)} | {self.description(node)} |"
            )
            inline = _non_null(node)
            if _def_name(inline) is None and inline.get("properties"):
                lines += self.rows(inline, f"{prefix}{prop}.")
        return lines

    def render(self) -> str:
        parts = [HEADER]
        for section in self.sections.values():
            where = ", ".join(f"`{path}`" for path in _every_role(section.paths))
            where = where or "the object itself"
            parts.append(
                f"## {section.name}\n\n{self.description(section.schema)}\n\nAt: {where}.\n\n"
                "| Field | Type | Default | Description |\n| --- | --- | --- | --- |\n"
                + "\n".join(self.rows(section.schema))
                + "\n"
            )
        parts.append(_lease_section())
        return "\n".join(parts)


def _lease_section() -> str:
    """The heartbeat Lease's annotations: not part of the spec, but what `kubectl get lease
    <job> -o yaml` shows a user debugging a hung or stalled job (design decision 4)."""
    rows = [f"| `{key}` | {meaning} |" for key, meaning in LeaseReport.describe()]
    return (
        "## The heartbeat Lease\n\n"
        "The trainer's driver renews a Lease named after the job and reports its progress in "
        "these annotations; the operator reads them (`rlhfjob.contract.LeaseReport`).\n\n"
        "| Annotation | Meaning |\n| --- | --- |\n" + "\n".join(rows) + "\n"
        f"| `{LEASE_STOP_REQUESTED_AT}` | Written by the operator: a drain's request to "
        "checkpoint and exit; the trainer answers in `checkpoint-requested-at`. |\n"
    )


def render_reference() -> str:
    """The reference as Markdown (deterministic: same models, same bytes)."""
    return _Reference().render()


def main(argv: list[str]) -> int:
    return print_write_or_check(argv, render_reference(), (REFERENCE_PATH,), "rlhfjob.docgen")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
