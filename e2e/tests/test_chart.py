"""The Helm chart renders, lints, and scopes its RBAC, names and job policy as its values say.

Most tests here render the chart with `helm template` and need no cluster. The last two run
against the local cluster: the chart's admission policy refusing jobs that would borrow the
operator's power, and a real `helm install`, `upgrade` and `uninstall`.
"""

from __future__ import annotations

import base64
import json
import subprocess
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_local import build, cluster
from rlhf_local import prometheus as prom
from rlhf_local.harness import wait_for
from rlhf_local.operator_process import (
    CHART,
    OPERATOR_NAMESPACE,
    REPO,
    OperatorProcess,
    apply_admission_policy,
    chart_deployment,
    chart_manifests,
    chart_service_account,
    refusal,
    remove_admission_policy,
)
from rlhf_local.testing import LocalCluster
from rlhf_operator import builder, names
from rlhfjob import api
from rlhfjob.contract.env import TRAINER_METRICS_PORT_NAME
from rlhfjob.patches import merge_patch

pytestmark = pytest.mark.e2e

CLUSTER_KINDS = {
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}
RAY_AUTH_DIR = "/etc/rlhfjob-operator/ray-auth"


def _helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    helm = str(cluster.binaries().helm)
    return subprocess.run([helm, *args], capture_output=True, text=True, check=check)


