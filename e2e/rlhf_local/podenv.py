"""What a Ray process of the stand-in sees of its pod: env, mounted ConfigMaps, identity.

A real Ray pod runs with its container's environment, its ConfigMap volumes mounted and its
ServiceAccount's token. The stand-in runs Ray on this machine instead, so it recreates those
three things for each Ray node it starts: the container's env vars as the kubelet resolves them
(`envFrom` Secrets and ConfigMaps first, each key with its prefix, then `env`: literal values
and Secret or ConfigMap keys, such as the Ray token KubeRay injects); each ConfigMap
volume written to a local directory (env values under the mount path are rewritten to point
there); and, unless the pod opts out of a token (`automountServiceAccountToken: false`), a
kubeconfig that authenticates as the pod's ServiceAccount, so the trainer's heartbeat has
exactly the permissions it would have in a real cluster (its one Lease).
"""

from __future__ import annotations

import base64
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from rlhfjob.api import ENV_NAME_PATTERN

_ENV_NAME = re.compile(ENV_NAME_PATTERN)


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


def _object_data(core: client.CoreV1Api, namespace: str, kind: str, name: str) -> dict[str, str]:
    """A Secret's (decoded) or ConfigMap's data; empty when it is missing (a kubelet would wait
    for it, or start without it when the reference is optional)."""
    try:
        if kind == "secret":
            encoded = core.read_namespaced_secret(name, namespace).data or {}
            return {key: base64.b64decode(value).decode() for key, value in encoded.items()}
        return dict(core.read_namespaced_config_map(name, namespace).data or {})
    except client.ApiException as error:
        if error.status != 404:
            raise
        return {}


def _env_from(core: client.CoreV1Api, namespace: str, sources: list[Any]) -> dict[str, str]:
    """What `envFrom` gives: every key, prefixed; later sources win, keys that are no variable
    name are skipped (as the kubelet does)."""
    env: dict[str, str] = {}
    for source in sources:
        for kind, ref in (("secret", source.secret_ref), ("configmap", source.config_map_ref)):
            if ref is None:
                continue
            for key, value in _object_data(core, namespace, kind, ref.name).items():
                name = (source.prefix or "") + key
                if _ENV_NAME.match(name):
                    env[name] = value
    return env


def _value_from(core: client.CoreV1Api, namespace: str, source: Any) -> str | None:
    """A `valueFrom`'s value (a Secret's or ConfigMap's key); None when missing or of another
    kind (nothing local resolves a fieldRef)."""
    for kind, ref in (("secret", source.secret_key_ref), ("configmap", source.config_map_key_ref)):
        if ref is not None:
            return _object_data(core, namespace, kind, ref.name).get(ref.key)
    return None


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
    container, namespace = pod.spec.containers[0], pod.metadata.namespace
    env = _env_from(core, namespace, container.env_from or [])
    for var in container.env or []:
        value = var.value
        if value is None and var.value_from is not None:
            value = _value_from(core, namespace, var.value_from)
        if value is None:
            continue  # missing, or nothing local to resolve it from
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
