"""The operator's own power, bounded (issue 49), against the real API server: writes made with
the operator's own token (the chart's RBAC and operator policy applied, as `operator_kubeconfig`
gives the e2e operator) to what is not its jobs' are refused, its jobs' objects still pass; and
the operator pod's NetworkPolicy, as the API server stores it, asked of cyclonus. The same policy
run with cel-python on many more attempts: `tests/security/test_operator_bounds.py`.

Every attempt carries `attack(what, blocked_by)` (`benchmarks/security.py` lists them).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from rlhf_local import cluster, netpol
from rlhf_local.operator_process import (
    OPERATOR_NAMESPACE,
    OPERATOR_POLICY,
    chart_manifests,
    chart_service_account,
    operator_kubeconfig,
)
from rlhf_local.testing import RESTRICTED, LocalCluster, fresh_namespace, wait_for
from rlhf_operator import names
from rlhfjob.contract import kuberay as ray

pytestmark = pytest.mark.e2e


def _rbac_allows(lc: LocalCluster, verb: str, resource: str, namespace: str, group: str) -> bool:
    """Whether the chart's RBAC alone lets the operator's ServiceAccount do it."""
    user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{chart_service_account()}"
    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(
            user=user,
            groups=["system:serviceaccounts", f"system:serviceaccounts:{OPERATOR_NAMESPACE}"],
            resource_attributes=client.V1ResourceAttributes(
                verb=verb, resource=resource, namespace=namespace, group=group
            ),
        )
    )
    answer = client.AuthorizationV1Api(lc.api).create_subject_access_review(review)
    return bool(answer.status.allowed)


BY_OPERATOR_POLICY = (
    "the chart's operator policy (a ValidatingAdmissionPolicy matched to the operator's "
    "ServiceAccount), on the real API server, the operator holding the chart's RBAC"
)
COORDINATION, RBAC = "coordination.k8s.io", "rbac.authorization.k8s.io"


@pytest.fixture(scope="module")
def operator_api(
    local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[client.ApiClient]:
    """The API as the operator's ServiceAccount (a bound token, the chart's RBAC and operator
    policy applied), once the API server enforces the policy."""
    path = operator_kubeconfig(local_cluster, tmp_path_factory.mktemp("as-operator") / "config")
    api = config.new_client_from_config(config_file=str(path))
    probe = client.V1ConfigMap(metadata=client.V1ObjectMeta(name="probe"))

    def enforced() -> bool:
        try:
            client.CoreV1Api(api).create_namespaced_config_map("default", probe, dry_run="All")
        except ApiException as error:
            return error.status == 403 and OPERATOR_POLICY in (error.body or "")
        return False

    wait_for(enforced, 60, "the operator policy to take effect")
    try:
        yield api
    finally:
        api.close()


@pytest.fixture(scope="module")
def team(local_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A team's namespace with its own objects (none labelled as a job's) and one job's."""
    with contextlib.contextmanager(fresh_namespace)(local_cluster, request, RESTRICTED) as ns:
        job = {names.LABEL_JOB: "demo", **names.STANDARD_LABELS}
        meta = {"namespace": ns}
        for manifest in [
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta, "name": "settings"},
             "data": {"owner": "team"}},
            {"apiVersion": f"{RBAC}/v1", "kind": "Role", "metadata": {**meta, "name": "readers"},
             "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}]},
            {"apiVersion": f"{RBAC}/v1", "kind": "RoleBinding",
             "metadata": {**meta, "name": "readers"},
             "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": "readers"},
             "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}]},
            {"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {**meta, "name": "demo-config", "labels": job}, "data": {"step": "1"}},
            {"apiVersion": f"{COORDINATION}/v1", "kind": "Lease",
             "metadata": {**meta, "name": "demo", "labels": job}, "spec": {}},
        ]:  # fmt: skip
            local_cluster.apply(manifest)
        yield ns


def _first_lease(lc: LocalCluster, namespace: str) -> str:
    leases = client.CoordinationV1Api(lc.api).list_namespaced_lease(namespace).items
    assert leases, f"no Lease in {namespace} to try"
    return str(leases[0].metadata.name)


def _take_over_lease(api: client.ApiClient, namespace: str, name: str) -> None:
    """An update (PUT) of the Lease with the operator as its holder."""
    coordination = client.CoordinationV1Api(api)
    lease = coordination.read_namespaced_lease(name, namespace)
    lease.spec.holder_identity = "rlhfjob-operator"
    coordination.replace_namespaced_lease(name, namespace, lease)


OPERATOR_ATTEMPTS = [
    ("patches a team's ConfigMap that is not its jobs'", "configmaps", "", "team",
     lambda api, lc, ns: client.CoreV1Api(api).patch_namespaced_config_map(
         "settings", ns, {"data": {"owner": "operator"}})),
    ("takes over a Lease of kube-system (leader election, the API server's identity)",
     "leases", COORDINATION, "kube-system",
     lambda api, lc, ns: _take_over_lease(api, "kube-system", _first_lease(lc, "kube-system"))),
    ("renews a node's Lease in kube-node-lease (a lost node looks alive)",
     "leases", COORDINATION, "kube-node-lease",
     lambda api, lc, ns: _take_over_lease(
         api, "kube-node-lease", _first_lease(lc, "kube-node-lease"))),
    ("adds a subject to a team's RoleBinding that is not its own", "rolebindings", RBAC, "team",
     lambda api, lc, ns: client.RbacAuthorizationV1Api(api).patch_namespaced_role_binding(
         "readers", ns, [{"op": "add", "path": "/subjects/-", "value": {
             "kind": "ServiceAccount", "name": "default", "namespace": ns}}])),
]  # fmt: skip


@pytest.mark.parametrize(
    ("resource", "group", "where", "attempt"),
    [
        pytest.param(*attempt[1:], id=f"{attempt[3]}-{attempt[1]}",
                     marks=pytest.mark.attack(f"a compromised operator {attempt[0]}",
                                              BY_OPERATOR_POLICY))
        for attempt in OPERATOR_ATTEMPTS
    ],
)  # fmt: skip
def test_a_compromised_operator_cannot_write_what_is_not_its_jobs(
    resource: str,
    group: str,
    where: str,
    attempt: Any,
    operator_api: client.ApiClient,
    local_cluster: LocalCluster,
    team: str,
) -> None:
    namespace = team if where == "team" else where
    verb = "update" if resource == "leases" else "patch"
    assert _rbac_allows(local_cluster, verb, resource, namespace, group), "RBAC refuses already"
    before = _state(local_cluster, resource, namespace)
    with pytest.raises(ApiException) as refused:
        attempt(operator_api, local_cluster, team)
    assert refused.value.status == 403 and OPERATOR_POLICY in refused.value.body, refused.value
    assert _state(local_cluster, resource, namespace) == before, "changed"


def _state(lc: LocalCluster, resource: str, namespace: str) -> list[Any]:
    """What an attempt would change: each Lease's holder (nodes renew theirs all the time), or
    each object's resourceVersion."""
    items = json.loads(lc.kubectl("get", resource, "-n", namespace, "-o", "json"))["items"]
    if resource == "leases":
        return [item["spec"].get("holderIdentity") for item in items]
    return [item["metadata"]["resourceVersion"] for item in items]


def test_the_operator_still_writes_its_jobs_objects(
    operator_api: client.ApiClient, local_cluster: LocalCluster, team: str
) -> None:
    """The control: the same verbs on objects labelled as a job's pass the same policy."""
    core = client.CoreV1Api(operator_api)
    core.patch_namespaced_config_map("demo-config", team, {"data": {"step": "2"}})
    assert local_cluster.core.read_namespaced_config_map("demo-config", team).data == {"step": "2"}
    _take_over_lease(operator_api, team, "demo")
    client.CoordinationV1Api(operator_api).patch_namespaced_lease(
        "demo", team, {"metadata": {"annotations": {"rlhf.dev/stop": "drain"}}}
    )


# -- the operator pod's own NetworkPolicy, as the API server stores it, asked of cyclonus ------

OPERATOR_NETPOL_API = "10.96.0.1"
BY_OPERATOR_NETPOL = "the operator pod's NetworkPolicy (the chart's), evaluated by cyclonus"


@pytest.fixture(scope="module")
def operator_netpol(local_cluster: LocalCluster) -> list[dict[str, Any]]:
    """The chart's NetworkPolicy of the operator pod, as a server-side dry run stores it."""
    values = (f"networkPolicy.apiServerCIDRs={{{OPERATOR_NETPOL_API}/32:443}}",)
    (policy,) = [m for m in chart_manifests(*values) if m["kind"] == "NetworkPolicy"]
    local_cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)
    stored = client.NetworkingV1Api(local_cluster.api).create_namespaced_network_policy(
        OPERATOR_NAMESPACE, policy, dry_run="All"
    )
    return [local_cluster.api.sanitize_for_serialization(stored)]


