"""The job policy's rules about where pods run, each as its Python check and its CEL, side by side.

No job's pod may select or tolerate the control-plane nodes, tolerate every taint (unless the
installation allows it), take a `system-` priority class or another scheduler the installation
does not list. Part of `rlhf_operator.policy`.
"""

from __future__ import annotations

import functools
from typing import Any

from rlhf_operator.policy_base import (
    ROOTS,
    Check,
    Variable,
    allowed_text,
    cel_strings,
    field_or,
    is_set,
    pair,
    placement_places,
    same_side,
    unchanged,
)
from rlhfjob.api import ROLE_NAMES, RLHFJobSpec, Toleration

CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
"""Node labels and taints of control-plane nodes: no job's pod may select or tolerate them."""
SYSTEM_PRIORITY_PREFIX = "system-"
"""Kubernetes' own priority classes (system-cluster-critical, system-node-critical) and any a
platform names so: a job may use one only where the policy lists it."""
DEFAULT_SCHEDULER = "default-scheduler"
NOT_CONTROL_PLANE = "no job may select control-plane nodes"
EVERY_TAINT = "operator Exists without a key tolerates every taint"

# ---------------------------------------------------------------------------------------------
# Python


def placements(spec: RLHFJobSpec) -> dict[str, Any]:
    """The head and each role present, by field path: where nodes are selected and tolerated."""
    places: dict[str, Any] = {"spec.head": spec.head}
    for role in ROLE_NAMES:
        if (found := getattr(spec.roles, role)) is not None:
            places[f"spec.roles.{role}"] = found
    return places


def _affinity_keys(affinity: Any) -> list[str]:
    """The node label keys a Kubernetes affinity selects on (required and preferred terms)."""
    node = affinity.get("nodeAffinity") if isinstance(affinity, dict) else None
    if not isinstance(node, dict):
        return []
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
    terms = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
    terms = list(terms) if isinstance(terms, list) else []
    preferred = node.get("preferredDuringSchedulingIgnoredDuringExecution")
    for item in preferred if isinstance(preferred, list) else []:
        if isinstance(item, dict):
            terms.append(item.get("preference"))
    keys = []
    for term in terms:
        expressions = term.get("matchExpressions") if isinstance(term, dict) else None
        for expression in expressions if isinstance(expressions, list) else []:
            if isinstance(expression, dict) and isinstance(expression.get("key"), str):
                keys.append(expression["key"])
    return keys


def _toleration_problems(field: str, toleration: Toleration, tolerate_all: bool) -> list[str]:
    if toleration.key in CONTROL_PLANE_KEYS:
        return [f"{field}: tolerates the control-plane taint {toleration.key}"]
    if not toleration.key and not tolerate_all:
        return [
            f"{field}: {EVERY_TAINT} (the chart's jobPolicy.tolerateAllTaints allows it); "
            "name the taint"
        ]
    return []


def node_problems(spec: RLHFJobSpec, *, tolerate_all_taints: bool) -> list[str]:
    """Pods placed onto control-plane nodes, or onto every tainted node."""
    found: list[str] = []
    for place, where in placements(spec).items():
        for key in sorted(set(where.node_selector) & set(CONTROL_PLANE_KEYS)):
            found.append(f"{place}.nodeSelector: {key} selects control-plane nodes")
        for index, toleration in enumerate(where.tolerations):
            field = f"{place}.tolerations[{index}]"
            found += _toleration_problems(field, toleration, tolerate_all_taints)
        for key in _affinity_keys(getattr(where, "affinity", None)):
            if key in CONTROL_PLANE_KEYS:
                found.append(f"{place}.affinity: {key} selects control-plane nodes")
    return found


def scheduling_problems(
    spec: RLHFJobSpec,
    *,
    system_priority_classes: tuple[str, ...],
    scheduler_names: tuple[str, ...],
) -> list[str]:
    """Pods scheduled with more priority, or by another scheduler, than the policy gives."""
    found: list[str] = []
    pods = spec.pods
    priority = pods.priority_class_name if pods is not None else None
    if (
        priority
        and priority.startswith(SYSTEM_PRIORITY_PREFIX)
        and priority not in system_priority_classes
    ):
        allowed = allowed_text(system_priority_classes, "allowedSystemPriorityClasses")
        found.append(
            f"spec.pods.priorityClassName: {priority!r} is a system priority class ({allowed})"
        )
    scheduler = pods.scheduler_name if pods is not None else None
    if scheduler and scheduler != DEFAULT_SCHEDULER and scheduler not in scheduler_names:
        allowed = allowed_text(scheduler_names, "allowedSchedulerNames")
        found.append(f"spec.pods.schedulerName: {scheduler!r} is not allowed ({allowed})")
    return found


# ---------------------------------------------------------------------------------------------
# CEL

CONTROL_PLANE = cel_strings(CONTROL_PLANE_KEYS)
PLACEMENT_LEAVES = (("tolerations", "[]", False), ("nodeSelector", "{}", False))
AFFINITY = ("affinity", "{}", True)
"""The head has no affinity; every role has, and it may be null."""


