"""The job policy's two forms agree: the chart's admission policy, rendered by Helm and run with
cel-python as the API server runs it, refuses exactly the fields `JobPolicy.problems` refuses,
on the same jobs and the same installation values."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from rlhf_local.build import cached_tool
from rlhf_local.operator_process import OPERATOR_NAMESPACE, chart_manifests
from rlhf_operator import admission
from rlhf_operator.policy import DEFAULT_VOLUME_TYPES, UNQUEUED, JobPolicy
from rlhfjob.api import POD_PLACES
from rlhfjob.config import parse_job
from rlhfjob.contract.kueue import LABEL_QUEUE_NAME
from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import valid_job

needs_helm = pytest.mark.skipif(
    cached_tool("helm") is None,
    reason="helm missing: `python -m rlhf_local.build --tools` (task unit runs it)",
)
OPERATOR_ACCOUNT = "rlhfjob"
"""The chart's ServiceAccount for the release `chart_manifests` renders."""

HOST = {"name": "node", "hostPath": {"path": "/var"}}
EMPTY = {"name": "scratch", "emptyDir": {}}
SECRET_ENV = {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
CONFIG_ENV = {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}
TOKEN_SECRET = "other-job-ray-auth-0a1b2c3d4e"
MLFLOW = "http://mlflow.mlflow:5000"
TOKEN_CSI = {
    "name": "t",
    "csi": {"driver": "ebs.csi.aws.com", "nodePublishSecretRef": {"name": TOKEN_SECRET}},
}
CONTROL_PLANE = "node-role.kubernetes.io/control-plane"
CONTROL_PLANE_TOLERATION = {"key": CONTROL_PLANE, "operator": "Exists", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
IMAGE_VOLUME = {"name": "weights", "image": {"reference": "docker.io/attacker/weights:1"}}


def token_env(name: str) -> dict[str, Any]:
    return {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": name, "key": "auth_token"}}}


def nfs(server: str) -> dict[str, Any]:
    return {"name": "shared", "nfs": {"server": server, "path": "/export"}}


def affinity(key: str, preferred: bool = False) -> dict[str, Any]:
    term = {"matchExpressions": [{"key": key, "operator": "Exists"}]}
    if preferred:
        rules = {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": term}]
        }
    else:
        rules = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    return {"nodeAffinity": rules}


PLACES = {
    "pods": lambda pod: {"pods": pod},
    "head": lambda pod: {"head": {"pod": pod}},
    "trainer": lambda pod: {"roles": {"trainer": {"pod": pod}}},
    "rollout": lambda pod: {"roles": {"rollout": {"pod": pod}}},
}
JOBS: dict[str, dict[str, Any]] = {
    "valid": {},
    "checkpoint-host": {"checkpoint": {"volume": {"hostPath": {"path": "/data"}}}},
    "checkpoint-pvc": {"checkpoint": {"volume": {"persistentVolumeClaim": {"claimName": "c"}}}},
    "bucket-secret": {
        "checkpoint": {"objectStore": {"bucket": "ckpts", "credentialsSecret": "s3"}}
    },
    "bucket-ambient": {"checkpoint": {"objectStore": {"bucket": "ckpts"}}},
    "account-listed": {"serviceAccountName": "rlhf-trainer"},
    "account-other": {"serviceAccountName": "admin"},
    "account-operator": {"serviceAccountName": OPERATOR_ACCOUNT},
    **{f"{place}-host": put({"volumes": [EMPTY, HOST]}) for place, put in PLACES.items()},
    **{f"{place}-empty": put({"volumes": [EMPTY]}) for place, put in PLACES.items()},
    **{f"{place}-secret-env": put({"env": [SECRET_ENV]}) for place, put in PLACES.items()},
    "trainer-secret-ref": PLACES["trainer"]({"envFrom": [{"secretRef": {"name": "s"}}]}),
    "head-config-env": PLACES["head"]({"env": [CONFIG_ENV]}),
    "pods-null": {"pods": None},
    # Another job's Ray token, through every way a pod reads a Secret.
    "trainer-token-env": PLACES["trainer"]({"env": [token_env("b-ray-auth-0123456789")]}),
    "head-token-env-from": PLACES["head"]({"envFrom": [{"secretRef": {"name": TOKEN_SECRET}}]}),
    "pods-token-volume": PLACES["pods"](
        {"volumes": [{"name": "t", "secret": {"secretName": TOKEN_SECRET}}]}
    ),
    "rollout-token-projected": PLACES["rollout"](
        {"volumes": [{"name": "t", "projected": {"sources": [{"secret": {"name": TOKEN_SECRET}}]}}]}
    ),
    "trainer-token-csi": PLACES["trainer"]({"volumes": [TOKEN_CSI]}),
    "pods-token-pull": {"pods": {"imagePullSecrets": [{"name": "rlhfjob-ray-auth-key"}]}},
    "bucket-token": {
        "checkpoint": {"objectStore": {"bucket": "ckpts", "credentialsSecret": TOKEN_SECRET}}
    },
    "checkpoint-token-volume": {"checkpoint": {"volume": {"secret": {"secretName": TOKEN_SECRET}}}},
    "mlflow-token": {
        "tracking": {"mlflow": {"trackingUri": MLFLOW, "credentialsSecret": TOKEN_SECRET}}
    },
    "wandb-token": {"tracking": {"wandb": {"project": "p", "apiKeySecret": TOKEN_SECRET}}},
    "mlflow-secret": {"tracking": {"mlflow": {"trackingUri": MLFLOW, "credentialsSecret": "ml"}}},
    "wandb-secret": {"tracking": {"wandb": {"project": "p", "apiKeySecret": "wb"}}},
    "wandb-offline": {"tracking": {"wandb": {"project": "p"}}},
    "pods-secret-volume": PLACES["pods"](
        {"volumes": [{"name": "t", "secret": {"secretName": "hf"}}]}
    ),
    "pods-ray-auth-lookalike": PLACES["pods"]({"env": [token_env("my-ray-auth-notes")]}),
    # Placement and priority.
    "trainer-tolerate-all": {"roles": {"trainer": {"tolerations": [{"operator": "Exists"}]}}},
    "head-tolerate-control-plane": {"head": {"tolerations": [CONTROL_PLANE_TOLERATION]}},
    "rollout-tolerate-gpu": {"roles": {"rollout": {"tolerations": [GPU_TOLERATION]}}},
    "rollout-select-control-plane": {"roles": {"rollout": {"nodeSelector": {CONTROL_PLANE: ""}}}},
    "head-select-master": {"head": {"nodeSelector": {"node-role.kubernetes.io/master": ""}}},
    "trainer-affinity-control-plane": {"roles": {"trainer": {"affinity": affinity(CONTROL_PLANE)}}},
    "rollout-affinity-preferred": {
        "roles": {"rollout": {"affinity": affinity(CONTROL_PLANE, preferred=True)}}
    },
    "trainer-affinity-gpu": {"roles": {"trainer": {"affinity": affinity("gpu.example.com/a")}}},
    "trainer-affinity-null": {"roles": {"trainer": {"affinity": None}}},
    "priority-system": {"pods": {"priorityClassName": "system-node-critical"}},
    "priority-listed": {"pods": {"priorityClassName": "system-cluster-critical"}},
    "priority-team": {"pods": {"priorityClassName": "research-high"}},
    "scheduler-other": {"pods": {"schedulerName": "volcano"}},
    "scheduler-default": {"pods": {"schedulerName": "default-scheduler"}},
    # Inline NFS servers and CSI drivers.
    "pods-nfs-listed": PLACES["pods"]({"volumes": [nfs("10.0.0.5")]}),
    "head-nfs-other": PLACES["head"]({"volumes": [nfs("attacker.example.com")]}),
    "checkpoint-nfs": {"checkpoint": {"volume": {"nfs": {"server": "10.0.0.5", "path": "/c"}}}},
    "trainer-csi-other": PLACES["trainer"](
        {"volumes": [{"name": "c", "csi": {"driver": "secrets-store.csi.k8s.io"}}]}
    ),
    "rollout-csi-listed": PLACES["rollout"](
        {"volumes": [{"name": "c", "csi": {"driver": "ebs.csi.aws.com"}}]}
    ),
}
QUEUE = {"labels": {LABEL_QUEUE_NAME: "team-a"}}
SUPPLY_JOBS: dict[str, dict[str, Any]] = {
    # Images: the job's and image volumes' registries.
    "image-other-registry": {"spec": {"image": "docker.io/attacker/trainer:1"}},
    "image-lookalike-registry": {"spec": {"image": "example.com.attacker.io/trainer:1"}},
    "image-listed-path": {"spec": {"image": "registry.example.com/team/trainer:2"}},
    "image-sibling-path": {"spec": {"image": "registry.example.com/team-b/trainer:2"}},
    "image-listed-digest": {
        "spec": {"image": "registry.example.com/team/trainer@sha256:" + "a" * 64}
    },
    "pods-image-volume": {"spec": PLACES["pods"]({"volumes": [IMAGE_VOLUME]})},
    "checkpoint-image-volume": {
        "spec": {"checkpoint": {"volume": {"image": {"reference": "example.com/weights:1"}}}}
    },
    # Extended resources: extraResources, and a role's GPUs.
    "trainer-fpga": {"spec": PLACES["trainer"]({"extraResources": {"example.com/fpga": 1}})},
    "head-rdma": {"spec": PLACES["head"]({"extraResources": {"rdma/ib": 1}})},
    "pods-ephemeral-storage": {
        "spec": PLACES["pods"]({"extraResources": {"ephemeral-storage": 1}})
    },
    "trainer-gpus": {"spec": {"roles": {"trainer": {"gpus": 1}}}},
    # Kueue's queue label.
    "queued": {"metadata": QUEUE},
    "queued-empty": {"metadata": {"labels": {LABEL_QUEUE_NAME: ""}}},
}
"""Jobs about the installation's lists (images, extended resources) and Kueue: patches of the
whole job, tried under "default" and the installations that set those lists."""
INSTALLATIONS = {
    "default": ((), JobPolicy()),
    "no-secrets": (
        (
            "jobPolicy.allowedVolumeTypes={persistentVolumeClaim,nfs}",
            "jobPolicy.allowedServiceAccounts={rlhf-trainer}",
        ),
        JobPolicy(
            allowed_volume_types=("persistentVolumeClaim", "nfs"),
            allowed_service_accounts=("rlhf-trainer",),
        ),
    ),
    "host-paths": (
        ("jobPolicy.allowedVolumeTypes={hostPath,emptyDir,secret}",),
        JobPolicy(allowed_volume_types=("hostPath", "emptyDir", "secret")),
    ),
    "placement": (
        (
            "jobPolicy.tolerateAllTaints=true",
            "jobPolicy.allowedSystemPriorityClasses={system-cluster-critical}",
            "jobPolicy.allowedSchedulerNames={volcano}",
            "jobPolicy.allowedNfsServers={10.0.0.5}",
            "jobPolicy.allowedCsiDrivers={ebs.csi.aws.com}",
        ),
        JobPolicy(
            tolerate_all_taints=True,
            allowed_system_priority_classes=("system-cluster-critical",),
            allowed_scheduler_names=("volcano",),
            allowed_nfs_servers=("10.0.0.5",),
            allowed_csi_drivers=("ebs.csi.aws.com",),
        ),
    ),
    "kueue": (("kueue.enabled=true",), JobPolicy(kueue=True)),
    "supply": (
        (
            "jobPolicy.allowedImageRegistries={registry.example.com/team,example.com}",
            "jobPolicy.allowedExtendedResources={rdma/ib}",
            "jobPolicy.allowedVolumeTypes={persistentVolumeClaim,image}",
        ),
        JobPolicy(
            allowed_image_registries=("registry.example.com/team", "example.com"),
            allowed_extended_resources=("rdma/ib",),
            allowed_volume_types=("persistentVolumeClaim", "image"),
        ),
    ),
}
SUPPLY_INSTALLATIONS = ("default", "kueue", "supply")
"""Where `SUPPLY_JOBS` are tried; the last two only with them (and the valid job). Kueue on but
optional is Kueue off to the unlabelled jobs ("default"); `tests/test_chart.py` holds the
variable the chart renders for it."""


def job_policy(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """The chart's job policy (the chart's other admission policy bounds the operator)."""
    (policy,) = [
        m
        for m in manifests
        if m["kind"] == "ValidatingAdmissionPolicy"
        and m["metadata"]["name"].endswith("-job-policy")
    ]
    return policy


def rule_field(message: str) -> str:
    """The field a refusal names, at the grain of the admission policy's checks (which name a
    pod's volumes, or the pod for a Secret reference, not their index)."""
    field = message.split(":")[0]
    field = re.sub(r"\.(volumes|tolerations)\[\d+\]$", r".\1", field)
    return re.sub(r"\.(env|envFrom)\[\d+\]\..*$", "", field)


def document(name: str, namespace: str) -> dict[str, Any]:
    patch = SUPPLY_JOBS[name] if name in SUPPLY_JOBS else {"spec": JOBS[name]}
    job = merge_patch(valid_job(), patch)
    job["metadata"]["namespace"] = namespace
    return job


def jobs_under(installation: str) -> list[str]:
    """The jobs of the corpus tried under `installation`."""
    if installation not in SUPPLY_INSTALLATIONS[1:]:
        return sorted(JOBS) + (sorted(SUPPLY_JOBS) if installation == "default" else [])
    return ["valid", *sorted(SUPPLY_JOBS)]


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, Any]]:
    policies = {}
    for name, (values, _) in INSTALLATIONS.items():
        policies[name] = job_policy(chart_manifests(*values))["spec"]
    return policies


CASES = [
    (installation, job, namespace)
    for installation in sorted(INSTALLATIONS)
    for job in jobs_under(installation)
    for namespace in ("team", *((OPERATOR_NAMESPACE,) if job.startswith("account") else ()))
]
"""Every job in a team's namespace; the ServiceAccount ones in the operator's as well."""


@needs_helm
@pytest.mark.parametrize(("installation", "job", "namespace"), CASES)
def test_the_admission_policy_refuses_what_the_operator_refuses(
    rendered: dict[str, dict[str, Any]], installation: str, job: str, namespace: str
) -> None:
    _, python_policy = INSTALLATIONS[installation]
    python_policy = dataclasses.replace(
        python_policy,
        operator_namespace=OPERATOR_NAMESPACE,
        operator_service_account=OPERATOR_ACCOUNT,
    )
    raw = document(job, namespace)
    parsed = parse_job(raw)
    expected = {rule_field(problem) for problem in python_policy.problems(parsed)}
    for form in (raw, parsed.model_dump(mode="json", by_alias=True)):  # as sent; with defaults
        refused = admission.evaluate(rendered[installation], form, namespace=namespace)
        assert {rule_field(message) for message in refused} == expected


def test_the_corpus_has_refused_and_admitted_jobs_under_every_installation() -> None:
    """Else the agreement above would be about nothing."""
    for name, (_, policy) in INSTALLATIONS.items():
        verdicts = [
            bool(policy.problems(parse_job(document(job, "team")))) for job in jobs_under(name)
        ]
        assert any(verdicts) and not all(verdicts), name


@needs_helm
def test_an_update_that_keeps_a_refused_field_is_not_checked_again(
    rendered: dict[str, dict[str, Any]],
) -> None:
    policy = rendered["no-secrets"]
    old = document("checkpoint-host", "team")
    assert admission.evaluate(policy, old, namespace="team")
    relabelled = merge_patch(old, {"metadata": {"labels": {"team": "a"}}})
    assert admission.evaluate(policy, relabelled, namespace="team", old=old) == []
    changed = merge_patch(old, {"spec": {"serviceAccountName": "admin"}})
    assert admission.evaluate(policy, changed, namespace="team", old=old)


@needs_helm
def test_messages_name_the_field_and_what_is_allowed(rendered: dict[str, dict[str, Any]]) -> None:
    (message,) = admission.evaluate(
        rendered["default"], document("checkpoint-host", "team"), namespace="team"
    )
    assert message == (
        "spec.checkpoint.volume: volume type hostPath is not allowed "
        f"(allowed: {', '.join(DEFAULT_VOLUME_TYPES)})"
    )


@needs_helm
def test_images_and_queues_are_refused_naming_the_field_and_what_is_allowed(
    rendered: dict[str, dict[str, Any]],
) -> None:
    job = document("image-other-registry", "team")
    (image,) = admission.evaluate(rendered["supply"], job, namespace="team")
    assert image == (
        "spec.image: image docker.io/attacker/trainer:1 is not from a registry the installation "
        "allows (allowed: registry.example.com/team, example.com; the chart's "
        "jobPolicy.allowedImageRegistries)"
    )
    (queue,) = admission.evaluate(rendered["kueue"], document("valid", "team"), namespace="team")
    assert queue == f"metadata.labels[{LABEL_QUEUE_NAME}]: {UNQUEUED}"
    # A job created before Kueue was required is still relabelled, finalized and deleted.
    old = document("valid", "team")
    annotated = merge_patch(old, {"metadata": {"annotations": {"note": "x"}}})
    assert admission.evaluate(rendered["kueue"], annotated, namespace="team", old=old) == []


@needs_helm
def test_the_admission_policy_covers_every_place_of_pod_overrides() -> None:
    """CEL cannot walk the roles, so the policy lists the places: every one the API has."""
    manifests = chart_manifests("jobPolicy.allowedVolumeTypes={persistentVolumeClaim}")
    policy = job_policy(manifests)
    messages = [validation["message"] for validation in policy["spec"]["validations"]]
    for place in ("pods", *(f"{place}.pod" for place in POD_PLACES)):
        assert any(m.startswith(f"spec.{place}.volumes: volume type") for m in messages), place
        assert any(m.startswith(f"spec.{place}: Secrets may not") for m in messages), place
    defaults = chart_manifests()
    policy = job_policy(defaults)
    assert not any("Secrets may not" in v["message"] for v in policy["spec"]["validations"])


def test_the_chart_template_is_generated_from_the_policy() -> None:
    assert admission.main(["check"]) == 0, "run `task crds`"