def _of_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def _container(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(chart_deployment(manifests)["spec"]["template"]["spec"]["containers"][0])


def _admission(manifests: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    (policy,) = _of_kind(manifests, "ValidatingAdmissionPolicy")
    (binding,) = _of_kind(manifests, "ValidatingAdmissionPolicyBinding")
    return policy, binding


# -- rendered, no cluster ----------------------------------------------------------------------


MONITORING = (
    "metrics.serviceMonitor.enabled=true",
    "metrics.podMonitor.enabled=true",
    "metrics.prometheusRule.enabled=true",
)


@pytest.mark.parametrize(
    "values",
    [
        [],
        ["watchNamespaces={team-a,team-b}"],
        ["jobPolicy.admissionPolicy.enabled=false"],
        list(MONITORING),
    ],
    ids=["default", "watch-namespaces", "no-admission-policy", "monitoring"],
)
def test_chart_lints_clean(values: list[str]) -> None:
    sets = [arg for value in values for arg in ("--set", value)]
    result = _helm("lint", "--strict", str(CHART), *sets, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_needs_kubernetes_1_30_for_the_admission_policy() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.30.0-0"
    refused = _helm("template", "rlhfjob", str(CHART), "--kube-version", "1.29.0", check=False)
    assert refused.returncode != 0 and "kubeVersion" in refused.stderr, refused.stderr
    accepted = _helm("template", "rlhfjob", str(CHART), "--kube-version", "1.30.0", check=False)
    assert accepted.returncode == 0, accepted.stderr


def test_default_install_is_cluster_wide_and_non_root() -> None:
    manifests = chart_manifests()
    kinds = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    assert ("ClusterRole", "rlhfjob-rlhfjob-system") in kinds
    assert ("ClusterRoleBinding", "rlhfjob-rlhfjob-system") in kinds
    pod = chart_deployment(manifests)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    dashboards = _of_kind(manifests, "ConfigMap")
    assert {m["metadata"]["labels"]["grafana_dashboard"] for m in dashboards} == {"1"}
    assert len(dashboards) == 2


def test_monitoring_objects_are_off_by_default() -> None:
    kinds = {m["kind"] for m in chart_manifests()}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    pod = chart_deployment()["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8080"


def test_the_pod_monitor_scrapes_the_ports_the_builder_gives_the_ray_pods() -> None:
    manifests = chart_manifests(*MONITORING)
    (monitor,) = _of_kind(manifests, "PodMonitor")
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    keys = {e["key"] for e in spec["selector"]["matchExpressions"]}
    assert keys == {names.LABEL_JOB, "ray.io/node-type"}
    head_ports = {p["name"] for p in builder.RAY_PORTS}
    ports = [endpoint["port"] for endpoint in spec["podMetricsEndpoints"]]
    assert ports == [TRAINER_METRICS_PORT_NAME, "metrics"] and set(ports) <= head_ports
    for endpoint in spec["podMetricsEndpoints"]:
        targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
        assert targets["rlhfjob"] == ["__meta_kubernetes_pod_label_rlhf_dev_job"]
    (service_monitor,) = _of_kind(manifests, "ServiceMonitor")
    assert service_monitor["spec"]["endpoints"][0]["honorLabels"] is True
    watched = chart_manifests(*MONITORING, "watchNamespaces={team-a}")
    (monitor,) = _of_kind(watched, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
    (no_ray,) = _of_kind(chart_manifests(*MONITORING, "metrics.podMonitor.rayMetrics=false"),
                         "PodMonitor")  # fmt: skip
    assert [e["port"] for e in no_ray["spec"]["podMetricsEndpoints"]] == ["trainer-metrics"]


def test_the_alerts_select_this_releases_operator_and_take_their_durations_from_values() -> None:
    values = ("metrics.prometheusRule.alerts.degradedFor=7m",
              "metrics.prometheusRule.alertLabels.team=ml")  # fmt: skip
    manifests = chart_manifests(*MONITORING, *values, release="prod")
    (service,) = _of_kind(manifests, "Service")
    (rule,) = _of_kind(manifests, "PrometheusRule")
    rules = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    assert [r["alert"] for r in rules] == list(prom.ALERTS)
    by_name = {r["alert"]: r for r in rules}
    assert by_name["RLHFJobDegraded"]["for"] == "7m"
    selector = f'job="{service["metadata"]["name"]}"'
    for alert in rules:
        assert selector in alert["expr"], alert["alert"]
        assert alert["labels"]["team"] == "ml" and alert["labels"]["severity"]
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]
    operator_down = by_name["RLHFJobOperatorDown"]["expr"]
    assert f'namespace="{OPERATOR_NAMESPACE}"' in operator_down
    refused = _helm("template", "rlhfjob", str(CHART), "--set",
                    "metrics.prometheusRule.alerts.degradedFor=soon", check=False)  # fmt: skip
    assert refused.returncode != 0 and "degradedFor" in refused.stderr, refused.stderr


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
            m for m in chart_manifests(*MONITORING, namespace=unrestricted_namespace)
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


def test_watch_namespaces_gives_one_role_per_namespace() -> None:
    manifests = chart_manifests("watchNamespaces={team-a,team-b}")
    roles = sorted(m["metadata"]["namespace"] for m in _of_kind(manifests, "Role"))
    assert roles == ["team-a", "team-b"]
    (nodes,) = _of_kind(manifests, "ClusterRole")  # nodes are cluster-wide: read-only, alone
    assert nodes["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]
    args = _container(manifests)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    _, binding = _admission(manifests)
    (selector,) = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert selector == {
        "key": "kubernetes.io/metadata.name",
        "operator": "In",
        "values": ["team-a", "team-b"],
    }
    assert "matchResources" not in _admission(chart_manifests())[1]["spec"]  # every namespace


@pytest.mark.parametrize("watch", [[], ["watchNamespaces={team-a}"]], ids=["cluster", "roles"])
def test_two_releases_coexist(watch: list[str]) -> None:
    """Same namespace or same release name: no object of one release is another's."""
    releases = {
        ("rlhfjob", OPERATOR_NAMESPACE): chart_manifests(*watch),
        ("second", OPERATOR_NAMESPACE): chart_manifests(*watch, release="second"),
        ("rlhfjob", "team-b"): chart_manifests(*watch, namespace="team-b"),
        ("other", "team-c"): chart_manifests(*watch, release="other", namespace="team-c"),
    }
    keys: Counter[tuple[str, str | None, str]] = Counter()
    for (release, namespace), manifests in releases.items():
        for m in manifests:
            cluster_wide = m["kind"] in CLUSTER_KINDS
            assert ("namespace" in m["metadata"]) != cluster_wide, m["kind"]
            keys[m["kind"], m["metadata"].get("namespace"), m["metadata"]["name"]] += 1
        # ... and each release's references stay inside the release.
        account = chart_service_account(manifests)
        deployment = chart_deployment(manifests)
        assert deployment["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == (
            release
        )
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        secrets = {m["metadata"]["name"] for m in _of_kind(manifests, "Secret")}
        assert {v["secret"]["secretName"] for v in volumes if "secret" in v} <= secrets
        for binding in _of_kind(manifests, "ClusterRoleBinding") + _of_kind(
            manifests, "RoleBinding"
        ):
            assert binding["subjects"] == [
                {"kind": "ServiceAccount", "name": account, "namespace": namespace}
            ]
            roles = {m["metadata"]["name"] for m in manifests if m["kind"].endswith("Role")}
            assert binding["roleRef"]["name"] in roles
        policy, vap_binding = _admission(manifests)
        assert vap_binding["spec"]["policyName"] == policy["metadata"]["name"]
    collisions = [key for key, count in keys.items() if count > 1]
    assert not collisions, collisions


def test_names_fit_in_63_characters() -> None:
    longest_release = "r" * 53  # helm's own limit
    for manifests in (
        chart_manifests(release=longest_release),
        chart_manifests("fullnameOverride=" + "o" * 63),
    ):
        for m in manifests:
            if m["kind"] in {"Deployment", "ServiceAccount", "Service"}:
                assert len(m["metadata"]["name"]) <= 63, m["metadata"]["name"]
    assert chart_service_account(chart_manifests(release=longest_release)) == (
        longest_release + "-rlhfjob"
    )
    assert chart_service_account(chart_manifests("fullnameOverride=ops")) == "ops"
    assert chart_service_account(chart_manifests(release="my-rlhfjob")) == "my-rlhfjob"


@pytest.mark.parametrize(
    "watch", [[], ["watchNamespaces={team-a,team-b}"]], ids=["cluster", "roles"]
)
def test_rbac_writes_secrets_and_network_policies_but_never_reads_secrets(
    watch: list[str],
) -> None:
    manifests = chart_manifests(*watch)
    roles = _of_kind(manifests, "ClusterRole") + _of_kind(manifests, "Role")
    # The one role for nodes (cluster-wide in either mode) lists them, nothing more.
    nodes = [r for r in roles if r["metadata"]["name"].endswith("-nodes")]
    assert [r["rules"] for r in nodes] == [
        [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]
    ]
    roles = [r for r in roles if r not in nodes]
    assert roles
    for role in roles:
        grants: dict[tuple[str, str], set[str]] = {}
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            assert "*" not in rule["apiGroups"], rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    grants.setdefault((group, resource), set()).update(rule["verbs"])
        assert grants[("", "secrets")] == {"create", "patch"}
        assert grants[("networking.k8s.io", "networkpolicies")] == {"get", "create", "patch"}


def test_operator_gets_its_identity_policy_and_ray_auth_key() -> None:
    manifests = chart_manifests(
        "jobPolicy.allowedVolumeTypes={persistentVolumeClaim,nfs}",
        "jobPolicy.allowedServiceAccounts={rlhf-trainer,reader}",
    )
    account = chart_service_account(manifests)
    assert account == "rlhfjob"
    pod = chart_deployment(manifests)["spec"]["template"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "rlhfjob"
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    container = _container(manifests)
    args = container["args"]
    assert "--operator-namespace=$(POD_NAMESPACE)" in args
    assert {
        "name": "POD_NAMESPACE",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
    } in (container["env"])
    assert f"--operator-service-account={account}" in args
    assert f"--ray-auth-key-file={RAY_AUTH_DIR}/key" in args
    assert [a for a in args if a.startswith("--allowed-")] == [
        "--allowed-volume-type=persistentVolumeClaim",
        "--allowed-volume-type=nfs",
        "--allowed-service-account=rlhf-trainer",
        "--allowed-service-account=reader",
    ]
    (mount,) = container["volumeMounts"]
    assert mount == {"name": "ray-auth", "mountPath": RAY_AUTH_DIR, "readOnly": True}
    (volume,) = pod["spec"]["volumes"]
    (secret,) = _of_kind(manifests, "Secret")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"] == "rlhfjob-ray-auth-key"
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    key = base64.b64decode(secret["data"]["key"]).decode()
    assert len(key) == 64 and key.isalnum()
    # The chart's default policy flags are the operator's defaults.
    defaults = [a for a in _container(chart_manifests())["args"] if a.startswith("--allowed-")]
    assert defaults == [
        f"--allowed-volume-type={t}"
        for t in ("persistentVolumeClaim", "csi", "nfs", "emptyDir", "configMap", "secret")
    ]


def test_an_existing_ray_auth_secret_replaces_the_generated_one() -> None:
    manifests = chart_manifests("rayAuth.existingSecret=my-ray-key")
    assert not _of_kind(manifests, "Secret")
    (volume,) = chart_deployment(manifests)["spec"]["template"]["spec"]["volumes"]
    assert volume["secret"]["secretName"] == "my-ray-key"


def test_admission_policy_is_rendered_from_the_job_policy_values() -> None:
    manifests = chart_manifests(
        "jobPolicy.allowedVolumeTypes={persistentVolumeClaim,nfs}",
        "jobPolicy.allowedServiceAccounts={rlhf-trainer}",
    )
    policy, binding = _admission(manifests)
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule == {
        "apiGroups": ["rlhf.dev"],
        "apiVersions": ["v1alpha1"],
        "operations": ["CREATE", "UPDATE"],
        "resources": ["rlhfjobs"],
    }
    assert binding["spec"]["validationActions"] == ["Deny"]
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    # A JSON list of strings is a CEL list literal.
    assert json.loads(variables["allowedVolumeTypes"]) == ["persistentVolumeClaim", "nfs"]
    assert json.loads(variables["allowedServiceAccounts"]) == ["rlhf-trainer"]
    assert "has(object.spec.checkpoint.volume)" in variables["volume"]
    assert "has(object.spec.serviceAccountName)" in variables["namesServiceAccount"]
    volume, account, own, *_pod_volumes = spec["validations"]  # pods: test_pod_overrides.py
    assert "variables.allowedVolumeTypes" in volume["expression"]
    assert "variables.allowedServiceAccounts" in account["expression"]
    for validation, field in [
        (volume, "spec.checkpoint.volume"),
        (account, "spec.serviceAccountName"),
        (own, "spec.serviceAccountName"),
    ]:
        assert validation["message"].startswith(field + ":")
        assert field in validation.get("messageExpression", field)
    assert "allowed: persistentVolumeClaim, nfs" in volume["message"]
    assert '"rlhfjob-system"' in own["expression"] and '"rlhfjob"' in own["expression"]
    disabled = chart_manifests("jobPolicy.admissionPolicy.enabled=false")
    assert not _of_kind(disabled, "ValidatingAdmissionPolicy")
    assert not _of_kind(disabled, "ValidatingAdmissionPolicyBinding")


def test_values_schema_rejects_a_misspelt_value() -> None:
    with pytest.raises(subprocess.CalledProcessError) as raised:
        chart_manifests("timerIntervall=5")
    assert "timerIntervall" in raised.value.stderr


@pytest.mark.parametrize(
    "value, named",
    [
        ("jobPolicy.allowedVolumeType={nfs}", "allowedVolumeType"),
        ("jobPolicy.admissionPolicy.enable=true", "enable"),
        ("jobPolicy.allowedVolumeTypes={hostpath}", "allowedVolumeTypes"),
        ("jobPolicy.allowedServiceAccounts={Not_A_Name}", "allowedServiceAccounts"),
        ("rayAuth.secret=x", "secret"),
    ],
)
def test_values_schema_rejects_unknown_job_policy_and_ray_auth_values(
    value: str, named: str
) -> None:
    with pytest.raises(subprocess.CalledProcessError) as raised:
        chart_manifests(value)
    assert named in raised.value.stderr


def test_local_operator_runs_with_the_charts_identity_and_flags(tmp_path: Path) -> None:
    handle = OperatorProcess(kubeconfig=tmp_path / "kubeconfig", log_path=tmp_path / "op.log")
    assert handle.ray_auth_key_file.parent == tmp_path
    handle._write_key()
    key = handle.ray_auth_key_file.read_text()
    assert len(key) == 64 and key.isalnum()
    assert handle.ray_auth_key_file.stat().st_mode & 0o777 == 0o600
    handle._write_key()  # a restart keeps the key
    assert handle.ray_auth_key_file.read_text() == key
    command = handle.command()
    manifests = chart_manifests()
    assert f"--operator-service-account={chart_service_account(manifests)}" in command
    assert f"--operator-namespace={OPERATOR_NAMESPACE}" in command
    assert f"--ray-auth-key-file={handle.ray_auth_key_file}" in command
    chart_args = _container(manifests)["args"]
    assert [a for a in command if a.startswith("--allowed-")] == [
        a for a in chart_args if a.startswith("--allowed-")
    ]


def test_values_schema_wants_at_least_one_volume_type() -> None:
    """The operator falls back to its defaults when given no --allowed-volume-type."""
    empty = ["--set-json", "jobPolicy.allowedVolumeTypes=[]"]
    refused = _helm("template", "rlhfjob", str(CHART), *empty, check=False)
    assert refused.returncode != 0 and "allowedVolumeTypes" in refused.stderr, refused.stderr


# -- against the local cluster (the e2e tier) --------------------------------------------------


def _refusal(lc: LocalCluster, namespace: str, spec: dict[str, Any]) -> str | None:
    """Why the API server refuses this job (dry run: nothing is created); None if accepted."""
    example = yaml.safe_load((REPO / "examples/grpo-tiny-cpu.yaml").read_text())
    body = merge_patch(
        example,
        {"metadata": {"name": "borrowed-power", "namespace": namespace}, "spec": spec},
    )
    return refusal(lc, body)


def test_admission_policy_refuses_borrowed_power(
    local_cluster: LocalCluster, namespace: str
) -> None:
    lc = local_cluster
    account = chart_service_account()
    lc.kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)
    # Bound to this test's namespaces only, so other tests' jobs never meet it; the operator's
    # own ServiceAccount is listed as allowed, so only the rule against it can refuse it.
    applied = apply_admission_policy(
        lc,
        f"watchNamespaces={{{OPERATOR_NAMESPACE},{namespace}}}",
        f"jobPolicy.allowedServiceAccounts={{rlhf-trainer,{account}}}",
    )
    try:
        host_path = {"checkpoint": {"volume": {"hostPath": {"path": "/"}}}}
        refused = wait_for(
            lambda: _refusal(lc, namespace, host_path), 60, "the admission policy to take effect"
        )
        assert "spec.checkpoint.volume" in refused and "hostPath" in refused, refused

        own = _refusal(lc, OPERATOR_NAMESPACE, {"serviceAccountName": account})
        assert own is not None and "spec.serviceAccountName" in own, own
        other = _refusal(lc, namespace, {"serviceAccountName": "someone-else"})
        assert other is not None and "spec.serviceAccountName" in other, other

        pvc = {"checkpoint": {"volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}}}
        assert _refusal(lc, namespace, pvc) is None
        assert _refusal(lc, namespace, {"serviceAccountName": "rlhf-trainer"}) is None
        # The same name in another namespace is another ServiceAccount.
        assert _refusal(lc, namespace, {"serviceAccountName": account}) is None
    finally:
        remove_admission_policy(lc, applied)


def test_helm_install_upgrade_uninstall(local_cluster: LocalCluster) -> None:
    """A real release: install, upgrade (the Ray auth key survives), uninstall (the CRD stays).

    While installed, the release's admission policy binds every namespace; the operator pod
    it creates never runs for real (the local cluster's nodes are fake).
    """
    lc = local_cluster
    namespace = f"helm-{uuid.uuid4().hex[:6]}"
    release = "chart-test"
    helm = ["--kubeconfig", str(lc.kubeconfig), "-n", namespace]
    manifests = chart_manifests(release=release, namespace=namespace)
    deployment = chart_deployment(manifests)["metadata"]["name"]
    roles = [r["metadata"]["name"] for r in _of_kind(manifests, "ClusterRole")]
    assert len(roles) == 2, roles  # the operator's, and the read-only one for nodes
    (policy,) = _of_kind(manifests, "ValidatingAdmissionPolicy")
    (secret,) = _of_kind(manifests, "Secret")
    cluster_objects = [
        *(("clusterrole", role) for role in roles),
        *(("clusterrolebinding", role) for role in roles),
        ("validatingadmissionpolicy", policy["metadata"]["name"]),
        ("validatingadmissionpolicybinding", policy["metadata"]["name"]),
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
        _helm("install", release, str(CHART), *helm, "--create-namespace")
        installed = get("deployment", deployment, namespace)
        assert installed is not None
        for kind, name in cluster_objects:
            assert get(kind, name) is not None, f"{kind} {name} missing after install"
        key = ray_key()

        _helm("upgrade", release, str(CHART), *helm, "--set", "timerInterval=7")
        upgraded = get("deployment", deployment, namespace)
        assert upgraded is not None
        args = upgraded["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--timer-interval=7" in args
        assert ray_key() == key, "the upgrade replaced the Ray auth key"
        for kind, name in cluster_objects:
            assert get(kind, name) is not None, f"{kind} {name} missing after upgrade"

        _helm("uninstall", release, *helm, "--wait")
        wait_for(
            lambda: get("deployment", deployment, namespace) is None, 60, "the Deployment to go"
        )
        for kind, name in cluster_objects:
            assert get(kind, name) is None, f"{kind} {name} left after uninstall"
        assert get("customresourcedefinition", f"{api.PLURAL}.{api.GROUP}") is not None
        assert ray_key() == key, "the Ray auth key Secret is kept (helm.sh/resource-policy)"
    finally:
        _helm("uninstall", release, *helm, "--ignore-not-found", check=False)
        lc.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=false")
