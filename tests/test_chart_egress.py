"""The chart's egress values: `networkPolicy.approvedEgress` reaches the operator as entries it
reads, the schema refuses a malformed entry, and the API server's range is required where
`helm` cannot derive it (`helm template`; the e2e install derives it from the cluster)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from rlhf_local.build import cached_tool
from rlhf_local.operator_process import (
    E2E_APPROVED_EGRESS,
    OPERATOR_VALUES,
    chart_deployment,
    chart_manifests,
    chart_policy_args,
)
from rlhf_operator.network import ApprovedEgress, NetworkSettings
from rlhfjob_cli import build_parser

pytestmark = pytest.mark.skipif(
    cached_tool("helm") is None,
    reason="helm missing: `python -m rlhf_local.build --tools` (task unit runs it)",
)

ENTRIES: list[dict[str, Any]] = [
    {"name": "s3", "cidrs": ["52.216.0.0/15:443", "3.5.0.0/16:443"], "hosts": ["*.amazonaws.com"]},
    {
        "name": "reward-servers",
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rewards"}},
        "podSelector": {"matchLabels": {"app": "rm"}},
        "ports": [8000, 8443],
        "hosts": ["*.rewards.svc.cluster.local"],
    },
]


def _args(*values: str) -> list[str]:
    return list(chart_deployment(chart_manifests(*values))["spec"]["template"]["spec"]
                ["containers"][0]["args"])  # fmt: skip


def test_approved_entries_reach_the_operator_as_the_entries_it_reads() -> None:
    assert not [a for a in _args() if a.startswith("--approved-egress")]  # none by default
    args = _args(f"networkPolicy.approvedEgress={json.dumps(ENTRIES)}")
    parsed = build_parser().parse_args(args)
    read = tuple(ApprovedEgress.parse(text) for text in parsed.approved_egress)
    assert [entry.name for entry in read] == ["s3", "reward-servers"]
    assert [str(n) for b in read[0].blocks for n in b.networks] == ["52.216.0.0/15", "3.5.0.0/16"]
    assert read[0].hosts == ("*.amazonaws.com",)
    assert read[1].peer == {k: ENTRIES[1][k] for k in ("namespaceSelector", "podSelector")}
    assert read[1].ports == (8000, 8443)
    NetworkSettings(approved_egress=read)  # and the names are unique


def test_the_e2e_operator_runs_with_the_e2e_installations_approved_entries() -> None:
    flags = [a for a in chart_policy_args(chart_manifests(*OPERATOR_VALUES)) if "approved" in a]
    assert [json.loads(f.partition("=")[2]) for f in flags] == E2E_APPROVED_EGRESS


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"cidrs": ["10.0.0.0/8"]}, "missing property 'name'"),
        ({"name": "x", "cidrs": ["10.0.0.0/8"], "ports": [443]}, "oneOf"),
        ({"name": "x", "namespaceSelector": {"matchLabels": {"a": "b"}}}, "oneOf"),
        ({"name": "x", "cidrs": ["example.com/8"]}, "does not match pattern"),
        ({"name": "x", "cidrs": ["10.0.0.0/8"], "hosts": ["*"]}, "does not match pattern"),
        ({"name": "x", "podSelector": {"labels": {}}, "ports": [1]}, "labels"),
        ({"name": "x", "podSelector": {}, "ports": [70000]}, "maximum"),
        ({"name": "Not_A_Name", "cidrs": ["10.0.0.0/8"]}, "does not match pattern"),
    ],
)
def test_values_schema_refuses_a_malformed_approved_entry(
    entry: dict[str, Any], words: str
) -> None:
    with pytest.raises(subprocess.CalledProcessError) as raised:
        chart_manifests(f"networkPolicy.approvedEgress={json.dumps([entry])}")
    assert "approvedEgress" in raised.value.stderr and words in raised.value.stderr, (
        raised.value.stderr
    )


def test_the_api_server_range_is_required_where_helm_derives_none() -> None:
    """`helm template` reads no cluster: without the value, rendering fails saying what to
    give (a real install derives it: `e2e/tests/test_chart.py`)."""
    with pytest.raises(subprocess.CalledProcessError) as raised:
        chart_manifests("networkPolicy.apiServerCIDRs=null")
    assert "networkPolicy.apiServerCIDRs: none given, and none derived" in raised.value.stderr
    given = _args("networkPolicy.apiServerCIDRs={10.96.0.1/32:443,10.0.0.10/32:6443}")
    assert [a for a in given if a.startswith("--api-server-cidr")] == [
        "--api-server-cidr=10.96.0.1/32:443",
        "--api-server-cidr=10.0.0.10/32:6443",
    ]
