"""Pod overrides against the real API server, KubeRay's CRD and the operator.

What needs no cluster (the merge, the rendering, the CEL rules, the operator's policy) is in the
unit tier. Here: a RayCluster with every override passes KubeRay's real CRD; the chart's
admission policy bounds the pods' volumes and Secret references; and a Secret reaches the job's
driver through env and envFrom while its value shows up in nothing the operator, Ray or
`rlhfjob render` writes.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from rlhf_local import cluster
from rlhf_local.jobs import Jobs, driver, job_manifest
from rlhf_local.operator_process import (
    OperatorProcess,
    apply_admission_policy,
    refusal,
    remove_admission_policy,
)
from rlhf_local.paths import local_dir
from rlhf_local.testing import LocalCluster, wait_for
from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import EVERY_POD_OVERRIDE, SECRET_ENV, SECRET_ENV_FROM, valid_job

pytestmark = pytest.mark.e2e


@pytest.fixture
def jobs(local_cluster: LocalCluster, namespace: str) -> Jobs:
    return Jobs(local_cluster, namespace)


def _render(manifest: dict[str, Any], directory: Path) -> str:
    """What `rlhfjob render` prints for the job."""
    path = directory / f"{manifest['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return subprocess.run(
        [sys.executable, "-m", "rlhfjob_cli", "render", str(path)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


def test_every_override_renders_to_a_raycluster_kuberays_crd_accepts(
    local_cluster: LocalCluster, namespace: str, tmp_path: Path
) -> None:
    manifest = job_manifest("overrides", namespace, "true", **EVERY_POD_OVERRIDE)
    assert refusal(local_cluster, manifest) is None, "the RLHFJob itself"
    rendered = _render(manifest, tmp_path)
    applied = local_cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "-f", "-", stdin=rendered
    )
    assert "raycluster.ray.io/overrides" in applied, applied
    cluster_doc = next(doc for doc in yaml.safe_load_all(rendered) if doc["kind"] == "RayCluster")
    trainer = cluster_doc["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert trainer["priorityClassName"] == "research-high"
    assert trainer["containers"][0]["resources"]["limits"]["rdma/ib"] == "1"


def test_the_admission_policy_bounds_pod_volumes_and_secret_references(
    local_cluster: LocalCluster, namespace: str
) -> None:
    lc = local_cluster
    applied = apply_admission_policy(
        lc,
        f"watchNamespaces={{{namespace}}}",
        "jobPolicy.allowedVolumeTypes={persistentVolumeClaim,emptyDir}",
    )

    def refused(spec: dict[str, Any]) -> str | None:
        body = merge_patch(valid_job("pods"), {"metadata": {"namespace": namespace}})
        body["spec"] = merge_patch(body["spec"], spec)
        return refusal(lc, body)

    host_path = {"name": "node", "hostPath": {"path": "/"}}
    try:
        first = wait_for(
            lambda: refused({"roles": {"trainer": {"pod": {"volumes": [host_path]}}}}),
            60,
            "the admission policy to take effect",
        )
        assert "spec.roles.trainer.pod.volumes: volume type hostPath" in first, first
        config_map = {"name": "c", "configMap": {"name": "c"}}
        head = refused({"head": {"pod": {"volumes": [config_map]}}})
        assert head and "spec.head.pod.volumes: volume type configMap" in head, head
        env = refused({"pods": {"env": [SECRET_ENV]}})
        assert env and "spec.pods: Secrets may not be read" in env and "hf-token" in env, env
        env_from = refused({"roles": {"rollout": {"pod": {"envFrom": [SECRET_ENV_FROM]}}}})
        assert env_from and "spec.roles.rollout.pod: Secrets may not" in env_from, env_from
        bucket = {"objectStore": {"bucket": "ckpts", "credentialsSecret": "s3"}}
        keys = refused({"checkpoint": bucket})
        assert keys and "spec.checkpoint.objectStore.credentialsSecret: Secrets" in keys, keys
        assert refused({"checkpoint": {"objectStore": {"bucket": "ckpts"}}}) is None
        pvc = {"name": "models", "persistentVolumeClaim": {"claimName": "models"}}
        settings = {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "s", "key": "k"}}}
        assert refused({"pods": {"volumes": [pvc], "env": [settings]}}) is None
        nulls = merge_patch(valid_job("nulls"), {"metadata": {"namespace": namespace}})
        nulls["spec"]["pods"] = None  # nullable: the policy must not stumble on it
        nulls["spec"]["head"] = {"pod": None}
        assert refusal(lc, nulls) is None
    finally:
        remove_admission_policy(lc, applied)


# --- A Secret in the environment -----------------------------------------------------------


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _checking_driver(expected: dict[str, str], release: Path) -> str:
    """A driver that proves it got each variable (by its digest, which the spec may show),
    prints the verdict, and exits once the test has read what it needs (`release` exists)."""
    code = f"""
