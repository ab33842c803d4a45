"""Attacks on the operator's power, each an attempt that must fail against the real API server
and the operator running with the chart's RBAC (issue 24).

Every test carries `attack(what, blocked_by)`: `benchmarks/security.py` runs the marked tests
(these, `test_attacks.py`, the unit tier's `tests/security/`) and writes
`benchmarks/results/security.json` from the marks and the outcomes, so the table of attacks is
the tests themselves.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from rlhf_local import cluster, netpol
from rlhf_local.jobs import FINISH_AT_ONCE, Jobs, job_manifest
from rlhf_local.operator_process import (
    OPERATOR_NAMESPACE,
    REWARD_SERVERS_LABEL,
    OperatorProcess,
    chart_service_account,
)
from rlhf_local.testing import RESTRICTED, LocalCluster, fresh_namespace, wait_for
from rlhf_operator.names import OPERATOR_POD_LABELS
from rlhfjob import api
from rlhfjob.contract.kuberay import RAY_API_VERSION

pytestmark = pytest.mark.e2e

SHOWN_WITHIN_S = 60


@pytest.fixture
def jobs(local_cluster: LocalCluster, namespace: str) -> Jobs:
    return Jobs(local_cluster, namespace)


def _squat(kind: str, name: str, namespace: str) -> dict[str, Any]:
    """An object someone else made under the name the operator would give one of the job's."""
    metadata = {"name": name, "namespace": namespace, "labels": {"squatter": "yes"}}
    bodies: dict[str, dict[str, Any]] = {
        # A ServiceAccount with a cloud identity: what the job's pods would run as if adopted.
        "ServiceAccount": {
            "apiVersion": "v1",
            "metadata": {**metadata, "annotations": {"iam.example.com/role": "admin"}},
        },
        "ConfigMap": {"apiVersion": "v1", "data": {"owner": "someone else"}},
        "RoleBinding": {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "view",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
        },
        "RayCluster": {
            "apiVersion": RAY_API_VERSION,
            "spec": {
                "headGroupSpec": {
                    "rayStartParams": {},
                    "template": {  # never scheduled: no pool has this label
                        "spec": {
                            "nodeSelector": {"squat.example.com/nowhere": "true"},
                            "containers": [{"name": "ray-head", "image": "ray:squat"}],
                        }
                    },
                }
            },
        },
    }
    body = bodies[kind]
    return {"kind": kind, **body, "metadata": body.get("metadata", metadata)}


SQUATS = [
    ("ServiceAccount", "{job}-trainer", "serviceaccount"),
    ("ConfigMap", "{job}-config", "configmap"),
    ("RoleBinding", "{job}-heartbeat", "rolebinding"),
    ("RayCluster", "{job}", "raycluster"),
]


def _content(obj: dict[str, Any]) -> dict[str, Any]:
    """What the squatter wrote: everything but the server's bookkeeping and the status (KubeRay
    updates a RayCluster's status whoever made it)."""
    metadata = obj["metadata"]
    kept = ("labels", "annotations", "ownerReferences", "uid")
    return {
        **{key: value for key, value in obj.items() if key not in ("metadata", "status")},
        "metadata": {key: metadata.get(key) for key in kept},
    }


