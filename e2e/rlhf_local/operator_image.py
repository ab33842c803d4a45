"""The operator run from its container image, as its Deployment runs it in a cluster.

`ImageOperatorProcess` is an `OperatorProcess` (the same flags, ports, readiness and log) whose
process is ``podman run`` of the operator image (`rlhf_local.images`, built or found by its
inputs' hash) under the chart's securityContext (non-root, read-only root, every capability
dropped, no privilege escalation), with the host's network (the local API server listens on
the loopback) and what a pod of the chart's ServiceAccount gets: its token, the cluster's CA
and its namespace at the in-cluster path, ``KUBERNETES_SERVICE_HOST``/``PORT``, and the Ray
auth key where the chart mounts it. No kubeconfig: the operator finds the API server as in a
pod. A broken image (a missing dependency, a file its user cannot read) fails its e2e test.
"""

from __future__ import annotations

import base64
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

import yaml

from rlhf_local import image_checks, images
from rlhf_local.operator_process import OPERATOR_NAMESPACE, OperatorProcess, operator_token
from rlhf_local.testing import LocalCluster

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where Kubernetes mounts a pod's ServiceAccount token, CA and namespace."""
RAY_AUTH_KEY = "/etc/rlhfjob-operator/ray-auth/key"
"""Where the chart mounts the Ray auth key (templates/deployment.yaml)."""
CONTAINER = "rlhfjob-operator-e2e"
FS_GROUP = 65532
"""The chart's pod fsGroup (templates/deployment.yaml): the group its Secret volumes get."""


def service_account_volume(lc: LocalCluster, directory: Path) -> tuple[Path, str, int]:
    """Write what Kubernetes mounts into a pod of the chart's ServiceAccount (a bound token,
    the API server's CA, the namespace) into `directory`, readable by the image's user; returns
    the directory and the API server's host and port."""
    token, _ = operator_token(lc)
    cluster = yaml.safe_load(lc.kubeconfig.read_text())["clusters"][0]["cluster"]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "token").write_text(token)
    (directory / "ca.crt").write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
    (directory / "namespace").write_text(OPERATOR_NAMESPACE)
    for path in (directory, *directory.iterdir()):  # a pod's projected volume: world-readable
        path.chmod(0o755 if path.is_dir() else 0o644)
    server = urlsplit(cluster["server"])
    assert server.hostname and server.port, cluster["server"]
    return directory, server.hostname, server.port


@dataclass
class ImageOperatorProcess(OperatorProcess):
    """`rlhfjob operator` in the operator image (see the module's docstring)."""

    image: str = ""
    #: The ServiceAccount volume (`service_account_volume`) and the API server it names.
    service_account_dir: Path = Path()
    api_host: str = "127.0.0.1"
    api_port: int = 443
    container: str = field(default=CONTAINER)

    def options(self) -> images.RunOptions:
        """The chart's securityContext, the pod's volumes and environment, the host network."""
        return image_checks.operator_options().with_(
            network="host",
            name=self.container,
            volumes=(
                f"{self.service_account_dir}:{SERVICE_ACCOUNT_DIR}:ro",
                f"{self.ray_auth_key_file}:{RAY_AUTH_KEY}:ro",
            ),
            env=(
                ("KUBERNETES_SERVICE_HOST", self.api_host),
                ("KUBERNETES_SERVICE_PORT", str(self.api_port)),
            ),
        )

    def command(self) -> list[str]:
        return images.run_command(self.image, self.operator_args(RAY_AUTH_KEY), self.options())

    def spawn(self, log: IO[bytes]) -> subprocess.Popen[bytes]:
        images.stop(self.container)  # one left by an interrupted run holds the name
        # As the chart's Secret volume: owner root, group the pod's fsGroup, mode 0440.
        os.chown(self.ray_auth_key_file, 0, FS_GROUP)
        self.ray_auth_key_file.chmod(0o440)
        return images.popen(
            self.image,
            self.operator_args(RAY_AUTH_KEY),
            self.options(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop(self) -> None:
        images.stop(self.container)  # SIGTERM in the container: the operator's own shutdown
        super().stop()
