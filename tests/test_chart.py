"""The Helm chart renders, lints, and scopes its RBAC, names and job policy as its values say.

Every test here renders the chart with `helm template` (helm is one of the tools `task unit`
fetches) and needs no cluster; `e2e/tests/test_chart.py` installs it into the local cluster.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_local import prometheus as prom
from rlhf_local.build import cached_tool
from rlhf_local.operator_process import (
    CHART,
    MONITORING_VALUES,
    OPERATOR_NAMESPACE,
    TEMPLATE_API_SERVER,
    OperatorProcess,
    chart_deployment,
    chart_manifests,
    chart_service_account,
    helm,
    of_kind,
)
from rlhf_operator import builder, names
from rlhf_operator.network import Destination
from rlhf_operator.policy import JobPolicy
from rlhf_operator.policy_supply import DEFAULT_EXTENDED_RESOURCES
from rlhfjob.contract.env import TRAINER_METRICS_PORT_NAME
from rlhfjob_cli import build_parser, listed_or_default

pytestmark = pytest.mark.skipif(
    cached_tool("helm") is None,
    reason="helm missing: `python -m rlhf_local.build --tools` (task unit runs it)",
)

CLUSTER_KINDS = {
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}
RAY_AUTH_DIR = "/etc/rlhfjob-operator/ray-auth"


def _container(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(chart_deployment(manifests)["spec"]["template"]["spec"]["containers"][0])


def _admission(
    manifests: list[dict[str, Any]], name: str = "-job-policy"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job policy (or, by `name`, the operator policy) and its binding."""
    (policy,), (binding,) = (
        [m for m in of_kind(manifests, kind) if m["metadata"]["name"].endswith(name)]
        for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    )
    return policy, binding


