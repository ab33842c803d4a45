"""The job policy in the operator: what a job's volumes and environment may reach."""

from __future__ import annotations

from typing import Any

from rlhf_operator.policy import DEFAULT_VOLUME_TYPES, JobPolicy
from rlhfjob.config import parse_job
from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import valid_job

HOST = {"name": "node", "hostPath": {"path": "/var"}}
SECRET_ENV = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}


def _problems(policy: JobPolicy, spec: dict[str, Any]) -> list[str]:
    return policy.problems(parse_job(merge_patch(valid_job(), {"spec": spec})))


def test_every_pods_volumes_are_checked_like_the_checkpoint_volume() -> None:
    spec = {
        "pods": {"volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "m"}}]},
        "head": {"pod": {"volumes": [HOST]}},
        "roles": {"rollout": {"pod": {"volumes": [{"name": "ok", "emptyDir": {}}, HOST]}}},
    }
    assert _problems(JobPolicy(), spec) == [
        f"spec.head.pod.volumes[0]: volume type hostPath is not allowed here (allowed: "
        f"{', '.join(DEFAULT_VOLUME_TYPES)})",
        f"spec.roles.rollout.pod.volumes[1]: volume type hostPath is not allowed here (allowed: "
        f"{', '.join(DEFAULT_VOLUME_TYPES)})",
    ]
    assert (
        _problems(JobPolicy(allowed_volume_types=(*DEFAULT_VOLUME_TYPES, "hostPath")), spec) == []
    )


def test_secrets_in_the_environment_are_as_allowed_as_secret_volumes() -> None:
    spec = {
        "pods": {"env": [SECRET_ENV, {"name": "PLAIN", "value": "x"}]},
        "roles": {
            "trainer": {
                "pod": {"envFrom": [{"configMapRef": {"name": "c"}}, {"secretRef": {"name": "s"}}]}
            }
        },
    }
    assert _problems(JobPolicy(), spec) == []  # secret is allowed by default
    no_secrets = JobPolicy(allowed_volume_types=("persistentVolumeClaim", "emptyDir"))
    assert [line.split(":")[0] for line in _problems(no_secrets, spec)] == [
        "spec.pods.env[0].valueFrom.secretKeyRef",
        "spec.roles.trainer.pod.envFrom[1].secretRef",
    ]


def test_the_checkpoint_buckets_credentials_are_a_secret_read_like_any_other() -> None:
    spec = {"checkpoint": {"objectStore": {"bucket": "ckpts", "credentialsSecret": "s3"}}}
    assert _problems(JobPolicy(), spec) == []
    no_secrets = JobPolicy(allowed_volume_types=("persistentVolumeClaim",))
    (problem,) = _problems(no_secrets, spec)
    assert problem.startswith("spec.checkpoint.objectStore.credentialsSecret: Secrets may not")
    ambient = {"checkpoint": {"objectStore": {"bucket": "ckpts"}}}  # no Secret: nothing to refuse
    assert _problems(no_secrets, ambient) == []
