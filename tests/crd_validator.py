"""Validate an object against a generated CRD schema the way the API server does, offline.

Defaults first, then the structural schema (types, enums, bounds, patterns, unknown fields),
then the CEL `x-kubernetes-validations` of every node, each seeing its object as the server
shows it to CEL (escaped property names). The point is to test *the generated CRD* (not the
models) in the fast unit tier; the e2e tier runs the same cases on a real server.

Patterns are matched with RE2, the API server's own regular-expression semantics (Python's `re`
would let `$` match before a final newline).
"""

from __future__ import annotations

import copy
from typing import Any

import re2

from rlhfjob.api.kubeschema import JSON_TYPES as _TYPES
from rlhfjob.cel import CelRule, broken


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def _check_scalar(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: Unsupported value: {value!r}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema:
            low = schema["minimum"]
            if value < low or (schema.get("exclusiveMinimum") and value == low):
                errors.append(f"{path}: should be greater than {low}")
        if "maximum" in schema:
            high = schema["maximum"]
            if value > high or (schema.get("exclusiveMaximum") and value == high):
                errors.append(f"{path}: should be less than {high}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: should be at least {schema['minLength']} chars long")
        if len(value) > schema.get("maxLength", len(value)):
            errors.append(f"{path}: Too long: may not be longer than {schema['maxLength']}")
        if "pattern" in schema and not re2.search(schema["pattern"], value):
            errors.append(f"{path}: should match {schema['pattern']!r}")
    return errors


def validate(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Every problem found in `value`, each starting with the field path the server would use."""
    if value is None:
        return [] if schema.get("nullable") else [f"{path}: Invalid value: null"]
    if schema.get("x-kubernetes-int-or-string"):
        variants = [
            v
            for v in schema.get("anyOf", [{"type": "integer"}, {"type": "string"}])
            if isinstance(value, _TYPES[v["type"]]) and not isinstance(value, bool)
        ]
        if not variants:
            return [f"{path}: must be an integer or a string"]
        # The node's own bounds and pattern (KubeRay's quantities have one) and the variant's.
        node = {k: v for k, v in schema.items() if k not in ("anyOf", "x-kubernetes-validations")}
        errors = _check_scalar({**node, **variants[0]}, value, path)
        return errors or _check_rules(schema, value, path)
    expected = schema.get("type")
    if expected and (
        not isinstance(value, _TYPES[expected])
        or (expected in ("integer", "number") and isinstance(value, bool))
    ):
        return [f"{path}: Invalid value: must be of type {expected}"]
    errors = _check_scalar(schema, value, path)
    if isinstance(value, dict):
        if len(value) > schema.get("maxProperties", len(value)):
            errors.append(f"{path}: Too many: must have at most {schema['maxProperties']} items")
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{path}.{name}: Required value".lstrip("."))
        properties = schema.get("properties")
        for name, item in value.items():
            child = f"{path}.{name}".lstrip(".")
            if properties is not None and name in properties:
                errors += validate(properties[name], item, child)
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += validate(schema["additionalProperties"], item, child)
            elif properties is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                errors.append(f'{child}: unknown field "{name}"')
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{path}: Too many: must have at most {schema['maxItems']} items")
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: Invalid value: must have at least {schema['minItems']} items")
        for index, item in enumerate(value):
            errors += validate(schema.get("items", {}), item, f"{path}[{index}]")
        errors += _duplicate_keys(schema, value, path)
    if not errors:  # the server skips CEL on nodes whose schema already failed
        errors = _check_rules(schema, value, path)
    return errors


def _duplicate_keys(schema: dict[str, Any], value: list[Any], path: str) -> list[str]:
    """An `x-kubernetes-list-type: map` list repeats no key (the server's check, not CEL)."""
    if schema.get("x-kubernetes-list-type") != "map":
        return []
    keys = schema["x-kubernetes-list-map-keys"]
    seen: set[tuple[Any, ...]] = set()
    errors = []
    for index, item in enumerate(value):
        key = tuple(item.get(name) for name in keys) if isinstance(item, dict) else (item,)
        if key in seen:
            errors.append(f"{path}[{index}]: Duplicate value: {key}")
        seen.add(key)
    return errors


def _check_rules(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    entries = schema.get("x-kubernetes-validations", [])
    if not entries:
        return []
    rules = [CelRule(e["rule"], e["message"], e.get("fieldPath")) for e in entries]
    errors = []
    for rule in broken(rules, value, schema):
        blamed = f"{path}{rule.field_path or ''}".lstrip(".")
        errors.append(f"{blamed}: Invalid value: {rule.message}")
    return errors


_PREPARED: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}


def _root_schema(crd: dict[str, Any]) -> dict[str, Any]:
    """The CRD's schema as the server applies it, prepared once per CRD (copying it per object
    would cost more than validating)."""
    prepared = _PREPARED.get(id(crd))
    if prepared is None or prepared[0] is not crd:
        schema = copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
        # The server validates the rest of ObjectMeta itself; the CRD may only constrain the name.
        schema.setdefault("properties", {}).setdefault("metadata", {"type": "object"})
        schema["properties"]["metadata"]["x-kubernetes-preserve-unknown-fields"] = True
        prepared = _PREPARED[id(crd)] = (crd, schema)
    return prepared[1]


def validate_object(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    schema = _root_schema(crd)
    return validate(schema, apply_defaults(schema, copy.deepcopy(obj)))
