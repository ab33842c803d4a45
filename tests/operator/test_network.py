"""The job's NetworkPolicies: who reaches its pods, where they connect (only what the
installation approved and the spec names), never a link-local or metadata address
(`builder.build_network_policies`, `network`)."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path
from typing import Any

import pytest

from rlhf_operator import builder, names
from rlhf_operator.network import (
    NO_EGRESS,
    ApprovedEgress,
    Destination,
    EgressSettingError,
    NetworkSettings,
    job_destinations,
    url_destination,
)
from rlhfjob.config import parse_job
from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import valid_job

SECURITY_DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
OWN = {"podSelector": {"matchLabels": {"rlhf.dev/job": "demo"}}}
DNS_RULE = {
    "to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
}
V4_EXCEPT = ["169.254.0.0/16", "168.63.129.16/32", "100.100.100.200/32"]
V6_EXCEPT = ["fe80::/10", "fd00:ec2::254/128", "fd00:ec2::23/128", "fd20:ce::254/128",
             "fd00:42::42/128"]  # fmt: skip
ANYWHERE = [
    {"ipBlock": {"cidr": "0.0.0.0/0", "except": V4_EXCEPT}},
    {"ipBlock": {"cidr": "::/0", "except": V6_EXCEPT}},
]
REWARDS = {"matchLabels": {"kubernetes.io/metadata.name": "rewards"}}
APPROVED: dict[str, dict[str, Any]] = {
    "s3": {"cidrs": ["0.0.0.0/0:443", "::/0:443"], "hosts": ["*.amazonaws.com"]},
    "buckets": {"cidrs": ["10.1.0.0/16:8333", "10.9.0.0/16"], "hosts": ["*.buckets.internal"]},
    "reward-servers": {"namespaceSelector": REWARDS, "ports": [8000]},
    "mlflow": {"cidrs": ["10.20.0.0/16:5000"], "hosts": ["mlflow.example.com"]},
}


def remote_reward(url: str) -> dict[str, Any]:
    return {"type": "remote", "function": None, "remote": {"url": url}}


def approved(*entries: str) -> tuple[ApprovedEgress, ...]:
    return tuple(ApprovedEgress.parse(json.dumps({"name": e, **APPROVED[e]})) for e in entries)


def _job(spec: dict[str, Any] | None = None) -> Any:
    document = merge_patch(valid_job("demo"), {"spec": spec or {}})
    document["metadata"]["uid"] = "0000-uid"
    return parse_job(document)


def _policies(spec: dict[str, Any] | None = None, **settings: Any) -> tuple[dict, dict]:
    settings.setdefault("approved_egress", approved(*APPROVED))
    pods, head = builder.build_network_policies(
        _job(spec), NetworkSettings(operator_namespace="rlhfjob-system", **settings)
    )
    return pods, head


def _opened(spec: dict[str, Any], **settings: Any) -> list[dict[str, Any]]:
    """The egress rules beyond the job's own pods and DNS."""
    pods, _ = _policies(spec, **settings)
    assert pods["spec"]["egress"][:2] == [{"to": [OWN]}, DNS_RULE]
    return list(pods["spec"]["egress"][2:])


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
    assert _opened({}) == []