def _read(lc: LocalCluster, resource: str, name: str, namespace: str) -> dict[str, Any] | None:
    found = lc.kubectl("get", resource, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(found) if found.strip().startswith("{") else None


@pytest.mark.parametrize(
    ("kind", "pattern", "resource"),
    [
        pytest.param(
            *squat,
            id=squat[0],
            marks=pytest.mark.attack(
                f"a job named to collide with an existing {squat[0]} takes it over",
                "ownership check: created, never adopted (kube.Kube.apply)",
            ),
        )
        for squat in SQUATS
    ],
)
def test_an_object_named_like_the_jobs_own_is_never_adopted_changed_or_collected(
    kind: str,
    pattern: str,
    resource: str,
    jobs: Jobs,
    operator: OperatorProcess,
    local_cluster: LocalCluster,
) -> None:
    job = f"squat-{kind.lower()}"
    name = pattern.format(job=job)
    local_cluster.apply(_squat(kind, name, jobs.namespace))
    before = _read(local_cluster, resource, name, jobs.namespace)
    assert before is not None
    jobs.create(job_manifest(job, jobs.namespace, FINISH_AT_ONCE))
    status = jobs.wait_phase(job, "Failed", SHOWN_WITHIN_S, operator)["status"]
    assert f"{kind} {jobs.namespace}/{name} exists and is not this job's" in status["message"]
    after = _read(local_cluster, resource, name, jobs.namespace)
    assert after is not None
    assert after["metadata"].get("ownerReferences") is None, "adopted"
    assert _content(after) == _content(before), "changed"
    if kind != "RayCluster":
        assert jobs.ray_cluster(job) is None, "the job ran past the conflict"
    # Deleting the job takes only what it owns: the object stays.
    local_cluster.custom.delete_namespaced_custom_object(
        api.GROUP, api.VERSION, jobs.namespace, api.PLURAL, job
    )
    wait_for(lambda: _read(local_cluster, api.PLURAL, job, jobs.namespace) is None, 30, "job gone")
    config = f"{job}-config"
    if kind != "ConfigMap":  # the job's own objects do go (the garbage collector's work)
        wait_for(
            lambda: _read(local_cluster, "configmap", config, jobs.namespace) is None,
            60,
            f"the job's own ConfigMap {config} to be collected",
        )
    assert _read(local_cluster, resource, name, jobs.namespace) is not None


def _allowed(lc: LocalCluster, user: str, verb: str, resource: str, namespace: str) -> bool:
    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(
            user=user,
            groups=["system:serviceaccounts", f"system:serviceaccounts:{OPERATOR_NAMESPACE}"],
            resource_attributes=client.V1ResourceAttributes(
                verb=verb, resource=resource, namespace=namespace
            ),
        )
    )
    answer = client.AuthorizationV1Api(lc.api).create_subject_access_review(review)
    return bool(answer.status.allowed)


ATTACKS_ON_SECRETS: list[tuple[str, str]] = [
    ("get", "secrets"),
    ("list", "secrets"),
    ("watch", "secrets"),
    ("patch", "secrets"),  # a no-op patch answers with the Secret's data
    ("update", "secrets"),
    ("delete", "secrets"),
]


@pytest.mark.parametrize(
    ("verb", "resource"),
    [
        pytest.param(
            verb,
            resource,
            id=verb,
            marks=pytest.mark.attack(
                f"the operator's identity is used to {verb} a Secret",
                "the chart's RBAC: create only on secrets",
            ),
        )
        for verb, resource in ATTACKS_ON_SECRETS
    ],
)
def test_a_compromised_operator_cannot_read_or_change_a_secret(
    verb: str,
    resource: str,
    operator: OperatorProcess,
    local_cluster: LocalCluster,
    namespace: str,
) -> None:
    user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{chart_service_account()}"
    assert _allowed(local_cluster, user, "create", "secrets", namespace)  # the control
    assert not _allowed(local_cluster, user, verb, resource, namespace)


# -- the job's NetworkPolicies, as the API server stored them, asked of cyclonus ---------------

NETPOL_JOB = "netpol"
BUCKET_AT = "10.1.2.3"
REMOTE_REWARD = {"type": "remote", "function": None, "remote": {"url": "http://rm.rewards:8000/s"}}
OUTSIDE = netpol.Peer("8.8.8.8")
METADATA = netpol.Peer("169.254.169.254")
API_SERVER = netpol.Peer("10.96.0.1")


