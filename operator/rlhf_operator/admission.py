"""The chart's ValidatingAdmissionPolicy, generated from the job policy's CEL (`policy.checks`).

The API server runs the policy at apply; the operator runs `JobPolicy.problems` at a job's
first reconcile. Both come from `rlhf_operator.policy`: this module writes the chart template
(`charts/rlhfjob/templates/admission-policy.yaml`) from its variables and checks, the
installation's values filled in by Helm, and `evaluate` runs a rendered policy with
cel-python, which is how the tests hold the two forms to each other.

    python -m rlhf_operator.admission write   # rewrite the chart template
    python -m rlhf_operator.admission check   # exit 1 when it is stale
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Mapping
from typing import Any

import celpy
from celpy import celtypes

from rlhf_operator.policy import checks, variables
from rlhf_operator.policy_base import Check, Variable
from rlhfjob.api import GROUP, PLURAL, VERSION
from rlhfjob.crdgen import REPO_ROOT, print_write_or_check

TEMPLATE_PATH = REPO_ROOT / "charts" / "rlhfjob" / "templates" / "admission-policy.yaml"

INSTALLATION = (
    ("allowedVolumeTypes", "$policy.allowedVolumeTypes | default list | toJson"),
    ("allowedServiceAccounts", "$policy.allowedServiceAccounts | default list | toJson"),
    ("tolerateAllTaints", "$policy.tolerateAllTaints | default false | toJson"),
    (
        "allowedSystemPriorityClasses",
        "$policy.allowedSystemPriorityClasses | default list | toJson",
    ),
    ("allowedSchedulerNames", "$policy.allowedSchedulerNames | default list | toJson"),
    ("allowedNfsServers", "$policy.allowedNfsServers | default list | toJson"),
    ("allowedCsiDrivers", "$policy.allowedCsiDrivers | default list | toJson"),
    ("allowedImageRegistries", "$policy.allowedImageRegistries | default list | toJson"),
    ("allowedExtendedResources", "$policy.allowedExtendedResources | default list | toJson"),
    ("kueue", ".Values.kueue.enabled | default false | toJson"),
    ("queueRequired", "and .Values.kueue.enabled .Values.kueue.requireQueueName | toJson"),
    ("operatorNamespace", ".Release.Namespace | toJson"),
    ("operatorServiceAccount", 'include "rlhfjob.serviceAccountName" . | toJson'),
)
"""The variables the installation sets (the chart's values), as Helm renders each: a CEL
literal of the value."""

HEADER = f"""{{{{- /*
Generated from rlhf_operator/policy.py by `python -m rlhf_operator.admission write` (`task
crds`); do not edit. The job policy, enforced by the API server: an RLHFJob may not borrow the
operator's power. The operator creates each job's pods, so without this a user who may create
RLHFJobs could mount a hostPath (or any volume type) through spec.checkpoint.volume or a pod's
volumes, read a Secret of the namespace into the pods' environment where Secret volumes are not
allowed, or run the job's pods as another ServiceAccount of the namespace (the operator's own
included), run an image of a registry the installation does not list, request an extended
resource it does not list, or, where Kueue admits jobs, run without a queue label (outside its
team's quota). The operator checks the same rules at every reconcile; this refuses the job at
the door, naming the field. An UPDATE that leaves a field as it was is not re-checked, so a
job created before a policy change can still be finalized and deleted.
*/}}}}
{{{{- if .Values.jobPolicy.admissionPolicy.enabled }}}}
{{{{- $policy := .Values.jobPolicy }}}}
{{{{- $name := printf "%s-job-policy" (include "rlhfjob.clusterName" .) }}}}
{{{{- $secretsAllowed := has "secret" ($policy.allowedVolumeTypes | default list) }}}}
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata:
  name: {{{{ $name }}}}
  labels: {{{{- include "rlhfjob.labels" . | nindent 4 }}}}
spec:
  failurePolicy: Fail
  matchConstraints:
    resourceRules:
      - apiGroups: [{GROUP}]
        apiVersions: [{VERSION}]
        operations: [CREATE, UPDATE]
        resources: [{PLURAL}]
"""

BINDING = """---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata:
  name: {{ $name }}
  labels: {{- include "rlhfjob.labels" . | nindent 4 }}
spec:
  policyName: {{ $name }}
  validationActions: [Deny]
  {{- with .Values.watchNamespaces }}
  # The operator reconciles jobs in these namespaces only.
  matchResources:
    namespaceSelector:
      matchExpressions:
        - key: kubernetes.io/metadata.name
          operator: In
          values: {{- toYaml . | nindent 12 }}
  {{- end }}
{{- end }}
"""


def _scalar(text: str) -> str:
    """A YAML double-quoted scalar (JSON's string syntax is YAML's)."""
    return json.dumps(text)


def _guarded(lines: list[str], secrets_refused: bool) -> list[str]:
    if not secrets_refused:
        return lines
    return ["    {{- if not $secretsAllowed }}", *lines, "    {{- end }}"]


def _variable(variable: Variable) -> list[str]:
    lines = [f"    - name: {variable.name}", f"      expression: {_scalar(variable.expression)}"]
    return _guarded(lines, variable.secrets_refused)


def _check(check: Check) -> list[str]:
    lines = [
        f"    - expression: {_scalar(check.expression)}",
        "      reason: Forbidden",
        f"      message: {_scalar(check.message)}",
        f"      messageExpression: {_scalar(check.message_expression)}",
    ]
    return _guarded(lines, check.secrets_refused)


def render_template() -> str:
    """The chart template (deterministic: same policy, same bytes)."""
    lines = [HEADER.rstrip("\n"), "  variables:"]
    for name, helm in INSTALLATION:
        lines += [f"    - name: {name}", f"      expression: {{{{ {helm} | quote }}}}"]
    for variable in variables():
        lines += _variable(variable)
    lines.append("  validations:")
    for check in checks():
        lines += _check(check)
    return "\n".join(lines) + "\n" + BINDING


# ---------------------------------------------------------------------------------------------
# Running a rendered policy (what the API server does), for the tests


def _is_null(value: Any) -> bool:
    return value is None or isinstance(value, celtypes.NullType)  # cel-python's null is None


class _Map(celtypes.MapType):
    """A map that compares with null as Kubernetes' CEL does (heterogeneous equality: unequal),
    where cel-python raises; the policy's ``x != null`` steps need it."""

    def __eq__(self, other: Any) -> bool:
        return False if _is_null(other) else super().__eq__(other)

    def __ne__(self, other: Any) -> bool:
        return True if _is_null(other) else super().__ne__(other)

    __hash__ = None  # type: ignore[assignment]


class _List(celtypes.ListType):
    """A list that compares with null as Kubernetes' CEL does."""

    def __eq__(self, other: Any) -> bool:
        return False if _is_null(other) else super().__eq__(other)

    def __ne__(self, other: Any) -> bool:
        return True if _is_null(other) else super().__ne__(other)

    __hash__ = None  # type: ignore[assignment]


def _cel(value: Any) -> Any:
    """JSON as the API server hands it to CEL."""
    if isinstance(value, Mapping):
        return _Map({celtypes.StringType(k): _cel(v) for k, v in value.items()})
    if isinstance(value, list):
        return _List([_cel(item) for item in value])
    return celpy.json_to_cel(value)


def _join(items: celtypes.ListType, separator: celtypes.StringType) -> celtypes.StringType:
    """Kubernetes' CEL `<list<string>>.join(<string>)` (its strings library)."""
    return celtypes.StringType(str(separator).join(str(item) for item in items))


_ENVIRONMENT = celpy.Environment()
_VARIABLE = re.compile(r"\bvariables\.(\w+)")


@functools.cache
def _program(expression: str) -> celpy.Runner:
    return _ENVIRONMENT.program(_ENVIRONMENT.compile(expression), functions={"join": _join})


def evaluate(
    policy: Mapping[str, Any],
    job: Mapping[str, Any],
    *,
    namespace: str,
    old: Mapping[str, Any] | None = None,
) -> list[str]:
    """The messages of the validations `job` fails under a rendered policy's `spec` (CREATE,
    or UPDATE from `old`), as the API server would give them."""
    activation: dict[str, Any] = {
        "object": _cel(job),
        "oldObject": _cel(old),
        "request": _cel({"operation": "UPDATE" if old else "CREATE", "namespace": namespace}),
    }

    expressions = {variable["name"]: variable["expression"] for variable in policy["variables"]}
    values: dict[celtypes.StringType, Any] = {}

    def run(expression: str) -> Any:
        for name in _VARIABLE.findall(expression):  # only the variables it reads, in order
            key = celtypes.StringType(name)
            if key not in values:
                values[key] = run(expressions[name])
        return _program(expression).evaluate({**activation, "variables": celtypes.MapType(values)})

    return [
        str(run(validation["messageExpression"]))
        for validation in policy["validations"]
        if not bool(run(validation["expression"]))
    ]


def main(argv: list[str]) -> int:
    return print_write_or_check(
        argv, render_template(), (TEMPLATE_PATH,), "rlhf_operator.admission"
    )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
