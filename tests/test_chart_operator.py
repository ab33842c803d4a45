"""The chart's bounds on the operator itself, rendered with `helm template`: its roles per mode,
its operator policy (the admission policy on its own writes, run in `tests/security/
test_operator_bounds.py`), its pod's NetworkPolicy and its probes."""

from __future__ import annotations

import ipaddress
import json
import subprocess
from typing import Any

import pytest

from rlhf_local.build import cached_tool
from rlhf_local.operator_process import (
    CHART,
    OPERATOR_NAMESPACE,
    chart_deployment,
    chart_manifests,
    chart_service_account,
    helm,
    of_kind,
)
from rlhf_operator import builder, names, readiness
from rlhf_operator.network import DNS_PODS, Destination
from rlhfjob.config import parse_job
from rlhfjob.contract import kuberay as ray
from rlhfjob.valid_cases import valid_job
from rlhfjob_cli import build_parser

pytestmark = pytest.mark.skipif(
    cached_tool("helm") is None,
    reason="helm missing: `python -m rlhf_local.build --tools` (task unit runs it)",
)

API_SERVER = "networkPolicy.apiServerCIDRs={10.96.0.1/32:443,172.18.0.2/32:6443,fd00::1/128}"
WATCHED = "watchNamespaces={team-a,team-b}"
MODES = pytest.mark.parametrize("mode", [(), (WATCHED,)], ids=["cluster", "namespaces"])
WRITES = {"create", "update", "patch", "delete", "deletecollection", "bind", "escalate"}


def _render(*values: str, **where: str) -> list[dict[str, Any]]:
    return chart_manifests(API_SERVER, *values, **where)


