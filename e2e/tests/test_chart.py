"""The Helm chart renders, lints, and scopes its RBAC as its values say."""

from __future__ import annotations

import subprocess

import pytest

from rlhf_local import cluster
from rlhf_local.operator_process import REPO, chart_manifests

pytestmark = pytest.mark.e2e


def test_chart_lints_clean() -> None:
    helm = str(cluster.binaries().helm)
    result = subprocess.run(
        [helm, "lint", "--strict", str(REPO / "charts/rlhfjob")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_default_install_is_cluster_wide_and_non_root() -> None:
    kinds = {(m["kind"], m["metadata"]["name"]) for m in chart_manifests()}
    assert ("ClusterRole", "rlhfjob-operator") in kinds
    assert ("ClusterRoleBinding", "rlhfjob-operator") in kinds
    deployment = next(m for m in chart_manifests() if m["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    dashboards = [m for m in chart_manifests() if m["kind"] == "ConfigMap"]
    assert {m["metadata"]["labels"]["grafana_dashboard"] for m in dashboards} == {"1"}
    assert len(dashboards) == 2


def test_watch_namespaces_gives_one_role_per_namespace() -> None:
    manifests = chart_manifests("watchNamespaces={team-a,team-b}")
    roles = sorted(m["metadata"]["namespace"] for m in manifests if m["kind"] == "Role")
    assert roles == ["team-a", "team-b"]
    assert not [m for m in manifests if m["kind"] == "ClusterRole"]
    deployment = next(m for m in manifests if m["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_values_schema_rejects_a_misspelt_value() -> None:
    with pytest.raises(subprocess.CalledProcessError) as raised:
        chart_manifests("timerIntervall=5")
    assert "timerIntervall" in raised.value.stderr
