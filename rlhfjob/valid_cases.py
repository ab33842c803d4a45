"""Valid RLHFJobs the tests build on: the smallest job the API accepts, and a patch that sets
every pod override. `invalid_cases` patches them into what every layer must refuse."""

from __future__ import annotations

from typing import Any


def valid_job(name: str = "valid-job") -> dict[str, Any]:
    """The smallest job the API accepts, with both optional roles PPO needs."""
    return {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": name},
        "spec": {
            "image": "example.com/trainer:1",
            "model": {"policy": "/models/tiny"},
            "dataset": {"source": "synthetic:target_token"},
            "reward": {"function": "tasks:score"},
            "algorithm": {"name": "grpo", "totalSteps": 10},
            "roles": {"trainer": {}, "rollout": {"backend": "hf"}},
        },
    }


SECRET = {"name": "hf-token", "key": "token"}
MODELS = {"volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}]}
"""A pod overrides patch: a models volume."""
MOUNT = {"name": "models", "mountPath": "/models"}
SECRET_ENV = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": SECRET}}
SECRET_ENV_FROM = {"secretRef": {"name": "wandb"}, "prefix": "WANDB_"}
EVERY_POD_OVERRIDE: dict[str, Any] = {
    "pods": {
        "priorityClassName": "research-high",
        "schedulerName": "gang-scheduler",
        "imagePullSecrets": [{"name": "registry"}],
        "labels": {"team": "alignment"},
        "annotations": {"example.com/owner": "rl"},
        "env": [SECRET_ENV, {"name": "LOG_LEVEL", "value": "info"}],
        "envFrom": [SECRET_ENV_FROM, {"configMapRef": {"name": "settings", "optional": True}}],
        **MODELS,
        "volumeMounts": [MOUNT | {"readOnly": True}],
        "shmSize": "8Gi",
    },
    "head": {"pod": {"env": [{"name": "LOG_LEVEL", "value": "debug"}]}},
    "roles": {
        "trainer": {
            "pod": {
                "extraResources": {"rdma/ib": 1},
                "shmSize": "64Gi",
                "labels": {"tier": "train"},
                "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "100Gi"}}],
                "volumeMounts": [{"name": "scratch", "mountPath": "/scratch", "subPath": "t"}],
            }
        }
    },
}
"""A `spec` patch that sets every pod override, valid: the unit tests render it, e2e applies
the RayCluster it renders."""
