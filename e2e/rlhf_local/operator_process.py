"""Run `rlhfjob operator` against the local cluster the way the Helm chart runs it.

The operator gets the chart's ServiceAccount and role and nothing more: `operator_kubeconfig`
renders the chart with helm, applies its RBAC and its operator policy (the admission policy that
bounds the operator's writes to its jobs' objects; never its Secret or Deployment), mints a token
for that ServiceAccount and writes a kubeconfig that carries only that token. A verb missing from
the chart's role, or a write the operator policy refuses, fails a test. `OperatorProcess`
passes the flags the chart's Deployment passes: the operator's namespace and ServiceAccount (as
named in the rendered chart), the job policy's `--allowed-*` flags, and a Ray auth key file
(random, written next to the log, kept across restarts), and waits for its readiness.
`apply_admission_policy` installs the chart's job policy (a ValidatingAdmissionPolicy and its
binding).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rlhf_local import build, procs
from rlhf_local.harness import LocalCluster, wait_for
from rlhf_operator.ray_auth import RayAuth
from rlhfjob import api

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts/rlhfjob"
RELEASE = "rlhfjob"
OPERATOR_NAMESPACE = "rlhfjob-system"
#: Kinds of the chart that `operator_kubeconfig` applies: its identity and RBAC, no Secret.
RBAC_KINDS = frozenset(
    {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
)
#: Kinds of the chart that `apply_admission_policy` applies.
ADMISSION_KINDS = frozenset({"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"})
#: How the names of the chart's two admission policies (and their bindings) end: the job policy
#: (`apply_admission_policy`, per test) and the operator policy (`operator_kubeconfig`, with the
#: RBAC: the operator always runs bounded by it).
JOB_POLICY, OPERATOR_POLICY = "-job-policy", "-operator-policy"


#: The namespace label of the e2e tier's in-cluster reward servers (`E2E_APPROVED_EGRESS`).
REWARD_SERVERS_LABEL = "e2e.rlhf.dev/reward-servers"
E2E_APPROVED_EGRESS = [
    # The S3 server and trackers the harness runs on the loopback, on ports it picks.
    {"name": "local-servers", "cidrs": ["127.0.0.0/8"]},
    # The tests' buckets by IP literal: each opens its own address alone.
    {"name": "test-buckets", "cidrs": ["10.1.0.0/16:8333"]},
    # In-cluster reward servers, by any name on their port.
    {
        "name": "reward-servers",
        "namespaceSelector": {"matchLabels": {REWARD_SERVERS_LABEL: "true"}},
        "ports": [8000],
    },
    # A public HTTPS service: every address on 443 but NO_EGRESS, for names under example.com.
    {"name": "public-https", "cidrs": ["0.0.0.0/0:443"], "hosts": ["*.example.com"]},
]
"""What the e2e installation lets a job open (`networkPolicy.approvedEgress`)."""
TEMPLATE_API_SERVER = "networkPolicy.apiServerCIDRs={10.96.0.1/32:443}"
"""The API server's range `chart_manifests` renders with (the local `kubernetes` Service's
cluster IP): `helm template` reads no cluster to derive it from. A caller's value replaces it;
`networkPolicy.apiServerCIDRs=null` leaves it out."""

#: The chart's values the e2e operator runs with: Kueue's integration on (the local control plane
#: runs Kueue), so its RBAC is what the tests exercise; jobs without a queue label run unqueued
#: (most tests are about something else: the refusal is `tests/security/` and the attacks'); the
#: destinations its jobs may name.
OPERATOR_VALUES = (
    "kueue.enabled=true",
    "kueue.requireQueueName=false",
    f"networkPolicy.approvedEgress={json.dumps(E2E_APPROVED_EGRESS)}",
)


#: The chart's values that turn its monitoring objects on (all off by default).
MONITORING_VALUES = (
    "metrics.serviceMonitor.enabled=true",
    "metrics.podMonitor.enabled=true",
    "metrics.prometheusRule.enabled=true",
)


def of_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The rendered objects of one kind."""
    return [m for m in manifests if m["kind"] == kind]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run helm (fetched in seconds when missing: rendering needs no control plane)."""
    binary = str(build.ensure_tools()["helm"])
    return subprocess.run([binary, *args], capture_output=True, text=True, check=check)


def chart_manifests(
    *values: str, release: str = RELEASE, namespace: str = OPERATOR_NAMESPACE
) -> list[dict[str, Any]]:
    """`helm template` of the chart, parsed: each of `values` is a `--set`, or a `--set-json`
    where its value is a JSON list (`KEY=[...]`); `TEMPLATE_API_SERVER` comes first."""
    args = ["template", release, str(CHART), "-n", namespace]
    for value in (TEMPLATE_API_SERVER, *values):
        args += ["--set-json" if value.partition("=")[2].startswith("[") else "--set", value]
    return [doc for doc in yaml.safe_load_all(helm(*args).stdout) if doc]


def chart_deployment(manifests: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The operator's Deployment in the rendered chart."""
    found = [m for m in manifests or chart_manifests() if m["kind"] == "Deployment"]
    assert len(found) == 1, f"the chart renders {len(found)} Deployments"
    return found[0]