def _named(manifests: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    (found,) = [m for m in of_kind(manifests, kind) if m["metadata"]["name"].endswith(suffix)]
    return found


def _network_policy(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    (policy,) = of_kind(manifests, "NetworkPolicy")
    return dict(policy["spec"])


@MODES
@pytest.mark.parametrize(("release", "namespace"), [("rlhfjob", OPERATOR_NAMESPACE), ("ml", "ops")])
def test_the_operator_policy_binds_the_releases_service_account(
    mode: tuple[str, ...], release: str, namespace: str
) -> None:
    manifests = _render(*mode, release=release, namespace=namespace)
    policy = _named(manifests, "ValidatingAdmissionPolicy", "-operator-policy")
    binding = _named(manifests, "ValidatingAdmissionPolicyBinding", "-operator-policy")
    user = f"system:serviceaccount:{namespace}:{chart_service_account(manifests)}"
    (condition,) = policy["spec"]["matchConditions"]
    assert condition["expression"] == f'request.userInfo.username == "{user}"'
    assert policy["spec"]["failurePolicy"] == "Fail"
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["*/*"] and rule["apiGroups"] == ["*"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE", "CONNECT"}
    assert binding["spec"] == {"policyName": policy["metadata"]["name"],
                               "validationActions": ["Deny"]}  # fmt: skip
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    protected = ["kube-system", "kube-public", "kube-node-lease", namespace]
    assert json.loads(variables["protectedNamespaces"]) == protected  # a CEL list literal
    off = _render(*mode, "operatorPolicy.enabled=false")
    assert [m["metadata"]["name"] for m in of_kind(off, "ValidatingAdmissionPolicy")] == [
        f"rlhfjob-{OPERATOR_NAMESPACE}-job-policy"
    ]


def test_listed_namespaces_leave_the_operator_no_cluster_wide_write() -> None:
    for values in ((WATCHED,), (WATCHED, "kueue.enabled=true")):
        manifests = _render(*values)
        for role in of_kind(manifests, "ClusterRole"):
            verbs = {verb for rule in role["rules"] for verb in rule["verbs"]}
            assert not verbs & WRITES, (role["metadata"]["name"], verbs)
        assert sorted(r["metadata"]["namespace"] for r in of_kind(manifests, "Role")) == [
            "team-a",
            "team-b",
        ]


@MODES
def test_the_operator_posts_events_but_never_changes_one(mode: tuple[str, ...]) -> None:
    """kopf posts Events (a POST each); no verb on them but create, and list (KubeRay's)."""
    manifests = _render(*mode)
    roles = [r for r in of_kind(manifests, "ClusterRole") + of_kind(manifests, "Role")
             if not r["metadata"]["name"].endswith(("-nodes", "-kueue"))]  # fmt: skip
    assert roles
    for role in roles:
        (events,) = [r for r in role["rules"] if "events" in r["resources"]]
        assert set(events["verbs"]) == {"create", "list"}


def test_the_readiness_probe_asks_the_operators_readiness_endpoint() -> None:
    container = chart_deployment(_render())["spec"]["template"]["spec"]["containers"][0]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    parsed = build_parser().parse_args(container["args"])
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == readiness.READY_PATH
    assert ports[probe["port"]] == parsed.readiness_port == 8082
    liveness = container["livenessProbe"]["httpGet"]
    assert ports[liveness["port"]] == parsed.health_port != parsed.readiness_port
    assert container["readinessProbe"]["timeoutSeconds"] > sum(readiness.CHECK_TIMEOUT)


@MODES
def test_the_operator_pods_network_policy_admits_probes_and_prometheus_only(
    mode: tuple[str, ...],
) -> None:
    manifests = _render(*mode, "networkPolicy.prometheusNamespaces={monitoring,observability}")
    spec = _network_policy(manifests)
    pod = chart_deployment(manifests)["spec"]["template"]
    assert spec["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    probes, metrics = spec["ingress"]
    assert "from" not in probes  # the kubelet's, from the node
    assert {p["port"] for p in probes["ports"]} == {ports["health"], ports["ready"]}
    assert [p["port"] for p in metrics["ports"]] == [ports["metrics"]]
    (namespaces,) = metrics["from"]
    (selector,) = namespaces["namespaceSelector"]["matchExpressions"]
    assert selector["values"] == ["monitoring", "observability"]
    unscraped = _network_policy(_render(*mode, "networkPolicy.prometheusNamespaces=null"))
    assert unscraped["ingress"] == [probes]


def _head_and_worker_labels() -> tuple[dict[str, str], dict[str, str]]:
    """The labels of a job's head and worker pods: the builder's, and KubeRay's node type."""
    document = valid_job("demo")
    document["metadata"].update(namespace="team-a", uid="0000-uid")
    cluster = builder.build_ray_cluster(parse_job(document))
    head = cluster["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    worker = cluster["spec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
    return ({**head, ray.LABEL_NODE_TYPE: ray.NODE_HEAD},
            {**worker, ray.LABEL_NODE_TYPE: "worker"})  # fmt: skip


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    matched = selector.get("matchLabels", {}).items() <= labels.items()
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "Exists"
        matched = matched and expression["key"] in labels
    return bool(matched)


@MODES
def test_the_operator_pod_reaches_dns_the_api_server_and_its_jobs_heads_only(
    mode: tuple[str, ...],
) -> None:
    manifests = _render(*mode)
    dns, *api_server, heads = _network_policy(manifests)["egress"]
    assert dns["to"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": DNS_PODS}}]
    assert {p["port"] for p in dns["ports"]} == {53}
    # The API server: the addresses and ports the operator gives its jobs' heads.
    container = chart_deployment(manifests)["spec"]["template"]["spec"]["containers"][0]
    wanted = [Destination.parse(arg) for arg in build_parser().parse_args(
        container["args"]).api_server_cidr]  # fmt: skip
    opened = [
        Destination(
            tuple(ipaddress.ip_network(peer["ipBlock"]["cidr"]) for peer in rule["to"]),
            tuple(port["port"] for port in rule.get("ports", ())),
        )
        for rule in api_server
    ]
    assert opened == wanted and len(wanted) == 3
    # Its jobs' heads, on the dashboard's port: a head's pods, never a worker's.
    assert heads["ports"] == [{"protocol": "TCP", "port": names.DASHBOARD_PORT}]
    (peer,) = heads["to"]
    head, worker = _head_and_worker_labels()
    assert _selects(peer["podSelector"], head) and not _selects(peer["podSelector"], worker)
    assert not _selects(peer["podSelector"], {ray.LABEL_NODE_TYPE: ray.NODE_HEAD})  # not ours
    listed = {
        "key": "kubernetes.io/metadata.name",
        "operator": "In",
        "values": ["team-a", "team-b"],
    }
    expected = {"matchExpressions": [listed]} if mode else {}
    assert peer["namespaceSelector"] == expected
    assert not of_kind(_render(*mode, "networkPolicy.operator.enabled=false"), "NetworkPolicy")


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("operatorPolicy.enable=true", "enable"),
        ("operatorPolicy.protectedNamespaces={Kube_System}", "protectedNamespaces"),
        ("networkPolicy.operator.enable=false", "enable"),
    ],
)
def test_values_schema_rejects_a_misspelt_operator_bound(value: str, named: str) -> None:
    with pytest.raises(subprocess.CalledProcessError) as raised:
        _render(value)
    assert named in raised.value.stderr


@pytest.mark.parametrize(
    "values",
    [["operatorPolicy.enabled=false", "networkPolicy.operator.enabled=false"], [WATCHED]],
    ids=["bounds-off", "namespaces"],
)
def test_chart_lints_clean_with_the_operators_bounds(values: list[str]) -> None:
    sets = [arg for value in [API_SERVER, *values] for arg in ("--set", value)]
    result = helm("lint", "--strict", str(CHART), *sets, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
