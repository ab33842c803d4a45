"""The operator's own power, bounded: the chart's operator policy, rendered by Helm and run with
cel-python as the API server runs it, lets the operator's ServiceAccount write what the operator
makes for a job and refuses every write to anything else (issue 49). The same attempts against
the real API server, with the chart's RBAC: `e2e/tests/test_security.py`."""

from __future__ import annotations

import functools
import re
from typing import Any

import celpy
import pytest

from rlhf_local.build import cached_tool
from rlhf_local.operator_process import OPERATOR_NAMESPACE, chart_manifests, of_kind
from rlhf_operator import builder, names
from rlhf_operator.admission import _cel  # JSON as the API server hands it to CEL
from rlhf_operator.network import NetworkSettings
from rlhfjob import api
from rlhfjob.config import parse_job
from rlhfjob.contract import kueue
from rlhfjob.valid_cases import valid_job

pytestmark = pytest.mark.skipif(
    cached_tool("helm") is None,
    reason="helm missing: `python -m rlhf_local.build --tools` (task unit runs it)",
)

OPERATOR = f"system:serviceaccount:{OPERATOR_NAMESPACE}:rlhfjob"
"""The chart's ServiceAccount for the operator (release `rlhfjob`)."""
TEAM = "team-a"
API_SERVER = "networkPolicy.apiServerCIDRs={10.96.0.1/32:443}"
BY_POLICY = (
    "the chart's operator policy (a ValidatingAdmissionPolicy matched to the operator's "
    "ServiceAccount), run with cel-python"
)
_ENVIRONMENT = celpy.Environment()


@functools.cache
def _program(expression: str) -> celpy.Runner:
    return _ENVIRONMENT.program(_ENVIRONMENT.compile(expression))


@functools.cache
def _policy(*values: str) -> dict[str, Any]:
    manifests = chart_manifests(API_SERVER, *values)
    (policy,) = [
        m for m in of_kind(manifests, "ValidatingAdmissionPolicy")
        if m["metadata"]["name"].endswith("-operator-policy")
    ]  # fmt: skip
    return dict(policy["spec"])


def _resource(manifest: dict[str, Any]) -> tuple[str, str]:
    """(API group, plural) of a manifest's kind."""
    group = manifest["apiVersion"].rpartition("/")[0]
    kind = manifest["kind"].lower()
    return group, kind[:-1] + "ies" if kind.endswith("y") else kind + "s"


def refusals(
    operation: str,
    new: dict[str, Any] | None,
    old: dict[str, Any] | None = None,
    *,
    user: str = OPERATOR,
    values: tuple[str, ...] = (),
    sub_resource: str = "",
) -> list[str] | None:
    """The messages of the operator policy's refusals of one request (empty: admitted); None
    when the policy does not match it (another user's)."""
    written = new if new is not None else old
    assert written is not None
    group, resource = _resource(written)
    request = {
        "operation": operation,
        "userInfo": {"username": user},
        "kind": {"group": group, "kind": written["kind"]},
        "resource": {"group": group, "resource": resource},
        "subResource": sub_resource,
        "namespace": written["metadata"].get("namespace", ""),
        "name": written["metadata"].get("name", ""),
    }
    spec = _policy(*values)
    activation: dict[str, Any] = {
        "object": _cel(new),
        "oldObject": _cel(old),
        "request": _cel(request),
    }
    if not all(_program(c["expression"]).evaluate(activation) for c in spec["matchConditions"]):
        return None
    variables: dict[celpy.celtypes.StringType, Any] = {}
    for variable in spec["variables"]:  # each reads only those before it
        evaluated = _program(variable["expression"]).evaluate(
            {**activation, "variables": celpy.celtypes.MapType(variables)}
        )
        variables[celpy.celtypes.StringType(variable["name"])] = evaluated
    activation["variables"] = celpy.celtypes.MapType(variables)
    return [
        str(_program(v["messageExpression"]).evaluate(activation))
        for v in spec["validations"]
        if not bool(_program(v["expression"]).evaluate(activation))
    ]


def _job() -> Any:
    document = valid_job("demo")
    document["metadata"].update(namespace=TEAM, uid="0000-uid")
    document["metadata"]["labels"] = {kueue.LABEL_QUEUE_NAME: "team-a"}  # it has a Workload
    return parse_job(document)


def _owned() -> list[dict[str, Any]]:
    """Everything the operator writes for a job (Kueue's Workload included)."""
    job = _job()
    return [
        *builder.build_owned_objects(job, "t0ken", NetworkSettings(OPERATOR_NAMESPACE)),
        builder.build_heartbeat_lease(job),
        builder.build_workload(job, None),
    ]


