"""CEL validation rules, declared once and enforced twice.

Each cross-field rule is written once as a Kubernetes `x-kubernetes-validations` entry. The CRD
generator copies it into the schema (the API server enforces it), and the pydantic models
evaluate the same expression with cel-python, so `rlhfjob render` and `kubectl apply` agree.
Transition rules (those that use `oldSelf`) only exist on the server: a file has no old object.
"""

from __future__ import annotations

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
    """A transition rule that forbids changing `field` once the object exists."""
    return CelRule(
        rule=f"!has(oldSelf.{field}) || !has(self.{field}) || self.{field} == oldSelf.{field}",
        message=f"{field} is immutable: create a new RLHFJob to change it",
        field_path=f".{field}",
    )


QUANTITY_PATTERN = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
"""Kubernetes' resource quantity syntax ("500m", "16Gi")."""


def _is_quantity(value: Any) -> celtypes.BoolType:
    """Kubernetes' CEL `isQuantity()`, which cel-python lacks."""
    return celtypes.BoolType(isinstance(value, str) and bool(re.match(QUANTITY_PATTERN, value)))


@cache
def _program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule), functions={"isQuantity": _is_quantity})


def holds(rule: CelRule, obj: dict[str, Any]) -> bool:
    """Evaluate a non-transition rule against `obj` (the JSON form the API server would see)."""
    result = _program(rule.rule).evaluate({"self": celpy.json_to_cel(obj)})
    if isinstance(result, Exception):
        # cel-python returns evaluation errors as values; the API server rejects those objects too.
        return False
    return bool(result) if isinstance(result, celtypes.BoolType | bool) else False
