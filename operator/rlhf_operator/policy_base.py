"""What every rule module of the job policy (`rlhf_operator.policy`) is written in.

The rules live by topic (`policy_secrets`, `policy_placement`, `policy_volumes`), each as its
Python check and its CEL side by side; this module holds what they share, so each topic reads as
rules only: the places of a job CEL reaches, the admission policy's records (`Variable`,
`Check`), null-safe CEL steps, and how a refusal names the chart's list of what is allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlhfjob.api import POD_PLACES, ROLE_NAMES, HeadSpec, RLHFJobSpec, Roles


def allowed_text(values: tuple[str, ...], value: str) -> str:
    """A refusal's reminder of what the installation allows, and where that is set."""
    return f"allowed: {', '.join(values) or 'none'}; the chart's jobPolicy.{value}"


@dataclass(frozen=True)
class Variable:
    """A CEL variable of the admission policy; `secrets_refused` ones exist only where the
    policy does not allow `secret` volumes (the chart renders them under that condition)."""

    name: str
    expression: str
    secrets_refused: bool = False


@dataclass(frozen=True)
class Check:
    """A validation of the admission policy: `expression` must hold; `field` is what it guards."""

    field: str
    expression: str
    message: str
    message_expression: str
    secrets_refused: bool = False

    @classmethod
    def constant(
        cls, field: str, expression: str, message: str, *, secrets_refused: bool = False
    ) -> Check:
        """A check whose message names nothing of the job: the same words in both forms."""
        return cls(field, expression, message, f"'{message}'", secrets_refused)


@dataclass(frozen=True)
class PodPlace:
    """Where a job sets pod overrides (`RLHFJobSpec.pod_places`), as CEL reaches it: each step
    below spec, and whether it may be null (an optional role, an unset `pod`)."""

    field: str
    """``spec.roles.reference.pod``: how messages name it."""
    steps: tuple[tuple[str, bool], ...]

    def cel_list(self, root: str, leaf: str, empty: str = "[]", nullable: bool = False) -> str:
        """CEL: the list (or map, `empty` ``{}``) `leaf` of this place in `root` (``object`` or
        ``oldObject``), or `empty` when any step is missing or null (every optional field is
        nullable in the CRD; a `nullable` leaf too)."""
        expr = f"{root}.spec"
        checks = [f"{root} != null", f"has({expr})"]
        for step, may_be_null in (*self.steps, (leaf, nullable)):
            expr = f"{expr}.{step}"
            checks.append(f"has({expr})")
            if may_be_null:
                checks.append(f"{expr} != null")
        return f"({' && '.join(checks)} ? {expr} : {empty})"


def _nullable(model: type[RLHFJobSpec] | type[HeadSpec] | type[Roles], name: str) -> bool:
    field = model.model_fields[name]
    return not field.is_required() and field.default is None


def pod_places() -> tuple[PodPlace, ...]:
    """Every place of pod overrides, from the API's models: spec.pods, the head's, each role's."""
    places = [PodPlace("spec.pods", (("pods", _nullable(RLHFJobSpec, "pods")),))]
    for place in POD_PLACES:
        steps: tuple[tuple[str, bool], ...]
        if place == "head":
            steps = (("head", _nullable(RLHFJobSpec, "head")), ("pod", _nullable(HeadSpec, "pod")))
        else:
            role = place.removeprefix("roles.")
            steps = (("roles", False), (role, _nullable(Roles, role)), ("pod", True))
        places.append(PodPlace(f"spec.{place}.pod", steps))
    return tuple(places)


def placement_places() -> tuple[PodPlace, ...]:
    """Where nodes are selected and tolerated (`policy_placement.placements`): the head and
    each role."""
    places = [PodPlace("spec.head", (("head", _nullable(RLHFJobSpec, "head")),))]
    for role in ROLE_NAMES:
        places.append(
            PodPlace(f"spec.roles.{role}", (("roles", False), (role, _nullable(Roles, role))))
        )
    return tuple(places)


# ---------------------------------------------------------------------------------------------
# CEL steps

ROOTS = ("object", "oldObject")
"""The job as sent, and (on an UPDATE) as it was: each field's variable comes in both."""


def is_set(expr: str) -> str:
    """CEL: `expr` (a field path) is set and not null."""
    return f"has({expr}) && {expr} != null"


def cel_strings(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{value}'" for value in values) + "]"


def present(root: str, path: str) -> str:
    """CEL: every step of `path` below `root` is set and not null."""
    parts, checks, expr = path.split("."), [f"{root} != null"], root
    for part in parts:
        checks.append(f"has({expr}.{part})")
        expr = f"{expr}.{part}"
        checks.append(f"{expr} != null")
    return " && ".join(checks)


def field_or(root: str, path: str, empty: str) -> str:
    """CEL: the field `path` of `root`, or `empty` where it or a step to it is unset or null."""
    return f"{present(root, path)} ? {root}.{path} : {empty}"


def same_side(root: str, name: str) -> str:
    """The variable `name` of `root`: the job as sent (``object``), or ``oldVolume`` and the like
    for the job before the UPDATE (``oldObject``)."""
    return name if root == "object" else f"old{name[0].upper()}{name[1:]}"


def pair(
    name: str, expression: Callable[[str], str], *, secrets_refused: bool = False
) -> list[Variable]:
    """The variable `name` and its twin of the job before an UPDATE, from `expression(root)`."""
    return [Variable(same_side(root, name), expression(root), secrets_refused) for root in ROOTS]


def unchanged(name: str) -> str:
    """CEL: an UPDATE that leaves the field as it was is not re-checked (so a job created before
    a policy change can still be finalized and deleted)."""
    return f"(variables.update && variables.{name} == variables.{same_side('oldObject', name)})"