def _affinity_keys_in(a: str, keys: str) -> str:
    """CEL: the affinity `a` selects on one of `keys` (`_affinity_keys`)."""
    node = f"{a}.nodeAffinity"
    required = f"{node}.requiredDuringSchedulingIgnoredDuringExecution"
    preferred = f"{node}.preferredDuringSchedulingIgnoredDuringExecution"
    matches = "exists(e, has(e.key) && e.key in " + keys + ")"
    return (
        f"({is_set(node)} && (({is_set(required)} && {is_set(f'{required}.nodeSelectorTerms')}"
        f" && {required}.nodeSelectorTerms.exists(t, {is_set('t.matchExpressions')}"
        f" && t.matchExpressions.{matches}))"
        f" || ({is_set(preferred)} && {preferred}.exists(p, {is_set('p.preference')}"
        f" && {is_set('p.preference.matchExpressions')}"
        f" && p.preference.matchExpressions.{matches}))))"
    )


def variables() -> list[Variable]:
    """Each place's tolerations, node selector and affinity; the pods' priority and scheduler."""
    found: list[Variable] = []
    for index, place in enumerate(placement_places()):
        leaves = (*PLACEMENT_LEAVES, *((AFFINITY,) if place.field != "spec.head" else ()))
        for root in ROOTS:
            for leaf, empty, nullable in leaves:
                name = same_side(root, f"{leaf}{index}")
                found.append(Variable(name, place.cel_list(root, leaf, empty, nullable)))
    for name, path in (
        ("priorityClass", "spec.pods.priorityClassName"),
        ("scheduler", "spec.pods.schedulerName"),
    ):
        found += pair(name, functools.partial(field_or, path=path, empty="''"))
    return found


def _node_checks(index: int, field: str) -> list[Check]:
    tolerations = f"variables.tolerations{index}"
    untolerated = unchanged(f"tolerations{index}")
    found = [
        Check.constant(
            f"{field}.tolerations",
            f"{untolerated} || !{tolerations}.exists(t, has(t.key) && t.key in {CONTROL_PLANE})",
            f"{field}.tolerations: no job may tolerate the control-plane taints",
        ),
        Check(
            f"{field}.tolerations",
            f"{untolerated} || variables.tolerateAllTaints"
            f" || {tolerations}.all(t, {is_set('t.key')} && t.key != '')",
            f"{field}.tolerations: {EVERY_TAINT}",
            f"'{field}.tolerations: {EVERY_TAINT} (the chart\\'s"
            " jobPolicy.tolerateAllTaints allows it); name the taint'",
        ),
        Check.constant(
            f"{field}.nodeSelector",
            f"{unchanged(f'nodeSelector{index}')}"
            f" || !variables.nodeSelector{index}.exists(k, k in {CONTROL_PLANE})",
            f"{field}.nodeSelector: {NOT_CONTROL_PLANE}",
        ),
    ]
    if field != "spec.head":
        found.append(
            Check.constant(
                f"{field}.affinity",
                f"{unchanged(f'affinity{index}')}"
                f" || !{_affinity_keys_in(f'variables.affinity{index}', CONTROL_PLANE)}",
                f"{field}.affinity: {NOT_CONTROL_PLANE}",
            )
        )
    return found


def _listed(variable: str) -> str:
    """CEL: the installation's list `variable`, in words (as `allowed_text` writes it)."""
    return f"(size({variable}) == 0 ? 'none' : {variable}.join(', '))"


def checks() -> list[Check]:
    """The control-plane and every-taint checks of each place; the priority and scheduler."""
    found = [
        check
        for index, place in enumerate(placement_places())
        for check in _node_checks(index, place.field)
    ]
    return [
        *found,
        Check(
            "spec.pods.priorityClassName",
            f"{unchanged('priorityClass')}"
            f" || !variables.priorityClass.startsWith('{SYSTEM_PRIORITY_PREFIX}')"
            " || variables.priorityClass in variables.allowedSystemPriorityClasses",
            "spec.pods.priorityClassName: a system priority class the job policy does not list",
            "'spec.pods.priorityClassName: ' + variables.priorityClass + ' is a system priority"
            f" class (allowed: ' + {_listed('variables.allowedSystemPriorityClasses')} + '; the"
            " chart\\'s jobPolicy.allowedSystemPriorityClasses)'",
        ),
        Check(
            "spec.pods.schedulerName",
            f"{unchanged('scheduler')} || variables.scheduler == ''"
            f" || variables.scheduler == '{DEFAULT_SCHEDULER}'"
            " || variables.scheduler in variables.allowedSchedulerNames",
            "spec.pods.schedulerName: a scheduler the job policy does not list",
            "'spec.pods.schedulerName: ' + variables.scheduler + ' is not allowed (allowed: ' +"
            f" {_listed('variables.allowedSchedulerNames')} + '; the chart\\'s"
            " jobPolicy.allowedSchedulerNames)'",
        ),
    ]
