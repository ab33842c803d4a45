"""A job's NetworkPolicies enforced on real packets (issue 24): a policy nobody enforces in tests
is a claim, not a control.

`test_security.py` asks cyclonus what the stored policies allow; here kube-network-policies (SIG
Network's enforcer, `rlhf_local.enforcer`) drops what they refuse. The job's head and a worker,
a pod of another namespace, a pod of the job's namespace that is not the job's and a reward
server's pod (in a namespace the installation approved, `E2E_APPROVED_EGRESS`) each get a network
namespace carrying their podIP, as do the clouds' metadata addresses and the job's bucket (and an
address beside it). The job names its bucket by address, its reward server and its tracker by
name: the tracker's name opens an approved `0.0.0.0/0:443`, inside which every metadata address
must still be dropped. Every connection is tried twice: with nothing enforcing (each one opens,
so the wiring carries it and a blocked case can fail), then with the enforcer running (what the
policies refuse times out, what the job needs still opens).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rlhf_local import enforcer, pools
from rlhf_local.jobs import SLEEP_FOREVER, Jobs, job_manifest
from rlhf_local.operator_process import REWARD_SERVERS_LABEL, OperatorProcess
from rlhf_local.testing import LocalCluster, fresh_namespace, wait_for

pytestmark = pytest.mark.e2e

JOB = "packets"
BUCKET_AT = "10.1.2.3"
OUTSIDE = {"metadata": "169.254.169.254", "bucket": BUCKET_AT, "near-bucket": "10.1.2.4",
           "ecs-credentials": "169.254.170.2", "azure-wireserver": "168.63.129.16",
           "alibaba-metadata": "100.100.100.200"}  # fmt: skip
LISTENS = {"head": (6379, 8265, 10001), "metadata": (80, 443), "bucket": (8333,),
           "near-bucket": (8333, 8000, 443), "stranger": (8000,), "reward": (8000,),
           "ecs-credentials": (443,), "azure-wireserver": (443,),
           "alibaba-metadata": (443,)}  # fmt: skip
"""What each namespace serves: the head its Ray GCS, dashboard and client ports."""
TRACKER = "https://mlflow.example.com"
"""Matched by name by the e2e installation's `public-https` entry: every address on 443."""
BY_ENFORCER = "the job's NetworkPolicies, enforced on packets by kube-network-policies"
BLOCKED = [
    ("a pod in another namespace reaches a job's Ray dashboard", "stranger", "head", 8265),
    ("a pod in another namespace reaches a job's Ray client port", "stranger", "head", 10001),
    ("a pod in another namespace reaches a job's Ray GCS", "stranger", "head", 6379),
    ("a pod of the job's namespace that is not the job's reaches its Ray head", "neighbour",
     "head", 6379),
    ("a job's worker reaches the cloud metadata address", "worker", "metadata", 80),
    ("a job's head reaches the metadata address on the API server's port", "head", "metadata", 443),
    ("a job's worker reaches the bucket's port on another address", "worker", "near-bucket", 8333),
    ("a job's worker reaches another namespace's pod through its reward server's name",
     "worker", "stranger", 8000),
    ("a job's worker reaches an unapproved address on its reward server's approved port",
     "worker", "near-bucket", 8000),
    ("a job's worker reaches the metadata address inside an approved 0.0.0.0/0:443", "worker",
     "metadata", 443),
    ("a job's worker reaches AWS ECS/EKS credentials inside an approved 0.0.0.0/0:443",
     "worker", "ecs-credentials", 443),
    ("a job's worker reaches Azure's WireServer inside an approved 0.0.0.0/0:443", "worker",
     "azure-wireserver", 443),
    ("a job's worker reaches Alibaba's metadata inside an approved 0.0.0.0/0:443", "worker",
     "alibaba-metadata", 443),
]  # fmt: skip
ALLOWED = [
    ("worker", "head", 6379),
    ("worker", "head", 8265),
    ("worker", "head", 10001),
    ("worker", "bucket", 8333),  # the declared checkpoint bucket
    ("head", "bucket", 8333),
    ("worker", "reward", 8000),  # the approved reward servers' namespace, by name
    ("worker", "near-bucket", 443),  # the approved 0.0.0.0/0:443 its tracker's name opened
]
OPENS_WITHIN_S = 10.0
"""An allowed connection opens in milliseconds; this is slack for a loaded machine."""
DROPPED_AFTER_S = 1.5
"""How long a refused connection is given: its SYN is dropped, so it can only time out."""

Case = tuple[str, str, int]


def _attacks(test: Callable[..., None]) -> Callable[..., None]:
    for what, *_ in BLOCKED:
        test = pytest.mark.attack(what, BY_ENFORCER)(test)
    return test


