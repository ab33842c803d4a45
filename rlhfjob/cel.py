"""CEL validation rules, declared once and enforced twice.

Each cross-field rule is written once as a Kubernetes `x-kubernetes-validations` entry. The CRD
generator copies it into the schema (the API server enforces it), and the pydantic models
evaluate the same expression with cel-python, so `rlhfjob render` and `kubectl apply` agree.
Transition rules (those that use `oldSelf`) only exist on the server: a file has no old object.

A rule sees an object the way the API server shows it to CEL (`cel_view`): property names that
are CEL reserved words or hold characters CEL identifiers cannot are escaped (`function` is
`self.__function__`), fields the schema does not declare are invisible, and map keys are data,
never escaped. So the same rule text works here and on the server.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

import celpy
from celpy import celtypes


@dataclass(frozen=True)
class CelRule:
    """One `x-kubernetes-validations` entry.

    `field_path` is relative to the object the rule is attached to (for example `.replicas`) and
    tells the API server which field to blame in the error.
    """

    rule: str
    message: str
    field_path: str | None = None
    reason: str = "FieldValueInvalid"

    @property
    def is_transition(self) -> bool:
        return "oldSelf" in self.rule

    def to_schema(self) -> dict[str, str]:
        entry = {"rule": self.rule, "message": self.message}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        if self.reason != "FieldValueInvalid":
            entry["reason"] = self.reason
        return entry


def immutable(field: str) -> CelRule:
    """A transition rule that forbids changing `field` once the object exists: set, unset,
    or removed (a field removed and set again would change it in two steps)."""
    name = escape(field)
    assert name is not None, field
    return CelRule(
        rule=f"has(self.{name}) == has(oldSelf.{name})"
        f" && (!has(self.{name}) || self.{name} == oldSelf.{name})",
        message=f"{field} is immutable: create a new RLHFJob to change it",
        field_path=f".{field}",
    )


UNCLEAN_PATH = "(^|/)[.][.]?(/|$)|//"
"""A `.` or `..` segment, or an empty one: a path that names another place once normalised."""


def clean_path(field: str) -> CelRule:
    """`field`, a path, has no `.`, `..` or empty segment: it names the place it reads as, for
    the rules that compare paths as strings and for the store or runtime that normalises it
    (a prefix `team-a/../team-b/` is another team's; a mount `/mnt/../mnt/checkpoints` hides
    the checkpoint volume)."""
    return CelRule(
        f"!has(self.{field}) || !self.{field}.matches('{UNCLEAN_PATH}')",
        f"{field} must not contain . or .. segments nor //",
        f".{field}",
    )


# ---------------------------------------------------------------------------------------------
# Property names as CEL sees them

RESERVED_WORDS = frozenset(
    {
        # CEL's reserved identifiers...
        *("as", "break", "const", "continue", "else", "for", "function", "if", "import"),
        *("let", "loop", "package", "namespace", "return", "var", "void", "while"),
        # ...and its literals and the `in` operator.
        *("true", "false", "null", "in"),
    }
)
"""Property names a rule must write as `__{name}__` (Kubernetes' escaping)."""

_ESCAPED_CHARACTERS = {"__": "__underscores__", ".": "__dot__", "-": "__dash__", "/": "__slash__"}
_TO_ESCAPE = re.compile(r"__|[^a-zA-Z0-9_]")


def escape(name: str) -> str | None:
    """The name a CEL rule uses for the property `name`, as Kubernetes escapes it, or None
    where the property is not visible to CEL at all (a leading digit, other characters)."""
    if not name or name[0].isdigit():
        return None
    if name in RESERVED_WORDS:
        return f"__{name}__"
    unsupported = False

    def replace(match: re.Match[str]) -> str:
        nonlocal unsupported
        if match.group() not in _ESCAPED_CHARACTERS:
            unsupported = True
            return ""
        return _ESCAPED_CHARACTERS[match.group()]

    escaped = _TO_ESCAPE.sub(replace, name)
    return None if unsupported else escaped


def _resolve(schema: dict[str, Any], defs: dict[str, Any], value: Any) -> dict[str, Any]:
    """Follow `$ref`s, and pick the variant of an `anyOf` that fits `value` (a pydantic
    schema's optional fields); a structural schema passes through unchanged."""
    while True:
        if "$ref" in schema:
            schema = {**defs[schema["$ref"].rsplit("/", 1)[-1]], **schema}
            del schema["$ref"]
        elif "anyOf" in schema and not schema.get("x-kubernetes-int-or-string"):
            fitting = [v for v in schema["anyOf"] if _fits(_resolve(v, defs, value), value)]
            if not fitting:
                return schema
            schema = fitting[0]
        else:
            return schema


def _fits(schema: dict[str, Any], value: Any) -> bool:
    kind = schema.get("type")
    if isinstance(value, dict):
        return kind == "object" or "properties" in schema
    if isinstance(value, list):
        return kind == "array"
    return kind not in ("object", "array", "null") or value is None


def cel_view(value: Any, schema: dict[str, Any], defs: dict[str, Any] | None = None) -> Any:
    """`value` as the API server shows it to a rule attached to a node of `schema` (a CRD's
    structural schema, or a pydantic JSON schema with its `$defs`): declared properties under
    their escaped names, undeclared ones (in objects that preserve unknown fields) hidden."""
    defs = defs or {}
    schema = _resolve(schema, defs, value)
    if isinstance(value, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        if properties is None and isinstance(extra, dict):  # a map: its keys are data
            return {key: cel_view(item, extra, defs) for key, item in value.items()}
        visible = {}
        for key, item in value.items():
            name = escape(key)
            if properties is not None and key in properties and name is not None:
                visible[name] = cel_view(item, properties[key], defs)
        return visible
    if isinstance(value, list):
        items = schema.get("items", {})
        return [cel_view(item, items, defs) for item in value]
    return value


# ---------------------------------------------------------------------------------------------
# Evaluation

QUANTITY_PATTERN = r"^[+-]?([0-9]+([.][0-9]*)?|[.][0-9]+)([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?$"
"""Kubernetes' resource quantity syntax ("500m", "16Gi", "1e3"), as `resource.ParseQuantity`
reads it."""


def _is_quantity(value: Any) -> celtypes.BoolType:
    """Kubernetes' CEL `isQuantity()`, which cel-python lacks."""
    return celtypes.BoolType(isinstance(value, str) and bool(re.fullmatch(QUANTITY_PATTERN, value)))


_ENVIRONMENT = celpy.Environment()  # at import: it raises the recursion limit, once


@cache
def _program(rule: str) -> celpy.Runner:
    return _ENVIRONMENT.program(_ENVIRONMENT.compile(rule), functions={"isQuantity": _is_quantity})


def broken(
    rules: tuple[CelRule, ...] | list[CelRule],
    obj: Any,
    schema: dict[str, Any] | None = None,
    defs: dict[str, Any] | None = None,
) -> list[CelRule]:
    """The non-transition `rules` that `obj` (the JSON form the API server would see) breaks.

    With the `schema` of the node the rules are attached to, `obj` is first shown as the server
    shows it to CEL (`cel_view`: escaped property names); without one it is taken as is.
    Results are remembered: cel-python interprets a rule in about 2 ms, and objects repeat (every
    job has the same defaulted sections; a fuzzed job differs from its base in one field).
    """
    value = obj if schema is None else cel_view(obj, schema, defs)
    key = json.dumps(value, sort_keys=True, separators=(",", ":"))
    activation: dict[str, Any] | None = None
    failed = []
    for rule in rules:
        if rule.is_transition:
            continue
        result = _RESULTS.get((rule.rule, key))
        if result is None:
            if activation is None:
                activation = {"self": celpy.json_to_cel(value)}
            result = _RESULTS[(rule.rule, key)] = _evaluate(rule.rule, activation)
        if not result:
            failed.append(rule)
    if len(_RESULTS) > _MAX_RESULTS:
        _RESULTS.clear()
    return failed


def holds(
    rule: CelRule,
    obj: Any,
    schema: dict[str, Any] | None = None,
    defs: dict[str, Any] | None = None,
) -> bool:
    """Whether `obj` satisfies a non-transition `rule` (see `broken`)."""
    return not broken((rule,), obj, schema, defs)


_RESULTS: dict[tuple[str, str], bool] = {}
_MAX_RESULTS = 65536


def _evaluate(rule: str, activation: dict[str, Any]) -> bool:
    try:
        result = _program(rule).evaluate(activation)
    except celpy.CELEvalError:  # raised rather than returned, for some type errors
        return False
    if isinstance(result, Exception):
        # cel-python returns evaluation errors as values; the API server rejects those objects too.
        return False
    return bool(result) if isinstance(result, celtypes.BoolType | bool) else False