@pytest.fixture(scope="module")
def stored_policies(
    local_cluster: LocalCluster, operator: OperatorProcess, request: pytest.FixtureRequest
) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A job's NetworkPolicies as the operator made them and the API server stored them (the
    job never schedules: its policies come before its pods). Yields (namespace, policies)."""
    with contextlib.contextmanager(fresh_namespace)(local_cluster, request, RESTRICTED) as ns:
        manifest = job_manifest(
            NETPOL_JOB, ns, FINISH_AT_ONCE,
            checkpoint={"objectStore": {"bucket": "ckpts", "endpoint": f"http://{BUCKET_AT}:8333"}},
            reward=REMOTE_REWARD,
            head={"nodeSelector": {"pool.example.com/nowhere": "true"}},
        )  # fmt: skip
        Jobs(local_cluster, ns).create(manifest)
        networking = client.NetworkingV1Api(local_cluster.api)

        def stored() -> list[dict[str, Any]] | None:
            items = networking.list_namespaced_network_policy(ns).items
            found = [local_cluster.api.sanitize_for_serialization(p) for p in items]
            return found if len(found) == 2 else None

        yield ns, wait_for(stored, SHOWN_WITHIN_S, "the job's two NetworkPolicies")


def _pods(namespace: str) -> tuple[netpol.Peer, netpol.Peer]:
    job = {"rlhf.dev/job": NETPOL_JOB}
    return (
        netpol.Peer("10.244.0.10", namespace, {**job, "ray.io/node-type": "head"}),
        netpol.Peer("10.244.0.11", namespace, {**job, "ray.io/node-type": "worker"}),
    )


def _stranger() -> netpol.Peer:
    return netpol.Peer("10.244.9.9", "someone-elses-namespace", {"app": "curious"})


BY_CYCLONUS = "the job's NetworkPolicies as stored, evaluated by cyclonus (no CNI runs here)"
BLOCKED = [
    ("a pod in another namespace reaches a job's Ray dashboard", "stranger", "head", 8265),
    ("a pod in another namespace reaches a job's Ray client port", "stranger", "head", 10001),
    ("a pod outside Prometheus's namespaces reads a job's metrics", "stranger", "head", 9400),
    ("a job's worker reaches the cloud metadata address", "worker", "metadata", 80),
    ("a job's head reaches the metadata address on the API server's port", "head", "metadata", 443),
    ("a job's worker reaches an address its spec does not declare", "worker", "outside", 443),
    ("a job's worker reaches the API server (only the head may)", "worker", "api", 443),
    ("a job's head reaches another address on the API server's port", "head", "outside", 6443),
    ("a job's worker reaches a pod of another namespace", "worker", "stranger", 6379),
    ("a job's worker reaches the bucket's port on another address", "worker", "near-bucket", 8333),
    ("a job's reward server's name opens its port in any namespace", "worker", "stranger", 8000),
    ("a job's reward server's name opens its port on any address", "worker", "outside", 8000),
]
ALLOWED = [
    ("operator", "head", 8265, "TCP"),
    ("prometheus", "head", 9400, "TCP"),
    ("worker", "head", 6379, "TCP"),
    ("worker", "dns", 53, "UDP"),
    ("worker", "bucket", 8333, "TCP"),
    ("head", "api", 443, "TCP"),
    ("worker", "reward", 8000, "TCP"),  # the approved reward servers' namespace, by name
]


def _peer(name: str, namespace: str) -> netpol.Peer:
    head, worker = _pods(namespace)
    return {
        "head": head,
        "worker": worker,
        "stranger": _stranger(),
        "reward": netpol.Peer(
            "10.244.8.8", "rewards", {"app": "rm"}, {REWARD_SERVERS_LABEL: "true"}
        ),
        "metadata": METADATA,
        "outside": OUTSIDE,
        "api": API_SERVER,
        "bucket": netpol.Peer(BUCKET_AT),
        "near-bucket": netpol.Peer("10.1.2.4"),
        "operator": netpol.Peer("10.244.1.1", OPERATOR_NAMESPACE, dict(OPERATOR_POD_LABELS)),
        "prometheus": netpol.Peer("10.244.2.2", "monitoring", {"app": "prometheus"}),
        "dns": netpol.Peer("10.244.3.3", "kube-system", {"k8s-app": "kube-dns"}),
    }[name]


@pytest.mark.parametrize(
    ("source", "destination", "port"),
    [
        pytest.param(source, destination, port, id=f"{source}-{destination}-{port}",
                     marks=pytest.mark.attack(what, BY_CYCLONUS))
        for what, source, destination, port in BLOCKED
    ],
)  # fmt: skip
def test_the_stored_network_policies_refuse_the_connection(
    source: str, destination: str, port: int,
    stored_policies: tuple[str, list[dict[str, Any]]],
) -> None:  # fmt: skip
    namespace, policies = stored_policies
    connection = netpol.Connection(_peer(source, namespace), _peer(destination, namespace), port)
    assert netpol.allowed(cluster.binaries().cyclonus, policies, [connection]) == [False]


def test_the_stored_network_policies_let_the_job_work(
    stored_policies: tuple[str, list[dict[str, Any]]],
) -> None:
    """The controls: what the job needs passes the same policies."""
    namespace, policies = stored_policies
    connections = [
        netpol.Connection(_peer(source, namespace), _peer(destination, namespace), port, protocol)
        for source, destination, port, protocol in ALLOWED
    ]
    answers = netpol.allowed(cluster.binaries().cyclonus, policies, connections)
    assert answers == [True] * len(ALLOWED), list(zip(ALLOWED, answers, strict=True))
