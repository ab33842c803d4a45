"""The job policy in the operator: what a job's volumes and environment may reach, where its
images come from, what it requests, and whether it names its Kueue queue."""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_operator.policy import DEFAULT_VOLUME_TYPES, JobPolicy
from rlhf_operator.policy_supply import image_allowed
from rlhfjob.config import parse_job
from rlhfjob.contract.kueue import LABEL_QUEUE_NAME
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


@pytest.mark.parametrize(
    ("image", "allowed"),
    [
        ("ghcr.io/team/trainer:1", True),
        ("ghcr.io/team/sub/trainer@sha256:" + "a" * 64, True),
        ("registry.example.com:5000/trainer:1", True),
        ("ghcr.io/team-b/trainer:1", False),  # a sibling path, not under ghcr.io/team
        ("ghcr.io.attacker.example/team/trainer:1", False),  # a look-alike host
        ("ghcr.io/teamtrainer:1", False),
        ("trainer:1", False),  # Docker Hub's, without its registry
        ("docker.io/team/trainer:1", False),
        ("quay.io/org/trainer:1", True),  # the repository itself, any tag
        ("quay.io/org/trainer-evil:1", False),
    ],
)
def test_images_come_from_a_listed_registry_path_or_repository(image: str, allowed: bool) -> None:
    registries = ("ghcr.io/team", "registry.example.com:5000", "quay.io/org/trainer")
    assert image_allowed(image, registries) is allowed
    problems = _problems(JobPolicy(allowed_image_registries=registries), {"image": image})
    assert problems == ([] if allowed else [
        f"spec.image: image {image!r} is not from a registry the installation allows (allowed: "
        f"{', '.join(registries)}; the chart's jobPolicy.allowedImageRegistries)"
    ])  # fmt: skip
    assert _problems(JobPolicy(), {"image": image}) == []  # no list: any image


def test_an_image_volume_is_an_image_too() -> None:
    policy = JobPolicy(
        allowed_image_registries=("example.com",), allowed_volume_types=("image", "emptyDir")
    )
    weights = {"name": "w", "image": {"reference": "docker.io/attacker/weights:1"}}
    spec = {"roles": {"rollout": {"pod": {"volumes": [{"name": "s", "emptyDir": {}}, weights]}}}}
    (problem,) = _problems(policy, spec)
    assert problem.startswith("spec.roles.rollout.pod.volumes[1]: image 'docker.io/attacker/")
    checkpoint = {"checkpoint": {"volume": {"image": {"reference": "example.com/ckpt:1"}}}}
    assert _problems(policy, checkpoint) == []


def test_extended_resources_come_from_the_installations_list() -> None:
    spec = {
        "pods": {"extraResources": {"ephemeral-storage": "10Gi", "hugepages-2Mi": "1Gi"}},
        "roles": {"trainer": {"gpus": 2, "pod": {"extraResources": {"rdma/ib": 1}}}},
        "head": {"pod": {"extraResources": {"example.com/fpga": 1}}},
    }
    # The pod API's own resources are free; GPUs are listed by default, nothing else.
    assert [p.split(":")[0] for p in _problems(JobPolicy(), spec)] == [
        "spec.head.pod.extraResources",
        "spec.roles.trainer.pod.extraResources",
    ]
    listed = JobPolicy(allowed_extended_resources=("rdma/ib", "example.com/fpga"))
    (gpus,) = _problems(listed, spec)
    assert gpus.startswith("spec.roles.trainer.gpus: GPUs (nvidia.com/gpu) are not an extended")
    assert "allowed: rdma/ib, example.com/fpga" in gpus
    both = JobPolicy(allowed_extended_resources=("nvidia.com/gpu", "rdma/ib", "example.com/fpga"))
    assert _problems(both, spec) == []


def _labelled(queue: str | None) -> Any:
    job = valid_job()
    if queue is not None:
        job["metadata"]["labels"] = {LABEL_QUEUE_NAME: queue}
    return parse_job(job)


@pytest.mark.parametrize(
    ("policy", "queue", "refused"),
    [
        (JobPolicy(), None, False),
        (JobPolicy(), "team-a", True),  # nothing would queue it
        (JobPolicy(kueue=True), "team-a", False),
        (JobPolicy(kueue=True), None, True),  # it would skip Kueue
        (JobPolicy(kueue=True), "", True),  # an empty label is none (queue_name)
        (JobPolicy(kueue=True, require_queue_name=False), None, False),
    ],
    ids=["off", "off-labelled", "on-labelled", "on-unlabelled", "on-empty", "on-optional"],
)
def test_with_kueue_on_every_job_names_its_queue(
    policy: JobPolicy, queue: str | None, refused: bool
) -> None:
    problems = policy.problems(_labelled(queue))
    assert [p.split(":")[0] for p in problems] == (
        [f"metadata.labels[{LABEL_QUEUE_NAME}]"] if refused else []
    )
