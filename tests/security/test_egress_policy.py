"""A job may name only destinations the installation approved: the operator's job policy refuses
any other, naming the field (`rlhf_operator.policy_egress`), so a job cannot widen its own
egress by what it writes in its spec."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlhf_operator.network import ApprovedEgress, Destination, NetworkSettings
from rlhf_operator.policy import JobPolicy
from rlhfjob.config import parse_job
from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import valid_job

BY_POLICY = (
    "the operator's job policy: each destination must match networkPolicy.approvedEgress "
    "(rlhf_operator.policy_egress), at every reconcile"
)
ENTRIES = [
    {"name": "s3", "cidrs": ["0.0.0.0/0:443"], "hosts": ["*.amazonaws.com"]},
    {"name": "buckets", "cidrs": ["10.1.0.0/16:8333"]},
    {
        "name": "reward-servers",
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rewards"}},
        "ports": [8000],
        "hosts": ["*.rewards", "*.rewards.svc.cluster.local"],
    },
]
NETWORK = NetworkSettings(
    approved_egress=tuple(ApprovedEgress.parse(json.dumps(entry)) for entry in ENTRIES),
    extra_egress=(Destination.parse("10.20.0.0/16:5000"),),
)
POLICY = JobPolicy(network=NETWORK)
SUFFIX = "(approved: s3, buckets, reward-servers; the chart's networkPolicy.approvedEgress)"


def remote(url: str) -> dict[str, Any]:
    return {"type": "remote", "function": None, "remote": {"url": url}}


def _problems(spec: dict[str, Any], policy: JobPolicy = POLICY) -> list[str]:
    return policy.problems(parse_job(merge_patch(valid_job(), {"spec": spec})))


REFUSED = [
    ("reward-elsewhere", "a job names a reward server no entry approves, to reach its address",
     {"reward": remote("http://attacker.example.net:8000/s")}, "spec.reward.remote.url"),
    ("reward-other-namespace", "a job names another namespace's Service on an approved port",
     {"reward": remote("http://db.payments.svc.cluster.local:8000/s")}, "spec.reward.remote.url"),
    ("bucket-beside", "a job names a bucket address outside the approved block",
     {"checkpoint": {"objectStore": {"bucket": "ckpts", "endpoint": "http://10.2.0.9:8333"}}},
     "spec.checkpoint.objectStore.endpoint"),
    ("bucket-other-port", "a job names an approved bucket address on another port",
     {"checkpoint": {"objectStore": {"bucket": "ckpts", "endpoint": "http://10.1.2.3:22"}}},
     "spec.checkpoint.objectStore.endpoint"),
    ("combined-component", "a job hides an unapproved reward server in a combined reward",
     {"reward": {"type": "combined", "function": None,
                 "components": [{"type": "function", "function": "m:f"},
                                {"type": "remote", "remote": {"url": "https://1.2.3.4:8443/"}}]}},
     "spec.reward.components[1].remote.url"),
    ("mlflow", "a job names an unapproved tracking server",
     {"tracking": {"mlflow": {"trackingUri": "http://mlflow.elsewhere:5001"}}},
     "spec.tracking.mlflow.trackingUri"),
    ("wandb", "a job names an unapproved W&B server",
     {"tracking": {"wandb": {"project": "p", "apiKeySecret": "wb",
                             "baseUrl": "https://wandb.elsewhere"}}},
     "spec.tracking.wandb.baseUrl"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        pytest.param(spec, field, id=id_, marks=pytest.mark.attack(what, BY_POLICY))
        for id_, what, spec, field in REFUSED
    ],
)
def test_a_destination_no_entry_approves_is_refused_naming_the_field(
    spec: dict[str, Any], field: str
) -> None:
    (problem,) = _problems(spec)
    assert problem.startswith(f"{field}: ") and problem.endswith(
        f" is not an approved egress destination {SUFFIX}"
    ), problem


@pytest.mark.attack(
    "a job names a cloud metadata address (in any spelling) as its reward server or tracker, "
    "where the installation approved every address on that port",
    BY_POLICY,
)
@pytest.mark.parametrize(
    ("url", "inside"),
    [
        ("https://169.254.169.254/latest/meta-data", "169.254.169.254/32 (instance metadata"),
        ("https://2852039166/", "169.254.169.254/32 (instance metadata"),
        ("https://168.63.129.16/machine", "168.63.129.16/32 (Azure WireServer)"),
        ("https://100.100.100.200/latest", "100.100.100.200/32 (Alibaba Cloud metadata)"),
        ("https://169.254.170.2/v2/credentials", "169.254.170.2/32 (AWS ECS task"),
        ("https://[fd00:ec2::254]/", "fd00:ec2::254/128 (AWS instance metadata (IPv6))"),
    ],
)
def test_a_link_local_or_metadata_address_is_refused_whatever_is_approved(
    url: str, inside: str
) -> None:
    (problem,) = _problems({"reward": remote(url)})
    assert problem.startswith(f"spec.reward.remote.url: {url!r} lies inside {inside}"), problem
    assert "which no job may reach" in problem


def test_a_bucket_without_endpoint_needs_an_entry_for_aws_s3() -> None:
    aws = {"checkpoint": {"objectStore": {"bucket": "ckpts", "region": "eu-west-1"}}}
    assert _problems(aws) == []
    (problem,) = _problems(aws, JobPolicy(network=NetworkSettings()))
    assert problem == (
        "spec.checkpoint.objectStore.endpoint: AWS S3 ('https://s3.eu-west-1.amazonaws.com': "
        "the endpoint is unset) is not an approved egress destination (approved: none; the "
        "chart's networkPolicy.approvedEgress)"
    )


def test_approved_destinations_pass() -> None:
    """The controls: each destination an entry (or extraEgress) covers is accepted."""
    for spec in (
        {"reward": remote("http://rm.rewards:8000/s")},
        {"reward": remote("http://rm.rewards.svc.cluster.local:8000/s")},
        {"checkpoint": {"objectStore": {"bucket": "ckpts", "endpoint": "http://10.1.2.3:8333"}}},
        {"checkpoint": {"objectStore": {"bucket": "ckpts"}}},
        {"tracking": {"mlflow": {"trackingUri": "http://10.20.3.4:5000"}}},
        {"tracking": {"wandb": {"project": "p"}}},  # offline: no destination
        {},
    ):
        assert _problems(spec) == [], spec


def test_a_policy_without_network_settings_leaves_destinations_to_the_operator() -> None:
    """The admission policy's share of the rules has no egress rule: the same `JobPolicy`
    without settings (as its corpus test builds it) checks none; the `Reconciler` always
    gives its policy the operator's settings, so nothing approved refuses every destination."""
    spec = {"reward": remote("http://attacker.example.net:8000/s")}
    assert _problems(spec, JobPolicy()) == []
    assert len(_problems(spec, JobPolicy(network=NetworkSettings()))) == 1