def _operator_peer(name: str) -> netpol.Peer:
    job = {**names.STANDARD_LABELS, names.LABEL_JOB: "demo"}
    return {
        "operator": netpol.Peer(
            "10.244.1.1",
            OPERATOR_NAMESPACE,
            {**names.OPERATOR_POD_LABELS, "app.kubernetes.io/instance": "rlhfjob"},
        ),
        "head": netpol.Peer("10.244.0.10", "team-a", {**job, ray.LABEL_NODE_TYPE: ray.NODE_HEAD}),
        "worker": netpol.Peer("10.244.0.11", "team-a", {**job, ray.LABEL_NODE_TYPE: "worker"}),
        "stranger": netpol.Peer("10.244.9.9", "elsewhere", {"app": "curious"}),
        "stranger-head": netpol.Peer(
            "10.244.9.8", "elsewhere", {ray.LABEL_NODE_TYPE: ray.NODE_HEAD}
        ),
        "prometheus": netpol.Peer("10.244.2.2", "monitoring", {"app": "prometheus"}),
        "kubelet": netpol.Peer("10.0.0.5"),
        "dns": netpol.Peer("10.244.3.3", "kube-system", {"k8s-app": "kube-dns"}),
        "api": netpol.Peer(OPERATOR_NETPOL_API),
        "metadata": netpol.Peer("169.254.169.254"),
        "outside": netpol.Peer("8.8.8.8"),
    }[name]