@pytest.mark.parametrize(
    "values",
    [
        [],
        ["watchNamespaces={team-a,team-b}"],
        ["jobPolicy.admissionPolicy.enabled=false"],
        list(MONITORING_VALUES),
    ],
    ids=["default", "watch-namespaces", "no-admission-policy", "monitoring"],
)
def test_chart_lints_clean(values: list[str]) -> None:
    sets = [arg for value in values for arg in ("--set", value)]
    result = helm("lint", "--strict", str(CHART), *sets, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_needs_kubernetes_1_30_for_the_admission_policy() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == ">=1.30.0-0"
    refused = helm("template", "rlhfjob", str(CHART), "--kube-version", "1.29.0", check=False)
    assert refused.returncode != 0 and "kubeVersion" in refused.stderr, refused.stderr
    api_server = ("--set", TEMPLATE_API_SERVER)  # `helm template` derives none
    accepted = helm(
        "template", "rlhfjob", str(CHART), "--kube-version", "1.30.0", *api_server, check=False
    )
    assert accepted.returncode == 0, accepted.stderr


def test_default_install_is_cluster_wide_and_non_root() -> None:
    manifests = chart_manifests()
    kinds = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    assert ("ClusterRole", "rlhfjob-rlhfjob-system") in kinds
    assert ("ClusterRoleBinding", "rlhfjob-rlhfjob-system") in kinds
    pod = chart_deployment(manifests)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    dashboards = of_kind(manifests, "ConfigMap")
    assert {m["metadata"]["labels"]["grafana_dashboard"] for m in dashboards} == {"1"}
    assert len(dashboards) == 2


def test_monitoring_objects_are_off_by_default() -> None:
    kinds = {m["kind"] for m in chart_manifests()}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    pod = chart_deployment()["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8080"


def test_the_pod_monitor_scrapes_the_ports_the_builder_gives_the_ray_pods() -> None:
    manifests = chart_manifests(*MONITORING_VALUES)
    (monitor,) = of_kind(manifests, "PodMonitor")
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
    (service_monitor,) = of_kind(manifests, "ServiceMonitor")
    assert service_monitor["spec"]["endpoints"][0]["honorLabels"] is True
    watched = chart_manifests(*MONITORING_VALUES, "watchNamespaces={team-a}")
    (monitor,) = of_kind(watched, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
    (no_ray,) = of_kind(chart_manifests(*MONITORING_VALUES, "metrics.podMonitor.rayMetrics=false"),
                         "PodMonitor")  # fmt: skip
    assert [e["port"] for e in no_ray["spec"]["podMetricsEndpoints"]] == ["trainer-metrics"]


def test_the_alerts_select_this_releases_operator_and_take_their_durations_from_values() -> None:
    values = ("metrics.prometheusRule.alerts.degradedFor=7m",
              "metrics.prometheusRule.alertLabels.team=ml")  # fmt: skip
    manifests = chart_manifests(*MONITORING_VALUES, *values, release="prod")
    (service,) = of_kind(manifests, "Service")
    (rule,) = of_kind(manifests, "PrometheusRule")
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
    refused = helm("template", "rlhfjob", str(CHART), "--set",
                    "metrics.prometheusRule.alerts.degradedFor=soon", check=False)  # fmt: skip
    assert refused.returncode != 0 and "degradedFor" in refused.stderr, refused.stderr


def test_watch_namespaces_gives_one_role_per_namespace() -> None:
    manifests = chart_manifests("watchNamespaces={team-a,team-b}")
    roles = sorted(m["metadata"]["namespace"] for m in of_kind(manifests, "Role"))
    assert roles == ["team-a", "team-b"]
    (nodes,) = of_kind(manifests, "ClusterRole")  # nodes are cluster-wide: read-only, alone
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
        secrets = {m["metadata"]["name"] for m in of_kind(manifests, "Secret")}
        assert {v["secret"]["secretName"] for v in volumes if "secret" in v} <= secrets
        for binding in of_kind(manifests, "ClusterRoleBinding") + of_kind(manifests, "RoleBinding"):
            assert binding["subjects"] == [
                {"kind": "ServiceAccount", "name": account, "namespace": namespace}
            ]
            roles = {m["metadata"]["name"] for m in manifests if m["kind"].endswith("Role")}
            assert binding["roleRef"]["name"] in roles
        for name in ("-job-policy", "-operator-policy"):
            policy, vap_binding = _admission(manifests, name)
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
    roles = of_kind(manifests, "ClusterRole") + of_kind(manifests, "Role")
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
        assert grants[("", "secrets")] == {"create"}  # never read back, never changed
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
        "--allowed-extended-resource=nvidia.com/gpu",
    ]
    # The key, read-only; and /tmp, the one writable path of its read-only root (the
    # Kubernetes client's discovery cache: the operator image's e2e test caught its absence).
    assert container["volumeMounts"] == [
        {"name": "ray-auth", "mountPath": RAY_AUTH_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["tmp"] == {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}
    volume = volumes["ray-auth"]
    (secret,) = of_kind(manifests, "Secret")
    assert volume["secret"]["secretName"] == secret["metadata"]["name"] == "rlhfjob-ray-auth-key"
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    key = base64.b64decode(secret["data"]["key"]).decode()
    assert len(key) == 64 and key.isalnum()
    # The chart's default policy flags are the operator's defaults.
    defaults = [a for a in _container(chart_manifests())["args"] if a.startswith("--allowed-")]
    assert defaults == [
        *(
            f"--allowed-volume-type={t}"
            for t in ("persistentVolumeClaim", "csi", "nfs", "emptyDir", "configMap", "secret")
        ),
        *(f"--allowed-extended-resource={r}" for r in DEFAULT_EXTENDED_RESOURCES),
    ]


@pytest.mark.parametrize(
    ("values", "policy"),
    [
        ((), JobPolicy()),
        (
            (
                "jobPolicy.allowedImageRegistries={ghcr.io/team,registry.example.com:5000}",
                "jobPolicy.allowedExtendedResources={nvidia.com/gpu,rdma/ib}",
                "kueue.enabled=true",
            ),
            JobPolicy(
                allowed_image_registries=("ghcr.io/team", "registry.example.com:5000"),
                allowed_extended_resources=("nvidia.com/gpu", "rdma/ib"),
                kueue=True,
            ),
        ),
        (("jobPolicy.allowedExtendedResources=[]",), JobPolicy(allowed_extended_resources=())),
        (
            ("kueue.enabled=true", "kueue.requireQueueName=false"),
            JobPolicy(kueue=True, require_queue_name=False),
        ),
    ],
    ids=["default", "lists-and-kueue", "no-extended-resources", "kueue-optional"],
)
def test_the_image_resource_and_queue_values_reach_both_forms_of_the_policy(
    values: tuple[str, ...], policy: JobPolicy
) -> None:
    """The operator's flags (as `rlhfjob operator` reads them) and the admission policy's
    variables say what the values say."""
    manifests = chart_manifests(*values)
    args = build_parser().parse_args(_container(manifests)["args"])
    assert tuple(args.allowed_image_registry or ()) == policy.allowed_image_registries
    extended = listed_or_default(args.allowed_extended_resource, DEFAULT_EXTENDED_RESOURCES)
    assert extended == policy.allowed_extended_resources
    assert (args.kueue, not args.kueue_optional) == (policy.kueue, policy.require_queue_name)
    variables = {v["name"]: v["expression"] for v in _admission(manifests)[0]["spec"]["variables"]}
    assert json.loads(variables["allowedImageRegistries"]) == list(policy.allowed_image_registries)
    assert json.loads(variables["allowedExtendedResources"]) == list(extended)
    assert json.loads(variables["kueue"]) is policy.kueue
    assert json.loads(variables["queueRequired"]) is (policy.kueue and policy.require_queue_name)


def test_the_network_values_reach_the_operator_as_destinations_it_reads() -> None:
    args = _container(chart_manifests())["args"]
    assert [
        a
        for a in args
        if a.startswith(("--prometheus-", "--api-server", "--allow-egress", "--approved-egress"))
    ] == ["--prometheus-namespace=monitoring", "--api-server-cidr=10.96.0.1/32:443"]
    manifests = chart_manifests(
        "networkPolicy.prometheusNamespaces={monitoring,observability}",
        "networkPolicy.apiServerCIDRs={10.0.0.10/32:6443}",
        "networkPolicy.extraEgress={10.20.0.0/16:443,fd00::/8}",
    )
    parsed = build_parser().parse_args(_container(manifests)["args"])
    assert parsed.prometheus_namespace == ["monitoring", "observability"]
    (api_server,) = [Destination.parse(c) for c in parsed.api_server_cidr]
    assert api_server == Destination((ipaddress.ip_network("10.0.0.10/32"),), (6443,))
    assert [Destination.parse(d).ports for d in parsed.allow_egress_to] == [(443,), ()]


@pytest.mark.parametrize("cidr", ["10.0.0.0", "10.0.0.0/8:http", "example.com/8"])
def test_values_schema_rejects_an_egress_destination_that_is_not_a_cidr(cidr: str) -> None:
    with pytest.raises(subprocess.CalledProcessError) as raised:
        chart_manifests(f"networkPolicy.extraEgress={{{cidr}}}")
    assert "extraEgress" in raised.value.stderr


def test_an_existing_ray_auth_secret_replaces_the_generated_one() -> None:
    manifests = chart_manifests("rayAuth.existingSecret=my-ray-key")
    assert not of_kind(manifests, "Secret")
    volumes = chart_deployment(manifests)["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in volumes if "secret" in v]
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
    assert "has(object.spec.serviceAccountName)" in variables["serviceAccount"]
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
    assert "variables.allowedVolumesText" in volume["messageExpression"]
    assert variables["operatorNamespace"] == '"rlhfjob-system"'
    assert variables["operatorServiceAccount"] == '"rlhfjob"'
    assert "variables.operatorServiceAccount" in own["expression"]
    disabled = chart_manifests("jobPolicy.admissionPolicy.enabled=false")
    for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
        left = [m["metadata"]["name"] for m in of_kind(disabled, kind)]
        assert left == ["rlhfjob-rlhfjob-system-operator-policy"]  # the operator's own bound


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
    # The one test hook the local operator adds, which no install of the chart can turn on.
    assert [a for a in command if a.startswith("--dev-")] == ["--dev-dashboard-from-annotation"]
    for values in ([], ["kueue.enabled=true"], list(MONITORING_VALUES)):
        assert not [a for a in _container(chart_manifests(*values))["args"] if "--dev-" in a]


def test_values_schema_wants_at_least_one_volume_type() -> None:
    """The operator falls back to its defaults when given no --allowed-volume-type."""
    empty = ["--set-json", "jobPolicy.allowedVolumeTypes=[]"]
    refused = helm("template", "rlhfjob", str(CHART), *empty, check=False)
    assert refused.returncode != 0 and "allowedVolumeTypes" in refused.stderr, refused.stderr