def test_an_ip_literal_opens_that_address_alone_on_its_port_inside_an_approved_block() -> None:
    bucket = {"objectStore": {"bucket": "ckpts", "endpoint": "http://10.1.2.3:8333"}}
    assert _opened({"checkpoint": bucket}) == [
        {"to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}], "ports": _ports(8333)}
    ]
    # A block without ports admits any, whatever the entry's hosts; outside every block (or
    # on a port it does not list) an address opens nothing.
    assert _opened({"reward": remote_reward("http://10.9.0.7:9000/s")}) == [
        {"to": [{"ipBlock": {"cidr": "10.9.0.7/32"}}], "ports": _ports(9000)}
    ]
    for url in ("http://10.1.2.3:9000/s", "http://10.2.0.1:8333/s", "http://[fd00::1]:8333/s"):
        assert _opened({"reward": remote_reward(url)}) == [], url


@pytest.mark.attack(
    "a job's hostname destination opens its port to every address and every namespace's pods",
    "the job's NetworkPolicy: a name opens only the approved entries it matches "
    "(networkPolicy.approvedEgress, rlhf_operator.network)",
)
def test_a_hostname_opens_only_the_approved_entries_it_matches_on_its_port() -> None:
    in_cluster = _opened({"reward": remote_reward("http://rm.rewards:8000/score")})
    assert in_cluster == [{"to": [{"namespaceSelector": REWARDS}], "ports": _ports(8000)}]
    # By host: the named entry only, on the URL's port (not the block's others).
    tracked = _opened({"tracking": {"mlflow": {"trackingUri": "http://mlflow.example.com:5000"}}})
    assert tracked == [{"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": _ports(5000)}]
    # A name no entry matches, on a port none lists, opens nothing at all.
    for url in ("http://evil.example.net:8443/s", "http://mlflow.example.com:8000.evil/s"):
        assert _opened({"reward": remote_reward(url)}) == [], url
    for opened in (in_cluster, tracked):
        peers = [peer for rule in opened for peer in rule["to"]]
        assert {"namespaceSelector": {}} not in peers
        assert not any(p.get("ipBlock", {}).get("cidr") in ("0.0.0.0/0", "::/0") for p in peers)


@pytest.mark.parametrize(
    ("region", "host"), [(None, "s3.amazonaws.com"), ("eu-west-1", "s3.eu-west-1.amazonaws.com")]
)
def test_a_bucket_without_endpoint_is_aws_s3_and_needs_an_approved_entry(
    region: str | None, host: str
) -> None:
    bucket = {"objectStore": {"bucket": "ckpts", "region": region}}
    (destination,) = job_destinations(_job({"checkpoint": bucket}))
    assert (destination.field, destination.host, destination.port) == (
        "spec.checkpoint.objectStore.endpoint", host, 443
    )  # fmt: skip
    assert _opened({"checkpoint": bucket}) == [{"to": ANYWHERE, "ports": _ports(443)}]
    assert _opened({"checkpoint": bucket}, approved_egress=approved("buckets")) == []


def test_combined_rewards_and_trackers_are_destinations_of_their_own_fields() -> None:
    components = [
        {"type": "function", "function": "m:f"},
        {"type": "remote", "remote": {"url": "https://rm.example.com/s"}},
    ]
    job = _job(
        {
            "reward": {"type": "combined", "function": None, "components": components},
            "tracking": {
                "mlflow": {"trackingUri": "http://10.1.2.3:5000"},
                "wandb": {"project": "p", "apiKeySecret": "wb"},
            },
        }
    )
    assert [(d.field, d.host, d.port) for d in job_destinations(job)] == [
        ("spec.reward.components[1].remote.url", "rm.example.com", 443),
        ("spec.tracking.mlflow.trackingUri", "10.1.2.3", 5000),
        ("spec.tracking.wandb.baseUrl", "api.wandb.ai", 443),
    ]


@pytest.mark.parametrize(
    ("host", "address"),
    [
        ("2852039166", "169.254.169.254"),
        ("0xa9.0xfe.0xa9.0xfe", "169.254.169.254"),
        ("[::ffff:169.254.169.254]", "169.254.169.254"),
        ("[fd00:ec2::254]", "fd00:ec2::254"),
        ("168.63.129.16", "168.63.129.16"),
        ("rm.example.com", None),
    ],
)
def test_an_ip_literal_is_read_in_every_spelling_a_resolver_takes(
    host: str, address: str | None
) -> None:
    found = url_destination("f", f"http://{host}:443/x").address
    assert found == (ipaddress.ip_address(address) if address else None)


@pytest.mark.parametrize(
    "text", ["http://:80/", "http://rm.example.com:99999/s", "http://rm.example.com:0/s"]
)
def test_a_url_without_a_readable_host_and_port_opens_nothing(text: str) -> None:
    destination = url_destination("f", text)
    assert destination.port is None
    assert NetworkSettings(approved_egress=approved(*APPROVED)).opens(destination) == []


def test_the_head_alone_reaches_the_api_server_and_only_where_the_installation_says() -> None:
    _, head = _policies()
    assert head["metadata"]["name"] == names.head_api_policy_name(_job())
    assert head["spec"]["podSelector"] == {
        "matchLabels": {"rlhf.dev/job": "demo", "ray.io/node-type": "head"}
    }
    assert head["spec"]["policyTypes"] == ["Egress"]
    assert head["spec"]["egress"] == []  # no range given: nowhere, never any address
    _, named = _policies(api_server=(Destination.parse("10.0.0.1/32:6443"),))
    assert named["spec"]["egress"] == [
        {"to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}], "ports": _ports(6443)}
    ]


def test_extra_destinations_are_open_to_every_job_and_cover_what_lies_inside() -> None:
    extra = tuple(Destination.parse(d) for d in ("0.0.0.0/0:80", "fd00::/8:443,8443"))
    assert _opened({}, extra_egress=extra, approved_egress=()) == [
        {"to": [ANYWHERE[0]], "ports": _ports(80)},
        {"to": [{"ipBlock": {"cidr": "fd00::/8", "except": V6_EXCEPT[1:]}}],
         "ports": _ports(443, 8443)},
    ]  # fmt: skip
    settings = NetworkSettings(extra_egress=extra)
    assert settings.opens(url_destination("f", "https://[fd00::5]/")) == [
        {"to": [{"ipBlock": {"cidr": "fd00::5/128"}}], "ports": _ports(443)}
    ]


@pytest.mark.attack(
    "a job's pods reach a link-local or cloud metadata address (the node's identity): AWS, "
    "GCP, GKE, Azure's WireServer, Alibaba, ECS/EKS credentials, IPv4 and IPv6",
    "the job's NetworkPolicies: every address block excepts NO_EGRESS (rlhf_operator.network)",
)
def test_no_address_block_of_any_policy_admits_a_link_local_or_metadata_address() -> None:
    """Over every kind of destination and every block an installation may approve."""
    wide = ("0.0.0.0/0", "128.0.0.0/1", "168.0.0.0/8:80", "100.64.0.0/10", "::/0", "fd00::/8")
    extra = tuple(Destination.parse(d) for d in wide)
    entry = ApprovedEgress("everything", blocks=extra)
    spec = {
        "checkpoint": {"objectStore": {"bucket": "ckpts"}},
        "reward": remote_reward("http://2852039166:80/s"),
        "tracking": {"mlflow": {"trackingUri": "http://[fd00:ec2::254]/"}},
    }
    policies = _policies(spec, extra_egress=extra, approved_egress=(entry,))
    blocks = [
        peer["ipBlock"]
        for policy in policies
        for rule in policy["spec"]["egress"]
        for peer in rule["to"]
        if "ipBlock" in peer
    ]
    assert len(blocks) >= 12
    for block in blocks:
        admitted = ipaddress.ip_network(block["cidr"])
        excepted = [ipaddress.ip_network(e) for e in block.get("except", [])]
        for cidr, _ in NO_EGRESS:
            forbidden = ipaddress.ip_network(cidr)
            if forbidden.version == admitted.version and forbidden.overlaps(admitted):
                assert any(forbidden.subnet_of(e) for e in excepted), (block, cidr)  # type: ignore[arg-type]


def test_every_address_no_job_may_reach_is_listed_in_the_security_doc() -> None:
    """One list (`NO_EGRESS`): the doc that says what a job can reach names each entry."""
    text = SECURITY_DOC.read_text()
    for cidr, _ in NO_EGRESS:
        address = cidr.removesuffix("/32").removesuffix("/128")
        assert re.search(rf"`{re.escape(address)}(/\d+)?`", text), cidr


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("10.0.0.0", "egress destination"),
        ("10.0.0.0/8:99999", "want CIDR"),
        ("ten/8", "egress destination"),
        ("10.0.0.0/8:https", "egress destination"),
        ("169.254.0.0/16:80", "IPv4 link-local"),
        ("168.63.129.16/32", "Azure WireServer"),
        ("fd00:ec2::254/128", "AWS instance metadata"),
    ],
)
def test_an_unreadable_or_forbidden_destination_setting_is_refused_naming_it(
    text: str, words: str
) -> None:
    with pytest.raises(EgressSettingError, match=re.escape(words)):
        Destination.parse(text)


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ("not json", "approved egress"),
        ('{"cidrs": ["10.0.0.0/8"]}', "want an object with a name"),
        ('{"name": "x", "cidrs": ["10.0.0.0/8"], "port": [1]}', "unknown keys port"),
        ('{"name": "x"}', "give cidrs or a namespace/pod selector"),
        ('{"name": "x", "cidrs": ["10.0.0.0/8"], "podSelector": {}, "ports": [1]}', "not both"),
        ('{"name": "x", "cidrs": ["10.0.0.0/8"], "ports": [1]}', "cidrs carry their ports"),
        ('{"name": "x", "namespaceSelector": {}}', "needs label selectors and its ports"),
        ('{"name": "x", "podSelector": {}, "ports": [0]}', "port 0"),
        ('{"name": "x", "cidrs": ["169.254.169.254/32:80"]}', "no job may reach"),
        ('{"name": "x", "cidrs": ["10.0.0.0/8"], "hosts": ["a b"]}', "not names or *.suffix"),
    ],
)
def test_an_unreadable_approved_entry_is_refused_naming_it(entry: str, words: str) -> None:
    with pytest.raises(EgressSettingError, match=re.escape(words)):
        ApprovedEgress.parse(entry)


def test_two_approved_entries_of_one_name_are_refused() -> None:
    (entry,) = approved("buckets")
    with pytest.raises(EgressSettingError, match="named twice: buckets"):
        NetworkSettings(approved_egress=(entry, entry))


@pytest.mark.parametrize(
    ("pattern", "host", "matches"),
    [
        ("*.example.com", "a.example.com", True),
        ("*.example.com", "a.b.example.com", True),
        ("*.example.com", "example.com", False),
        ("*.example.com", "badexample.com", False),
        ("mlflow.example.com", "mlflow.example.com", True),
        ("mlflow.example.com", "mlflow.example.com.evil.net", False),
    ],
)
def test_a_host_pattern_matches_the_name_or_the_names_below_its_suffix(
    pattern: str, host: str, matches: bool
) -> None:
    entry = ApprovedEgress.parse(
        json.dumps({"name": "e", "cidrs": ["10.0.0.0/8"], "hosts": [pattern]})
    )
    assert bool(entry.opens(url_destination("f", f"http://{host}/"))) == matches