def _plain_pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    """A pod of no job, fit for a "restricted" namespace, on a CPU node."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeSelector": {pools.POOL_LABEL: "cpu"},
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "main", "image": "curious:1",
                            "securityContext": {"allowPrivilegeEscalation": False,
                                                "capabilities": {"drop": ["ALL"]}}}],
        },
    }  # fmt: skip


def _with_ip(lc: LocalCluster, namespace: str, selector: str) -> Any:
    """The one running pod `selector` picks, once KWOK gave it a podIP."""

    def found() -> Any:
        pods = lc.core.list_namespaced_pod(namespace, label_selector=selector).items
        running = [p for p in pods if p.status.phase == "Running" and p.status.pod_ip]
        return running[0] if len(pods) == 1 and running else None

    return wait_for(found, 120, f"a running pod with a podIP for {selector} in {namespace}")


def _try(peers: dict[str, enforcer.Endpoint], cases: list[Case], timeout: float) -> list[bool]:
    """Whether each connection opens, all tried at once (a refused one waits out `timeout`)."""
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        tries = [
            pool.submit(enforcer.connects, peers[src], peers[dst].ip, port, timeout)
            for src, dst, port in cases
        ]
        return [t.result() for t in tries]


@pytest.fixture
def reward_namespace(local_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace the e2e installation approves reward servers in (by its label)."""
    yield from fresh_namespace(local_cluster, request, {REWARD_SERVERS_LABEL: "true"})


@_attacks
def test_the_enforced_network_policies_drop_what_they_refuse(
    local_cluster: LocalCluster,
    namespace: str,
    unrestricted_namespace: str,
    reward_namespace: str,
    operator: OperatorProcess,
) -> None:
    jobs = Jobs(local_cluster, namespace)
    bucket = {"bucket": "ckpts", "endpoint": f"http://{BUCKET_AT}:8333"}
    reward = {"type": "remote", "function": None,
              "remote": {"url": f"http://rm.{reward_namespace}:8000/score"}}  # fmt: skip
    tracking = {"mlflow": {"trackingUri": TRACKER}}
    spec = {"checkpoint": {"objectStore": bucket}, "reward": reward, "tracking": tracking}
    jobs.create(job_manifest(JOB, namespace, SLEEP_FOREVER, **spec))
    local_cluster.core.create_namespaced_pod(namespace, _plain_pod("neighbour", {"app": "x"}))
    local_cluster.core.create_namespaced_pod(
        unrestricted_namespace, _plain_pod("stranger", {"app": "curious"})
    )
    local_cluster.core.create_namespaced_pod(reward_namespace, _plain_pod("rm", {"app": "rm"}))
    pods = {
        "head": _with_ip(local_cluster, namespace, f"ray.io/cluster={JOB},ray.io/node-type=head"),
        "worker": _with_ip(local_cluster, namespace, f"ray.io/cluster={JOB},ray.io/group=trainer"),
        "neighbour": _with_ip(local_cluster, namespace, "app=x"),
        "stranger": _with_ip(local_cluster, unrestricted_namespace, "app=curious"),
        "reward": _with_ip(local_cluster, reward_namespace, "app=rm"),
    }
    wait_for(
        lambda: len(local_cluster.networking.list_namespaced_network_policy(namespace).items) == 2,
        60,
        "the job's two NetworkPolicies",
    )
    blocked: list[Case] = [(src, dst, port) for _, src, dst, port in BLOCKED]
    with contextlib.ExitStack() as stack:
        peers = {name: stack.enter_context(enforcer.pod_netns(pod)) for name, pod in pods.items()}
        peers |= {
            name: stack.enter_context(enforcer.address_netns(ip)) for name, ip in OUTSIDE.items()
        }
        for name, ports in LISTENS.items():
            stack.enter_context(enforcer.listening(peers[name], ports))

        before = _try(peers, ALLOWED + blocked, OPENS_WITHIN_S)
        unwired = [
            case for case, opened in zip(ALLOWED + blocked, before, strict=True) if not opened
        ]
        assert unwired == [], "these fail with nothing enforcing: the wiring, not the policy"

        with enforcer.running() as enforcing:
            allowed_now = _try(peers, ALLOWED, OPENS_WITHIN_S)
            blocked_now = _try(peers, blocked, DROPPED_AFTER_S)
            log = enforcing.log_tail(60)
        refused = [case for case, opened in zip(ALLOWED, allowed_now, strict=True) if not opened]
        let_through = [
            what for (what, *_), opened in zip(BLOCKED, blocked_now, strict=True) if opened
        ]
        assert (refused, let_through) == ([], []), log
        left = {table for table in enforcer.nft_tables() if enforcer.NAME in table[1]}
        assert left == set(), "an nftables table outlived the enforcer"
        assert not enforcer.queue_bound(), "the enforcer's queue outlived it"