OPERATOR_BLOCKED = [
    ("a pod outside Prometheus's namespaces reads the operator's metrics", "stranger",
     "operator", 8080),
    ("a job's head, through a redirect, makes the operator reach the metadata address",
     "operator", "metadata", 80),
    ("a job's head, through a redirect, makes the operator reach an address of its choosing",
     "operator", "outside", 443),
    ("a job's head makes the operator reach a pod of another namespace (not a job's head)",
     "operator", "stranger", 8265),
    ("a pod labelled as a Ray head but no job's is reachable from the operator", "operator",
     "stranger-head", 8265),
    ("the operator reaches a job's worker (only heads serve the dashboard)", "operator",
     "worker", 8265),
]  # fmt: skip
OPERATOR_ALLOWED = [
    ("prometheus", "operator", 8080, "TCP"),
    ("kubelet", "operator", 8081, "TCP"),
    ("kubelet", "operator", 8082, "TCP"),
    ("operator", "head", 8265, "TCP"),
    ("operator", "dns", 53, "UDP"),
    ("operator", "api", 443, "TCP"),
]


@pytest.mark.parametrize(
    ("source", "destination", "port"),
    [
        pytest.param(source, destination, port, id=f"{source}-{destination}-{port}",
                     marks=pytest.mark.attack(what, BY_OPERATOR_NETPOL))
        for what, source, destination, port in OPERATOR_BLOCKED
    ],
)  # fmt: skip
def test_the_operator_pods_network_policy_refuses_the_connection(
    source: str, destination: str, port: int, operator_netpol: list[dict[str, Any]]
) -> None:
    connection = netpol.Connection(_operator_peer(source), _operator_peer(destination), port)
    assert netpol.allowed(cluster.binaries().cyclonus, operator_netpol, [connection]) == [False]


def test_the_operator_pods_network_policy_lets_it_work(
    operator_netpol: list[dict[str, Any]],
) -> None:
    """The controls: probes, scrapes, DNS, the API server and a job's head pass."""
    connections = [
        netpol.Connection(_operator_peer(source), _operator_peer(destination), port, protocol)
        for source, destination, port, protocol in OPERATOR_ALLOWED
    ]
    answers = netpol.allowed(cluster.binaries().cyclonus, operator_netpol, connections)
    assert answers == [True] * len(OPERATOR_ALLOWED), list(
        zip(OPERATOR_ALLOWED, answers, strict=True)
    )
