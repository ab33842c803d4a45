"""What a Ray process of the stand-in sees of its pod: env, mounted ConfigMaps, identity.

A real Ray pod runs with its container's environment, its ConfigMap volumes mounted and its
ServiceAccount's token. The stand-in runs Ray on this machine instead, so it recreates those
three things for each Ray node it starts: the container's env vars (literal ones, and those
from a Secret key, as the kubelet resolves them: the Ray token KubeRay injects); each ConfigMap
volume written to a local directory (env values under the mount path are rewritten to point
there); and, unless the pod opts out of a token (`automountServiceAccountToken: false`), a
kubeconfig that authenticates as the pod's ServiceAccount, so the trainer's heartbeat has
exactly the permissions it would have in a real cluster (its one Lease).
"""

from __future__ import annotations

import base64
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client


def _write_config_maps(core: client.CoreV1Api, pod: Any, root: Path) -> dict[str, str]:
    """Write each ConfigMap volume of the pod under `root`; mount path → local directory."""
    container = pod.spec.containers[0]
    mounts = {m.name: m.mount_path for m in container.volume_mounts or []}
    local: dict[str, str] = {}
    for volume in pod.spec.volumes or []:
        if volume.config_map is None or volume.name not in mounts:
            continue
        try:
            config_map = core.read_namespaced_config_map(
                volume.config_map.name, pod.metadata.namespace
            )
        except client.ApiException as error:
            if error.status != 404:
                raise
            continue  # a kubelet would wait for it; here the process simply lacks the files
        directory = root / volume.name
        directory.mkdir(parents=True, exist_ok=True)
        for key, value in (config_map.data or {}).items():
            (directory / key).write_text(value)
        local[mounts[volume.name]] = str(directory)
    return local


def _secret_value(core: client.CoreV1Api, namespace: str, ref: Any) -> str | None:
    """A `secretKeyRef`'s value; None when the Secret or key is missing (a kubelet would wait)."""
    try:
        secret = core.read_namespaced_secret(ref.name, namespace)
    except client.ApiException as error:
        if error.status != 404:
            raise
        return None
    encoded = (secret.data or {}).get(ref.key)
    return base64.b64decode(encoded).decode() if encoded is not None else None


def _service_account_kubeconfig(
    core: client.CoreV1Api, pod: Any, admin_kubeconfig: Path, path: Path
) -> Path | None:
    account = pod.spec.service_account_name
    if not account or pod.spec.automount_service_account_token is False:
        return None
    minted = core.create_namespaced_service_account_token(
        account,
        pod.metadata.namespace,
        client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=24 * 3600)
        ),
    )
    assert minted.status is not None
    admin = yaml.safe_load(admin_kubeconfig.read_text())
    cluster = admin["clusters"][0]
    user = f"system:serviceaccount:{pod.metadata.namespace}:{account}"
    context = {"cluster": cluster["name"], "user": user}
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [cluster],
                "users": [{"name": user, "user": {"token": minted.status.token}}],
                "contexts": [{"name": "pod", "context": context}],
                "current-context": "pod",
            }
        )
    )
    path.chmod(0o600)
    return path


def pod_environment(
    core: client.CoreV1Api, pod: Any, admin_kubeconfig: Path, root: Path
) -> dict[str, str]:
    """Environment variables that make a local process look like it runs in `pod`."""
    root.mkdir(parents=True, exist_ok=True)
    mounted = _write_config_maps(core, pod, root)
    env: dict[str, str] = {}
    for var in pod.spec.containers[0].env or []:
        value = var.value
        if value is None and var.value_from is not None and var.value_from.secret_key_ref:
            value = _secret_value(core, pod.metadata.namespace, var.value_from.secret_key_ref)
        if value is None:
            continue  # another valueFrom: nothing local to resolve it from
        for mount_path, directory in mounted.items():
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                value = directory + value[len(mount_path.rstrip("/")) :]
        env[var.name] = value
    kubeconfig = _service_account_kubeconfig(core, pod, admin_kubeconfig, root / "kubeconfig")
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    # The image puts the project's commands on PATH; here they live next to this interpreter.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return env
