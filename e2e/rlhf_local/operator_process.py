"""Run `rlhfjob operator` against the local cluster the way the Helm chart runs it.

The operator gets the chart's ServiceAccount and role and nothing more: `operator_kubeconfig`
renders the chart with helm, applies its RBAC, mints a token for that ServiceAccount and writes a
kubeconfig that carries only that token. A verb missing from the chart's role fails a test.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from rlhf_local import cluster
from rlhf_local.harness import LocalCluster, wait_for

REPO = Path(__file__).resolve().parents[2]
OPERATOR_NAMESPACE = "rlhfjob-system"
SERVICE_ACCOUNT = "rlhfjob-operator"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def chart_manifests(*values: str) -> list[dict[str, Any]]:
    """`helm template` of the chart, parsed."""
    helm = cluster.binaries().helm
    args = [
        str(helm),
        "template",
        "rlhfjob",
        str(REPO / "charts/rlhfjob"),
        "-n",
        OPERATOR_NAMESPACE,
    ]
    for value in values:
        args += ["--set", value]
    rendered = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def operator_kubeconfig(lc: LocalCluster, path: Path) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount (a bound token)."""
    rbac_kinds = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    lc.kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)
    for manifest in chart_manifests():
        if manifest["kind"] in rbac_kinds:
            lc.apply(manifest)
    minted = lc.core.create_namespaced_service_account_token(
        SERVICE_ACCOUNT,
        OPERATOR_NAMESPACE,
        client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=24 * 3600)
        ),
    )
    assert minted.status is not None
    token = minted.status.token
    admin = yaml.safe_load(lc.kubeconfig.read_text())
    admin_cluster = admin["clusters"][0]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [admin_cluster],
                "users": [{"name": SERVICE_ACCOUNT, "user": {"token": token}}],
                "contexts": [
                    {
                        "name": "operator",
                        "context": {"cluster": admin_cluster["name"], "user": SERVICE_ACCOUNT},
                    }
                ],
                "current-context": "operator",
            }
        )
    )
    path.chmod(0o600)
    return path


@dataclass
class OperatorProcess:
    """`rlhfjob operator` running in the background, restartable."""

    kubeconfig: Path
    log_path: Path
    metrics_port: int = field(default_factory=_free_port)
    health_port: int = field(default_factory=_free_port)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable, "-m", "rlhfjob_cli", "operator",
                    f"--metrics-port={self.metrics_port}",
                    f"--health-port={self.health_port}",
                    "--timer-interval=1",
                ],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        wait_for(self.healthy, 60, "the operator's liveness endpoint", details=self.log_tail)

    def healthy(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"operator exited: {self.process and self.process.returncode}")
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
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
