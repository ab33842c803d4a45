"""The Helm chart against the local cluster: its monitoring objects pass the Prometheus
Operator's CRDs, and a real `helm install`, `upgrade` and `uninstall`. Its admission policy
against attacks: `test_attacks.py`. What only renders is `tests/test_chart.py`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import yaml

from rlhf_local import build, cluster
from rlhf_local.harness import wait_for
from rlhf_local.operator_process import (
    CHART,
    MONITORING_VALUES,
    chart_deployment,
    chart_manifests,
    helm,
    of_kind,
)
from rlhf_local.testing import LocalCluster
from rlhfjob import api
from rlhfjob.patches import merge_patch

pytestmark = pytest.mark.e2e


def test_the_monitoring_objects_pass_the_prometheus_operators_crds(
    local_cluster: LocalCluster, unrestricted_namespace: str
) -> None:
    """A server-side dry run of the chart's ServiceMonitor, PodMonitor and PrometheusRule
    against the Prometheus Operator's own CRDs (installed for this test, then removed)."""
    crds = build.prometheus_operator_crds()
    apply = ["apply", "--server-side", "--force-conflicts", "--field-manager=rlhfjob-e2e"]
    names = [yaml.safe_load(path.read_text())["metadata"]["name"] for path in crds]
    try:
        for path in crds:
            cluster.kubectl(*apply, "-f", str(path))
        for name in names:
            cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
        monitoring = [
            m for m in chart_manifests(*MONITORING_VALUES, namespace=unrestricted_namespace)
            if m["kind"] in ("ServiceMonitor", "PodMonitor", "PrometheusRule")
        ]  # fmt: skip
        assert len(monitoring) == 3
        out = cluster.kubectl(*apply, "--dry-run=server", "-f", "-",
                              stdin=yaml.safe_dump_all(monitoring))  # fmt: skip
        assert out.count("(server dry run)") == 3, out
        broken = merge_patch(monitoring[1], {"spec": {"podMetricsEndpoints": [{"port": 9400}]}})
        with pytest.raises(RuntimeError, match="podMetricsEndpoints"):  # the schema holds
            cluster.kubectl(*apply, "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(broken))
    finally:
        for name in names:
            cluster.kubectl("delete", "crd", name, "--ignore-not-found", check=False)


# -- against the local cluster (the e2e tier) --------------------------------------------------


def test_helm_install_upgrade_uninstall(local_cluster: LocalCluster) -> None:
    """A real release: install, upgrade (the Ray auth key survives), uninstall (the CRD stays).

    While installed, the release's admission policy binds every namespace; the operator pod
    it creates never runs for real (the local cluster's nodes are fake).
    """
    lc = local_cluster
    namespace = f"helm-{uuid.uuid4().hex[:6]}"
    release = "chart-test"
    in_namespace = ["--kubeconfig", str(lc.kubeconfig), "-n", namespace]
    manifests = chart_manifests(release=release, namespace=namespace)
    deployment = chart_deployment(manifests)["metadata"]["name"]
    roles = [r["metadata"]["name"] for r in of_kind(manifests, "ClusterRole")]
    assert len(roles) == 2, roles  # the operator's, and the read-only one for nodes
    policies = [p["metadata"]["name"] for p in of_kind(manifests, "ValidatingAdmissionPolicy")]
    assert len(policies) == 2, policies  # the job policy, and the operator's own bounds
    (secret,) = of_kind(manifests, "Secret")
    cluster_objects = [
        *(("clusterrole", role) for role in roles),
        *(("clusterrolebinding", role) for role in roles),
        *(("validatingadmissionpolicy", policy) for policy in policies),
        *(("validatingadmissionpolicybinding", policy) for policy in policies),
    ]

    def get(kind: str, name: str, ns: str | None = None) -> dict[str, Any] | None:
        scope = ["-n", ns] if ns else []
        out = lc.kubectl("get", kind, name, *scope, "-o", "json", "--ignore-not-found")
        return json.loads(out) if out.strip() else None

    def ray_key() -> str:
        found = get("secret", secret["metadata"]["name"], namespace)
        assert found is not None
        return str(found["data"]["key"])

    try:
        helm("install", release, str(CHART), *in_namespace, "--create-namespace")
        installed = get("deployment", deployment, namespace)
        assert installed is not None
        # No networkPolicy.apiServerCIDRs given: derived from the cluster's `kubernetes`
        # Service (this control plane writes no EndpointSlice for it).
        container = installed["spec"]["template"]["spec"]["containers"][0]
        derived = [a for a in container["args"] if a.startswith("--api-server-cidr")]
        assert derived == ["--api-server-cidr=10.96.0.1/32:443"], derived
        for kind, name in cluster_objects:
            assert get(kind, name) is not None, f"{kind} {name} missing after install"
        key = ray_key()

        helm("upgrade", release, str(CHART), *in_namespace, "--set", "timerInterval=7")
        upgraded = get("deployment", deployment, namespace)
        assert upgraded is not None
        args = upgraded["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--timer-interval=7" in args
        assert ray_key() == key, "the upgrade replaced the Ray auth key"
        for kind, name in cluster_objects:
            assert get(kind, name) is not None, f"{kind} {name} missing after upgrade"

        helm("uninstall", release, *in_namespace, "--wait")
        wait_for(
            lambda: get("deployment", deployment, namespace) is None, 60, "the Deployment to go"
        )
        for kind, name in cluster_objects:
            assert get(kind, name) is None, f"{kind} {name} left after uninstall"
        assert get("customresourcedefinition", f"{api.PLURAL}.{api.GROUP}") is not None
        assert ray_key() == key, "the Ray auth key Secret is kept (helm.sh/resource-policy)"
    finally:
        helm("uninstall", release, *in_namespace, "--ignore-not-found", check=False)
        lc.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false")