def chart_service_account(manifests: list[dict[str, Any]] | None = None) -> str:
    """Name of the ServiceAccount the chart's Deployment runs the operator as."""
    manifests = manifests or chart_manifests()
    name = str(chart_deployment(manifests)["spec"]["template"]["spec"]["serviceAccountName"])
    accounts = {m["metadata"]["name"] for m in manifests if m["kind"] == "ServiceAccount"}
    assert name in accounts, f"the chart's Deployment runs as {name}, which it does not create"
    return name


CHART_OPERATOR_FLAGS = (
    "--allowed-",
    "--kueue",
    "--tolerate-all-taints",
    "--prometheus-namespace",
    "--api-server-cidr",
    "--allow-egress-to",
    "--approved-egress",
)
"""The flags of the chart's Deployment that the local operator takes over as they are."""


def chart_policy_args(manifests: list[dict[str, Any]] | None = None) -> list[str]:
    """The job policy and network flags (`--allowed-volume-type=...`, `--kueue`,
    `--prometheus-namespace=...`) of the chart's Deployment rendered with `OPERATOR_VALUES`."""
    manifests = manifests or chart_manifests(*OPERATOR_VALUES)
    container = chart_deployment(manifests)["spec"]["template"]["spec"]["containers"][0]
    return [arg for arg in container["args"] if arg.startswith(CHART_OPERATOR_FLAGS)]


def operator_token(lc: LocalCluster) -> tuple[str, str]:
    """A bound token of the chart's ServiceAccount (its RBAC and operator policy applied
    first) and that ServiceAccount's name."""
    lc.kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)
    manifests = chart_manifests(*OPERATOR_VALUES)
    service_account = chart_service_account(manifests)
    for manifest in manifests:
        if manifest["kind"] in RBAC_KINDS or _is_admission(manifest, OPERATOR_POLICY):
            lc.apply(manifest)
    minted = lc.core.create_namespaced_service_account_token(
        service_account,
        OPERATOR_NAMESPACE,
        client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=24 * 3600)
        ),
    )
    assert minted.status is not None and minted.status.token
    return minted.status.token, service_account


def operator_kubeconfig(lc: LocalCluster, path: Path) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount (a bound token)."""
    token, service_account = operator_token(lc)
    admin = yaml.safe_load(lc.kubeconfig.read_text())
    admin_cluster = admin["clusters"][0]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [admin_cluster],
                "users": [{"name": service_account, "user": {"token": token}}],
                "contexts": [
                    {
                        "name": "operator",
                        "context": {"cluster": admin_cluster["name"], "user": service_account},
                    }
                ],
                "current-context": "operator",
            }
        )
    )
    path.chmod(0o600)
    return path


def apply_admission_policy(lc: LocalCluster, *values: str) -> list[dict[str, Any]]:
    """Apply the chart's ValidatingAdmissionPolicy and its binding (rendered with `values`).

    Returns what it applied, for `remove_admission_policy`. The API server enforces a new
    policy a moment later, not at once: poll for the first refusal.
    """
    manifests = [m for m in chart_manifests(*values) if _is_admission(m, JOB_POLICY)]
    assert {m["kind"] for m in manifests} == ADMISSION_KINDS, "admissionPolicy is disabled"
    for manifest in manifests:
        lc.apply(manifest)
    return manifests


def _is_admission(manifest: dict[str, Any], policy: str) -> bool:
    """Whether `manifest` is the chart's admission policy (or binding) named `policy`."""
    return manifest["kind"] in ADMISSION_KINDS and manifest["metadata"]["name"].endswith(policy)


def remove_admission_policy(lc: LocalCluster, manifests: list[dict[str, Any]]) -> None:
    """Delete what `apply_admission_policy` applied."""
    for manifest in reversed(manifests):
        kind, name = manifest["kind"].lower(), manifest["metadata"]["name"]
        lc.kubectl("delete", kind, name, "--ignore-not-found", "--wait=false")