import hashlib, os, sys, time
expected = {expected!r}
got = {{n: hashlib.sha256(os.environ.get(n, "").encode()).hexdigest() for n in expected}}
if got != expected:
    print("secret check FAILED:", sorted(n for n in expected if got[n] != expected[n]), flush=True)
    sys.exit(1)
print("secret check passed:", " ".join(sorted(expected)), flush=True)
while not os.path.exists({str(release)!r}):
    time.sleep(0.2)
print("trained", flush=True)
"""
    return driver(code)


def _create_secret(lc: LocalCluster, namespace: str, name: str, data: dict[str, str]) -> None:
    lc.core.create_namespaced_secret(
        namespace,
        client.V1Secret(metadata=client.V1ObjectMeta(name=name), string_data=data),
    )


def _files_holding(value: bytes, roots: list[Path]) -> list[str]:
    """Every readable file under `roots` that contains `value`."""
    found = []
    for root in roots:
        for path in root.rglob("*") if root.is_dir() else [root]:
            try:
                if path.is_file() and not path.is_symlink() and value in path.read_bytes():
                    found.append(str(path))
            except OSError:
                continue  # a socket, or gone while we looked
    return found


@pytest.fixture
def release(tmp_path: Path) -> Iterator[Path]:
    """The file the checking driver waits for; created at the end in any case."""
    path = tmp_path / "release-the-driver"
    yield path
    path.touch()


def test_a_secret_reaches_the_driver_and_nothing_the_platform_writes(
    jobs: Jobs, operator: OperatorProcess, release: Path, tmp_path: Path
) -> None:
    lc, namespace, name = jobs.lc, jobs.namespace, "secret-env"
    token, api_key = f"hf_{secrets.token_hex(16)}", f"wb_{secrets.token_hex(16)}"
    _create_secret(lc, namespace, "hf-token", {"token": token})
    _create_secret(lc, namespace, "wandb", {"API_KEY": api_key})
    entrypoint = _checking_driver(
        {"HF_TOKEN": _digest(token), "WANDB_API_KEY": _digest(api_key)}, release
    )
    manifest = job_manifest(
        name,
        namespace,
        entrypoint,
        pods={"env": [SECRET_ENV], "envFrom": [SECRET_ENV_FROM]},
        liveness={"heartbeatTimeoutSeconds": 600},  # the checking driver beats no Lease
        recovery={"maxRestarts": 0},  # a failed check fails the job, not a retry
    )
    jobs.create(manifest)
    jobs.wait_phase(name, "Running", 240, operator)
    submission = jobs.status(name)["submissionId"]

    def driver_log() -> str | None:
        # Ray echoes the entrypoint (which spells both verdicts) first: wait for a printed line.
        logs = str(jobs.ray_get(name, f"/api/jobs/{submission}/logs").get("logs", ""))
        verdicts = ("secret check passed:", "secret check FAILED:")
        return logs if any(line.startswith(verdicts) for line in logs.splitlines()) else None

    logs = wait_for(driver_log, 120, "the driver's verdict", details=operator.log_tail)
    assert "secret check passed: HF_TOKEN WANDB_API_KEY" in logs, logs

    # While the cluster lives: everything the platform wrote or logged about it.
    written = {
        "the RLHFJob": json.dumps(jobs.get(name)),
        "the RayCluster": json.dumps(jobs.ray_cluster(name)),
        "the job's ConfigMap": json.dumps(
            lc.core.read_namespaced_config_map(f"{name}-config", namespace).data
        ),
        "the driver's log": logs,
        "rlhfjob render": _render(manifest, tmp_path),
    }
    logged_roots = [cluster.Layout(local_dir()).logs, cluster.ray_temp_root(), operator.log_path]
    # The scan reaches the Ray job's own logs: the entrypoint (digests and all) is in them.
    assert _files_holding(_digest(token).encode(), [cluster.ray_temp_root()])
    release.touch()
    jobs.wait_phase(name, "Succeeded", 120, operator)
    written["the RLHFJob, finished"] = json.dumps(jobs.get(name))
    events = lc.core.list_namespaced_event(namespace).items
    written["the namespace's Events"] = json.dumps(lc.api.sanitize_for_serialization(events))
    written["the operator's log"] = operator.log_path.read_text(errors="replace")
    assert "secretKeyRef" in written["rlhfjob render"] and "hf-token" in written["the RayCluster"]
    for value in (token, api_key):
        leaks = [what for what, text in written.items() if value in text]
        leaks += _files_holding(value.encode(), logged_roots)
        assert not leaks, f"the Secret's value shows in: {leaks}"
