"""The job's NetworkPolicies: who reaches its pods, where they connect, never the metadata
address (`builder.build_network_policies`, `network`)."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from rlhf_operator import builder, names
from rlhf_operator.network import (
    METADATA_ADDRESSES,
    Destination,
    EgressSettingError,
    NetworkSettings,
)
from rlhfjob.config import parse_job
from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import valid_job

OWN = {"podSelector": {"matchLabels": {"rlhf.dev/job": "demo"}}}
DNS_RULE = {
    "to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
}
ANYWHERE = [
    {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]}},
    {"ipBlock": {"cidr": "::/0", "except": ["fd00:ec2::254/128"]}},
]
REMOTE_REWARD = {"type": "remote", "function": None, "remote": {"url": "http://rm.team.svc:8000/s"}}


def _policies(spec: dict[str, Any] | None = None, **settings: Any) -> tuple[dict, dict]:
    document = merge_patch(valid_job("demo"), {"spec": spec or {}})
    document["metadata"]["uid"] = "0000-uid"
    pods, head = builder.build_network_policies(
        parse_job(document), NetworkSettings(operator_namespace="rlhfjob-system", **settings)
    )
    return pods, head


def _ports(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def test_in_the_jobs_pods_the_operator_to_the_dashboard_and_prometheus_to_the_metrics() -> None:
    pods, _ = _policies(prometheus_namespaces=("monitoring",))
    assert pods["metadata"]["name"] == "demo-ray-head"
    assert pods["spec"]["podSelector"] == OWN["podSelector"]
    assert pods["spec"]["policyTypes"] == ["Ingress", "Egress"]
    own, operator, scrapes = pods["spec"]["ingress"]
    assert own == {"from": [OWN]}
    (peer,) = operator["from"]
    assert peer["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "rlhfjob-system"}
    }
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert operator["ports"] == _ports(8265)
    assert scrapes == {
        "from": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ],
        "ports": _ports(8080, 9400),
    }


@pytest.mark.attack(
    "anyone in the cluster reads a job's metrics ports",
    "the job's NetworkPolicy: metrics only from the chart's Prometheus namespaces",
)
def test_without_prometheus_namespaces_no_one_outside_the_job_scrapes_it() -> None:
    pods, _ = _policies()
    assert [rule["from"] for rule in pods["spec"]["ingress"]][2:] == []


@pytest.mark.attack(
    "a job's pods connect to other namespaces or the internet",
    "the job's NetworkPolicy egress rules (rlhf_operator.network)",
)
def test_a_job_that_declares_nothing_reaches_only_its_own_pods_and_dns() -> None:
    pods, _ = _policies()
    assert pods["spec"]["egress"] == [{"to": [OWN]}, DNS_RULE]


def test_a_bucket_at_an_ip_opens_that_address_alone_and_a_named_server_its_port() -> None:
    bucket = {"objectStore": {"bucket": "ckpts", "endpoint": "http://10.1.2.3:8333"}}
    pods, _ = _policies({"checkpoint": bucket, "reward": REMOTE_REWARD})
    _, _, to_bucket, to_reward = pods["spec"]["egress"]
    assert to_bucket == {"to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}], "ports": _ports(8333)}
    assert to_reward == {"to": [*ANYWHERE, {"namespaceSelector": {}}], "ports": _ports(8000)}


@pytest.mark.parametrize(
    ("endpoint", "port"), [(None, 443), ("https://s3.example.com", 443), ("http://s3:9000", 9000)]
)
def test_a_bucket_by_name_or_on_aws_opens_its_port_to_any_address_but_metadata(
    endpoint: str | None, port: int
) -> None:
    pods, _ = _policies({"checkpoint": {"objectStore": {"bucket": "ckpts", "endpoint": endpoint}}})
    assert pods["spec"]["egress"][2] == {
        "to": [*ANYWHERE, {"namespaceSelector": {}}],
        "ports": _ports(port),
    }


def test_the_head_alone_reaches_the_api_server() -> None:
    _, head = _policies()
    assert head["metadata"]["name"] == names.head_api_policy_name(parse_job(valid_job("demo")))
    assert head["spec"]["podSelector"] == {
        "matchLabels": {"rlhf.dev/job": "demo", "ray.io/node-type": "head"}
    }
    assert head["spec"]["policyTypes"] == ["Egress"]
    assert head["spec"]["egress"] == [{"to": ANYWHERE, "ports": _ports(443, 6443)}]
    _, named = _policies(api_server=(Destination.parse("10.0.0.1/32:6443"),))
    assert named["spec"]["egress"] == [
        {"to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}], "ports": _ports(6443)}
    ]


def test_extra_destinations_never_open_the_metadata_address() -> None:
    extra = tuple(
        Destination.parse(d)
        for d in ("0.0.0.0/0", "169.254.0.0/16:80", "169.254.169.254/32", "fd00::/8:443,8443")
    )
    pods, _ = _policies(extra_egress=extra)
    rules = pods["spec"]["egress"][2:]
    assert rules == [
        {"to": [ANYWHERE[0]]},
        {"to": [{"ipBlock": {"cidr": "169.254.0.0/16", "except": ["169.254.169.254/32"]}}],
         "ports": _ports(80)},
        {"to": [{"ipBlock": {"cidr": "fd00::/8", "except": ["fd00:ec2::254/128"]}}],
         "ports": _ports(443, 8443)},
    ]  # fmt: skip


@pytest.mark.attack(
    "a job's pods reach the cloud metadata address (the node's identity)",
    "the job's NetworkPolicies: every address block excepts it (rlhf_operator.network)",
)
def test_no_address_block_of_any_policy_admits_the_metadata_address() -> None:
    """Over every kind of destination: a block that covers it excepts it."""
    extra = tuple(
        Destination.parse(d)
        for d in ("0.0.0.0/0", "128.0.0.0/1", "169.254.169.0/24:80", "::/0", "fd00:ec2::/32")
    )
    bucket = {"objectStore": {"bucket": "ckpts", "endpoint": "http://169.254.169.254:80"}}
    policies = _policies({"checkpoint": bucket, "reward": REMOTE_REWARD}, extra_egress=extra)
    blocks = [
        peer["ipBlock"]
        for policy in policies
        for rule in policy["spec"]["egress"]
        for peer in rule["to"]
        if "ipBlock" in peer
    ]
    assert len(blocks) >= 8
    for block in blocks:
        for address in METADATA_ADDRESSES:
            if address in ipaddress.ip_network(block["cidr"]):
                assert f"{address}/{address.max_prefixlen}" in block.get("except", []), block


@pytest.mark.parametrize("text", ["10.0.0.0", "10.0.0.0/8:99999", "ten/8", "10.0.0.0/8:https"])
def test_an_unreadable_egress_setting_is_refused_naming_it(text: str) -> None:
    with pytest.raises(EgressSettingError, match="egress destination"):
        Destination.parse(text)