def _plain(kind: str, api_version: str, namespace: str, name: str, **body: Any) -> dict[str, Any]:
    """An object of someone else's: no labels of the operator's jobs."""
    metadata = {"name": name, "namespace": namespace, "labels": {"app": "theirs"}}
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, **body}


def _labelled(manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` carrying the labels of a job's object, as a compromised operator would put."""
    labels = {**manifest["metadata"]["labels"], **names.job_labels(_job())}
    return {**manifest, "metadata": {**manifest["metadata"], "labels": labels}}


def _event(api_version: str, kind: str) -> dict[str, Any]:
    involved = {"apiVersion": api_version, "kind": kind, "name": "demo", "namespace": TEAM}
    return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "e", "namespace": TEAM},
            "involvedObject": involved, "reason": "Restarted", "message": "x"}  # fmt: skip


@pytest.mark.parametrize(
    "values", [(), ("watchNamespaces={team-a,team-b}",)], ids=["cluster", "ns"]
)
def test_everything_the_operator_writes_for_a_job_passes_its_policy(values: tuple[str]) -> None:
    for manifest in _owned():
        assert refusals("CREATE", manifest, values=values) == [], manifest["kind"]
        assert refusals("UPDATE", manifest, manifest, values=values) == [], manifest["kind"]
    cluster = next(m for m in _owned() if m["kind"] == "RayCluster")
    assert refusals("DELETE", None, cluster, values=values) == []
    workload = next(m for m in _owned() if m["kind"] == "Workload")
    assert refusals("UPDATE", workload, workload, sub_resource="status") == []
    # Its own API: the job's status and kopf's finalizer (the job carries none of its labels).
    job = {"apiVersion": api.API_VERSION, "kind": api.KIND,
           "metadata": {"name": "demo", "namespace": TEAM}}  # fmt: skip
    assert refusals("UPDATE", job, job, sub_resource="status") == []
    assert refusals("DELETE", None, job) == []  # its TTL
    assert refusals("CREATE", _event(api.API_VERSION, api.KIND)) == []


def test_the_policy_matches_the_operators_requests_only() -> None:
    theirs = _plain("ConfigMap", "v1", TEAM, "settings", data={"a": "1"})
    assert refusals("UPDATE", theirs, theirs, user=f"system:serviceaccount:{TEAM}:deployer") is None
    assert refusals("UPDATE", theirs, theirs, user="system:serviceaccount:other-ns:rlhfjob") is None
    assert refusals("UPDATE", theirs, theirs)  # the control: refused to the operator


ROLE_BINDING = "rbac.authorization.k8s.io/v1"
LEADER_LEASE = _plain("Lease", "coordination.k8s.io/v1", "kube-system", "kube-scheduler",
                      spec={"holderIdentity": "node-1"})  # fmt: skip
NODE_LEASE = _plain("Lease", "coordination.k8s.io/v1", "kube-node-lease", "gpu-node-1",
                    spec={"holderIdentity": "gpu-node-1"})  # fmt: skip
THEIR_BINDING = _plain(
    "RoleBinding", ROLE_BINDING, TEAM, "deployers",
    roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
    subjects=[{"kind": "ServiceAccount", "name": "ci", "namespace": TEAM}],
)  # fmt: skip
HEARTBEAT_ROLE = next(m for m in builder.build_trainer_rbac(_job()) if m["kind"] == "Role")
HEARTBEAT_BINDING = next(
    m for m in builder.build_trainer_rbac(_job()) if m["kind"] == "RoleBinding"
)
SECRETS_RULE = {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]}
ELSEWHERE = {"kind": "ServiceAccount", "name": "default", "namespace": "kube-system"}
PROTECTED = "may write nothing in namespace"
NOT_ITS_OWN = "may write only the objects of its jobs"


def _slug(what: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", what.split(" (")[0].lower()).strip("-")


def _changed(manifest: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**manifest, **fields}


# (what the attacker does, operation, new object, old object, a words of the refusal)
ATTACKS: list[tuple[str, str, dict[str, Any] | None, dict[str, Any] | None, str]] = [
    ("patches a team's ConfigMap that is not its jobs'", "UPDATE",
     _plain("ConfigMap", "v1", TEAM, "settings", data={"a": "2"}),
     _plain("ConfigMap", "v1", TEAM, "settings", data={"a": "1"}), NOT_ITS_OWN),
    ("takes over kube-system's leader election Lease", "UPDATE",
     _changed(LEADER_LEASE, spec={"holderIdentity": "attacker"}), LEADER_LEASE, PROTECTED),
    ("renews a node's Lease in kube-node-lease (a dead node looks alive)", "UPDATE",
     _changed(NODE_LEASE, spec={"holderIdentity": "attacker"}), NODE_LEASE, PROTECTED),
    ("patches a RoleBinding that is not its own", "UPDATE",
     _changed(THEIR_BINDING, subjects=[*THEIR_BINDING["subjects"], ELSEWHERE]), THEIR_BINDING,
     NOT_ITS_OWN),
    ("deletes a team's ConfigMap that is not its jobs'", "DELETE", None,
     _plain("ConfigMap", "v1", TEAM, "settings"), NOT_ITS_OWN),
    ("creates a RayCluster (pods of any spec) in kube-system, labelled as a job's", "CREATE",
     _changed(next(m for m in _owned() if m["kind"] == "RayCluster"),
              metadata={"name": "x", "namespace": "kube-system",
                        "labels": names.job_labels(_job())}), None, PROTECTED),
    ("writes a Secret in its own namespace (beside the chart's key)", "CREATE",
     _labelled(_plain("Secret", "v1", OPERATOR_NAMESPACE, "rlhfjob-ray-auth-key")), None,
     PROTECTED),
    ("creates a Role that grants Secrets, labelled as a job's", "CREATE",
     _changed(HEARTBEAT_ROLE, rules=[*HEARTBEAT_ROLE["rules"], SECRETS_RULE]), None,
     "may grant only get, update and patch on named Leases"),
    ("grants a job's trainer every Lease of its namespace", "CREATE",
     _changed(HEARTBEAT_ROLE, rules=[{**HEARTBEAT_ROLE["rules"][0], "resourceNames": []}]), None,
     "may grant only get, update and patch on named Leases"),
    ("binds a ClusterRole in a team's namespace, labelled as a job's", "CREATE",
     _changed(HEARTBEAT_BINDING, roleRef={**HEARTBEAT_BINDING["roleRef"], "kind": "ClusterRole",
                                          "name": "admin"}), None,
     "may bind only a Role to ServiceAccounts of its namespace"),
    ("binds a job's role to a ServiceAccount of another namespace", "CREATE",
     _changed(HEARTBEAT_BINDING, subjects=[ELSEWHERE]), None,
     "may bind only a Role to ServiceAccounts of its namespace"),
    ("takes the job labels off an object of its job (to hand it over)", "UPDATE",
     _changed(HEARTBEAT_ROLE, metadata={**HEARTBEAT_ROLE["metadata"], "labels": {}}),
     HEARTBEAT_ROLE, NOT_ITS_OWN),
    ("forges an Event about a Pod", "CREATE", _event("v1", "Pod"), None,
     "may post Events about RLHFJobs only"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("operation", "new", "old", "words"),
    [
        pytest.param(operation, new, old, words, id=_slug(what),
                     marks=pytest.mark.attack(f"a compromised operator {what}", BY_POLICY))
        for what, operation, new, old, words in ATTACKS
    ],
)  # fmt: skip
@pytest.mark.parametrize("values", [(), ("watchNamespaces={team-a,kube-system}",)],
                         ids=["cluster", "ns"])  # fmt: skip
def test_the_operator_policy_refuses_a_write_that_is_not_its_jobs(
    operation: str,
    new: dict[str, Any] | None,
    old: dict[str, Any] | None,
    words: str,
    values: tuple[str, ...],
) -> None:
    refused = refusals(operation, new, old, values=values)
    assert refused, "admitted"
    assert any(words in message for message in refused), refused


def test_protected_namespaces_come_from_values_and_always_hold_the_release_namespace() -> None:
    lease = _changed(LEADER_LEASE, metadata={**LEADER_LEASE["metadata"], "namespace": "infra"})
    labelled = _labelled(lease)
    assert refusals("UPDATE", labelled, labelled) == []  # not protected by default
    values = ("operatorPolicy.protectedNamespaces={infra}",)
    refused = refusals("UPDATE", labelled, labelled, values=values)
    assert refused and PROTECTED in refused[0]
    secret = _labelled(_plain("Secret", "v1", OPERATOR_NAMESPACE, "x"))
    assert refusals("CREATE", secret, values=values)  # the release namespace stays protected
    assert refusals("CREATE", secret, values=("operatorPolicy.protectedNamespaces=null",))
