"""The stand-in's pod environment (`rlhf_local.podenv`): env and envFrom resolved as a kubelet
resolves them, from Secrets and ConfigMaps of the pod's namespace."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from rlhf_local.podenv import pod_environment

NAMESPACE = "team-a"


class FakeCore:
    """The two reads `pod_environment` makes of Secrets and ConfigMaps (404 when missing)."""

    def __init__(self, secrets: dict[str, dict[str, str]], config_maps: dict[str, dict[str, str]]):
        self.secrets, self.config_maps = secrets, config_maps

    def read_namespaced_secret(self, name: str, namespace: str) -> client.V1Secret:
        assert namespace == NAMESPACE
        if name not in self.secrets:
            raise client.ApiException(status=404)
        data = {k: base64.b64encode(v.encode()).decode() for k, v in self.secrets[name].items()}
        return client.V1Secret(data=data)

    def read_namespaced_config_map(self, name: str, namespace: str) -> client.V1ConfigMap:
        assert namespace == NAMESPACE
        if name not in self.config_maps:
            raise client.ApiException(status=404)
        return client.V1ConfigMap(data=self.config_maps[name])


def _pod(env: list[client.V1EnvVar], env_from: list[client.V1EnvFromSource]) -> client.V1Pod:
    container = client.V1Container(name="ray-worker", env=env, env_from=env_from)
    spec = client.V1PodSpec(containers=[container], automount_service_account_token=False)
    return client.V1Pod(metadata=client.V1ObjectMeta(namespace=NAMESPACE), spec=spec)


def _secret_key(name: str, key: str) -> client.V1EnvVarSource:
    return client.V1EnvVarSource(secret_key_ref=client.V1SecretKeySelector(name=name, key=key))


def _environment(tmp_path: Path, pod: client.V1Pod, **objects: Any) -> dict[str, str]:
    core: Any = FakeCore(objects.get("secrets", {}), objects.get("config_maps", {}))
    return pod_environment(core, pod, tmp_path / "kubeconfig", tmp_path / "pod")


def test_env_takes_secret_and_config_map_keys_and_literals(tmp_path: Path) -> None:
    pod = _pod(
        [
            client.V1EnvVar(name="HF_TOKEN", value_from=_secret_key("hf", "token")),
            client.V1EnvVar(
                name="MODE",
                value_from=client.V1EnvVarSource(
                    config_map_key_ref=client.V1ConfigMapKeySelector(name="settings", key="mode")
                ),
            ),
            client.V1EnvVar(name="PLAIN", value="1"),
            client.V1EnvVar(name="MISSING", value_from=_secret_key("absent", "x")),
        ],
        [],
    )
    env = _environment(
        tmp_path,
        pod,
        secrets={"hf": {"token": "hf_s3cret"}},
        config_maps={"settings": {"mode": "fast"}},
    )
    assert (env["HF_TOKEN"], env["MODE"], env["PLAIN"]) == ("hf_s3cret", "fast", "1")
    assert "MISSING" not in env  # a kubelet would wait for it (or skip it when optional)


def test_env_from_gives_every_key_prefixed_and_env_wins(tmp_path: Path) -> None:
    pod = _pod(
        [client.V1EnvVar(name="WB_API_KEY", value="from-env")],
        [
            client.V1EnvFromSource(secret_ref=client.V1SecretEnvSource(name="wandb"), prefix="WB_"),
            client.V1EnvFromSource(config_map_ref=client.V1ConfigMapEnvSource(name="common")),
            client.V1EnvFromSource(secret_ref=client.V1SecretEnvSource(name="gone", optional=True)),
        ],
    )
    env = _environment(
        tmp_path,
        pod,
        secrets={"wandb": {"API_KEY": "k", "ENTITY": "team"}},
        config_maps={"common": {"LOG_LEVEL": "info", "not a name": "x", "WB_ENTITY": "cm"}},
    )
    assert env["WB_API_KEY"] == "from-env", "env wins over envFrom"
    assert env["WB_ENTITY"] == "cm", "a later source wins over an earlier one"
    assert env["LOG_LEVEL"] == "info"
    assert "not a name" not in env


@pytest.mark.parametrize("missing", ["secret", "config map"])
def test_a_missing_source_gives_nothing(tmp_path: Path, missing: str) -> None:
    source = (
        client.V1EnvFromSource(secret_ref=client.V1SecretEnvSource(name="gone"))
        if missing == "secret"
        else client.V1EnvFromSource(config_map_ref=client.V1ConfigMapEnvSource(name="gone"))
    )
    env = _environment(tmp_path, _pod([], [source]))
    assert set(env) == {"PATH"}
