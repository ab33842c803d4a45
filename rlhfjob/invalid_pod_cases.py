"""Invalid pod overrides (`spec.pods`, a role's or the head's `pod`): nothing the operator or
KubeRay sets, mounts or labels may be replaced. Part of `rlhfjob.invalid_cases.INVALID_CASES`."""

from __future__ import annotations

from rlhfjob.invalid_case import InvalidCase
from rlhfjob.invalid_case import role_patch as _role
from rlhfjob.invalid_case import spec_patch as _spec
from rlhfjob.valid_cases import MODELS, MOUNT, SECRET

POD_OVERRIDE_CASES: list[InvalidCase] = [
    InvalidCase(
        "env-kuberay-sets",
        _spec(pods={"env": [{"name": "RAY_ADDRESS", "value": "elsewhere:6379"}]}),
        "spec.pods.env[0].name",
        "the operator or KubeRay sets this variable",
    ),
    InvalidCase(
        "env-operator-sets",
        _role("trainer", pod={"env": [{"name": "RLHF_ROLE", "value": "rollout"}]}),
        "spec.roles.trainer.pod.env[0].name",
        "the operator or KubeRay sets this variable",
    ),
    InvalidCase(
        "env-name-with-a-space",
        _spec(pods={"env": [{"name": "HF TOKEN", "value": "x"}]}),
        "spec.pods.env[0].name",
    ),
    InvalidCase(
        "env-value-and-value-from",
        _spec(pods={"env": [{"name": "A", "value": "x", "valueFrom": {"secretKeyRef": SECRET}}]}),
        "spec.pods.env[0].valueFrom",
        "set value or valueFrom, not both",
    ),
    InvalidCase(
        "env-from-secret-and-config-map-key",
        _spec(
            pods={
                "env": [
                    {"name": "A", "valueFrom": {"secretKeyRef": SECRET, "configMapKeyRef": SECRET}}
                ]
            }
        ),
        "spec.pods.env[0].valueFrom.secretKeyRef",
        "set exactly one of secretKeyRef and configMapKeyRef",
    ),
    InvalidCase(
        "env-repeated",
        _spec(pods={"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}),
        "spec.pods.env[1]",
        "Duplicate value",
    ),
    InvalidCase(
        "env-from-nothing",
        _spec(head={"pod": {"envFrom": [{"prefix": "WANDB_"}]}}),
        "spec.head.pod.envFrom[0].secretRef",
        "set exactly one of secretRef and configMapRef",
    ),
    InvalidCase(
        "pod-label-of-the-operator",
        _spec(pods={"labels": {"rlhf.dev/job": "someone-else"}}),
        "spec.pods.labels",
        "(or their subdomains) are the operator's and KubeRay's",
    ),
    InvalidCase(
        "pod-label-in-a-kuberay-subdomain",
        _spec(head={"pod": {"labels": {"x.ray.io/node-type": "worker"}}}),
        "spec.head.pod.labels",
        "(or their subdomains) are the operator's and KubeRay's",
    ),
    InvalidCase(
        "pod-annotation-of-kuberay",
        _role("rollout", pod={"annotations": {"ray.io/overwrite-container-cmd": "true"}}),
        "spec.roles.rollout.pod.annotations",
        "(or their subdomains) are the operator's and KubeRay's",
    ),
    InvalidCase(
        "pod-annotation-turning-apparmor-off",
        _role(
            "trainer",
            pod={
                "annotations": {
                    "container.apparmor.security.beta.kubernetes.io/ray-worker": "unconfined"
                }
            },
        ),
        "spec.roles.trainer.pod.annotations",
        "AppArmor and seccomp profiles are the operator's",
    ),
    InvalidCase(
        "pod-annotation-turning-seccomp-off",
        _spec(pods={"annotations": {"seccomp.security.alpha.kubernetes.io/pod": "unconfined"}}),
        "spec.pods.annotations",
        "AppArmor and seccomp profiles are the operator's",
    ),
    InvalidCase(
        "pod-label-value-with-a-space",
        _spec(pods={"labels": {"team": "rl hf"}}),
        "spec.pods.labels.team",
    ),
    InvalidCase(
        "volume-named-like-the-operators",
        _spec(pods={"volumes": [{"name": "dshm", "emptyDir": {}}]}),
        "spec.pods.volumes[0].name",
        "the operator names its own volumes so",
    ),
    InvalidCase(
        "volume-name-uppercase",
        _spec(pods={"volumes": [{"name": "Models", "emptyDir": {}}]}),
        "spec.pods.volumes[0].name",
    ),
    InvalidCase(
        "volumes-repeated",
        _spec(pods={"volumes": [{"name": "models", "emptyDir": {}}] * 2}),
        "spec.pods.volumes[1]",
        "Duplicate value",
    ),
    InvalidCase(
        "mount-over-shm",
        _spec(pods={**MODELS, "volumeMounts": [{"name": "models", "mountPath": "/dev/shm"}]}),
        "spec.pods.volumeMounts[0].mountPath",
        "mountPath must not be /, where the operator mounts a volume",
    ),
    InvalidCase(
        "mount-inside-job-config",
        _spec(pods={**MODELS, "volumeMounts": [{"name": "models", "mountPath": "/etc/rlhfjob/m"}]}),
        "spec.pods.volumeMounts[0].mountPath",
        "nor inside the read-only /etc/rlhfjob",
    ),
    InvalidCase(
        "mount-at-the-checkpoint-path",
        _spec(
            pods=MODELS,
            roles={
                "trainer": {"pod": {"volumeMounts": [MOUNT | {"mountPath": "/mnt/checkpoints"}]}}
            },
        ),
        "spec.roles.trainer.pod.volumeMounts",
        "no volumeMount may be at checkpoint.path",
    ),
    InvalidCase(
        "mount-of-no-volume",
        _role("trainer", pod={"volumeMounts": [MOUNT]}),
        "spec.roles.trainer.pod.volumeMounts",
        "every volumeMount must name a volume of this pod or of spec.pods",
    ),
    InvalidCase(
        "default-mount-of-a-roles-volume",
        _spec(pods={"volumeMounts": [MOUNT]}, roles={"trainer": {"pod": MODELS}}),
        "spec.pods.volumeMounts",
        "every volumeMount must name one of spec.pods.volumes",
    ),
    InvalidCase(
        "mounts-repeated",
        _spec(pods={**MODELS, "volumeMounts": [MOUNT, MOUNT | {"readOnly": True}]}),
        "spec.pods.volumeMounts[1]",
        "Duplicate value",
    ),
    InvalidCase(
        "mount-sub-path-up",
        _spec(pods={**MODELS, "volumeMounts": [MOUNT | {"subPath": "a/../../etc"}]}),
        "spec.pods.volumeMounts[0].subPath",
        "subPath must not contain . or .. segments nor //",
    ),
    InvalidCase(
        "mount-path-with-dot-dot",
        _spec(pods={**MODELS, "volumeMounts": [MOUNT | {"mountPath": "/mnt/../mnt/checkpoints"}]}),
        "spec.pods.volumeMounts[0].mountPath",
        "mountPath must not contain . or .. segments nor //",
    ),
    InvalidCase(
        "mount-sub-path-absolute",
        _spec(pods={**MODELS, "volumeMounts": [MOUNT | {"subPath": "/etc"}]}),
        "spec.pods.volumeMounts[0].subPath",
    ),
    InvalidCase(
        "extra-resource-cpu",
        _role("trainer", pod={"extraResources": {"cpu": "8"}}),
        "spec.roles.trainer.pod.extraResources",
        "cpu, memory and GPUs have their own fields",
    ),
    InvalidCase(
        "extra-resource-gpu",
        _role("rollout", pod={"extraResources": {"nvidia.com/gpu": 8}}),
        "spec.roles.rollout.pod.extraResources",
        "cpu, memory and GPUs have their own fields",
    ),
    InvalidCase(
        "shm-size-not-a-quantity",
        _spec(pods={"shmSize": "half the memory"}),
        "spec.pods.shmSize",
        "must be a Kubernetes quantity",
    ),
    InvalidCase(
        "quantity-with-a-huge-exponent",
        _role("critic", memory=".494E-73661000"),
        "spec.roles.critic.memory",
        "must be a Kubernetes quantity",
    ),
    InvalidCase(
        "priority-class-per-role",
        _role("trainer", pod={"priorityClassName": "high"}),
        "spec.roles.trainer.pod.priorityClassName",
    ),
    InvalidCase(
        "priority-class-not-a-name",
        _spec(pods={"priorityClassName": "High Priority"}),
        "spec.pods.priorityClassName",
    ),
    InvalidCase(
        "image-pull-secrets-repeated",
        _spec(pods={"imagePullSecrets": [{"name": "registry"}, {"name": "registry"}]}),
        "spec.pods.imagePullSecrets[1]",
        "Duplicate value",
    ),
]