@contextlib.contextmanager
def verb_revoked(lc: LocalCluster, resource: str, verb: str) -> Iterator[None]:
    """The chart's roles without `verb` on `resource` (for example `rlhfjobs/status`) while the
    block runs, then restored: a failure the operator cannot mend by itself, so every reconcile
    that needs the verb fails until the block ends."""
    originals = [
        m for m in chart_manifests(*OPERATOR_VALUES)
        if m["kind"] in {"ClusterRole", "Role"}
        and any(resource in rule.get("resources", ()) for rule in m.get("rules", ()))
    ]  # fmt: skip
    assert originals, f"no role of the chart grants anything on {resource}"
    for original in originals:
        revoked = copy.deepcopy(original)
        for rule in revoked["rules"]:
            if resource in rule.get("resources", ()):
                rule["verbs"] = [v for v in rule["verbs"] if v != verb]
        revoked["rules"] = [rule for rule in revoked["rules"] if rule["verbs"]]
        lc.apply(revoked)
    try:
        yield
    finally:
        for original in originals:
            lc.apply(original)


def refusal(lc: LocalCluster, body: dict[str, Any]) -> str | None:
    """Why the API server refuses to create the RLHFJob `body` (a dry run: nothing is created),
    as `HTTP <status>: <its message>`; None when it accepts it."""
    namespace = body["metadata"]["namespace"]
    try:
        lc.custom.create_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.PLURAL, body,
            dry_run="All", field_validation="Strict",
        )  # fmt: skip
    except ApiException as error:
        text = error.body or "{}"
        return f"HTTP {error.status}: {json.loads(text).get('message', text)}"
    return None


@dataclass
class OperatorProcess:
    """`rlhfjob operator` running in the background, restartable."""

    kubeconfig: Path
    log_path: Path
    metrics_port: int = field(default_factory=procs.free_port)
    health_port: int = field(default_factory=procs.free_port)
    readiness_port: int = field(default_factory=procs.free_port)
    process: subprocess.Popen[bytes] | None = None
    #: The operator's identity, as the chart's Deployment passes it.
    namespace: str = OPERATOR_NAMESPACE
    service_account: str = field(default_factory=chart_service_account)
    #: `--allowed-volume-type=...` and `--allowed-service-account=...` of the chart's Deployment.
    policy_args: list[str] = field(default_factory=chart_policy_args)
    #: The Ray auth key (`--ray-auth-key-file`): next to the log, written once, so a restarted
    #: operator still holds the key of the Ray clusters it made.
    ray_auth_key_file: Path = field(init=False)

    def __post_init__(self) -> None:
        self.ray_auth_key_file = self.log_path.with_name(self.log_path.stem + ".ray-auth-key")

    def _write_key(self) -> None:
        """Write a random key (mode 0600) unless one is there."""
        if self.ray_auth_key_file.exists():
            return
        self.ray_auth_key_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.ray_auth_key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as key:
            key.write(RayAuth.new_key())

    def command(self) -> list[str]:
        """`rlhfjob operator` with the flags the chart's Deployment passes (local ports)."""
        return [sys.executable, "-m", "rlhfjob_cli", *self.operator_args(self.ray_auth_key_file)]

    def operator_args(self, ray_auth_key_file: Path | str) -> list[str]:
        """`rlhfjob`'s arguments: ``operator`` and its flags, the key file where it reads it."""
        return [
            "operator",
            f"--metrics-port={self.metrics_port}",
            f"--health-port={self.health_port}",
            f"--readiness-port={self.readiness_port}",
            "--timer-interval=1",
            f"--operator-namespace={self.namespace}",
            f"--operator-service-account={self.service_account}",
            f"--ray-auth-key-file={ray_auth_key_file}",
            *self.policy_args,
            "--dev-dashboard-from-annotation",  # the stand-in Ray publishes it there
        ]  # fmt: skip

    def start(self) -> None:
        self._write_key()
        with self.log_path.open("ab") as log:
            self.process = self.spawn(log)
        wait_for(self.healthy, 60, "the operator's liveness endpoint", details=self.log_tail)
        wait_for(self.ready, 60, "the operator's readiness endpoint", details=self.log_tail)

    def spawn(self, log: IO[bytes]) -> subprocess.Popen[bytes]:
        """Start the operator, its output into `log`."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        return subprocess.Popen(
            self.command(),
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def healthy(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"operator exited: {self.process and self.process.returncode}")
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)

    def ready(self) -> bool:
        """Whether the readiness endpoint answers 200 (started, and the API server answers)."""
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"operator exited: {self.process and self.process.returncode}")
        url = f"http://127.0.0.1:{self.readiness_port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return bool(response.status == 200)
        except urllib.error.HTTPError:  # 503: not ready yet
            return False

    def stop(self) -> None:
        procs.terminate(self.process)
        self.process = None

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def log_tail(self, lines: int = 60) -> str:
        if not self.log_path.exists():
            return "(no operator log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def metric_value(text: str, series: str) -> float:
    """The value of one series (`name{labels}`) in a Prometheus text exposition; 0 if absent."""
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0
