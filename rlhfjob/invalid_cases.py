"""Invalid RLHFJobs and the field each must be blamed on.

One table, run at every layer that sees a job: the pydantic models (`tests/test_api.py`), the
generated CRD's schema and CEL rules (`tests/test_crd.py`) and the real API server (`e2e/`).
Each case is a patch on a small valid job; `None` in a patch deletes that key. The table is
long, so its parts live by topic in sibling modules (`invalid_algorithm_cases`,
`invalid_role_cases`, `invalid_reward_cases`, `invalid_checkpoint_cases`, `invalid_pod_cases`,
`invalid_environment_cases`); the job-wide cases are here.

`MODEL_ONLY_CASES` are what only the models (and so `rlhfjob validate` and the operator) can
refuse: the API server cannot see the part of the object they are about.
"""

from __future__ import annotations

from rlhfjob.invalid_algorithm_cases import ALGORITHM_CASES
from rlhfjob.invalid_case import InvalidCase
from rlhfjob.invalid_case import role_patch as _role
from rlhfjob.invalid_case import spec_patch as _spec
from rlhfjob.invalid_checkpoint_cases import CHECKPOINT_CASES
from rlhfjob.invalid_environment_cases import ENVIRONMENT_CASES
from rlhfjob.invalid_pod_cases import POD_OVERRIDE_CASES
from rlhfjob.invalid_research_cases import RESEARCH_CASES
from rlhfjob.invalid_reward_cases import REWARD_CASES
from rlhfjob.invalid_role_cases import ROLE_CASES


def _too_long(name: str, part: str, field: str, value: int, **others: int) -> InvalidCase:
    """`spec.<part>.<field>` above its upper bound (`others`: what its neighbours' rules need)."""
    return InvalidCase(
        f"{name}-too-long", _spec(**{part: {field: value, **others}}), f"spec.{part}.{field}"
    )


JOB_CASES: list[InvalidCase] = [
    # --- The job as a whole: its image and its top-level fields.
    InvalidCase("image-missing", _spec(image=None), "spec.image"),
    InvalidCase("image-empty", _spec(image=""), "spec.image"),
    InvalidCase("ray-version-not-semver", _spec(rayVersion="latest"), "spec.rayVersion"),
    InvalidCase("unknown-field", _spec(learningRate=0.1), "spec.learningRate"),
    InvalidCase(
        "active-deadline-zero", _spec(activeDeadlineSeconds=0), "spec.activeDeadlineSeconds"
    ),
    InvalidCase("pull-policy-unknown", _spec(imagePullPolicy="Sometimes"), "spec.imagePullPolicy"),
    # --- Names: the job's name is the RayCluster's (a DNS-1035 label of at most 53 characters,
    # KubeRay's limit) and the stem of the ConfigMap's, ServiceAccount's and Role's names.
    InvalidCase("name-too-long", {"metadata": {"name": "x" * 64}}, "metadata.name"),
    InvalidCase(
        "name-too-long-for-derived-names", {"metadata": {"name": "a" * 54}}, "metadata.name"
    ),
    InvalidCase("name-with-a-dot", {"metadata": {"name": "my.job"}}, "metadata.name"),
    InvalidCase("name-starting-with-a-digit", {"metadata": {"name": "1-job"}}, "metadata.name"),
    InvalidCase(
        "service-account-not-a-name",
        _spec(serviceAccountName="Trainer_SA"),
        "spec.serviceAccountName",
    ),
    # --- Image references the container runtime would refuse (InvalidImageName).
    InvalidCase("image-uppercase-path", _spec(image="example.com/Trainer:1"), "spec.image"),
    InvalidCase("image-with-a-space", _spec(image="example.com/trainer :1"), "spec.image"),
    InvalidCase("image-empty-tag", _spec(image="example.com/trainer:"), "spec.image"),
    InvalidCase("image-short-digest", _spec(image="trainer@sha256:abc123"), "spec.image"),
    # --- Liveness and recovery.
    InvalidCase(
        "heartbeat-timeout-not-above-interval",
        _spec(liveness={"heartbeatIntervalSeconds": 30, "heartbeatTimeoutSeconds": 30}),
        "spec.liveness.heartbeatTimeoutSeconds",
        "heartbeatTimeoutSeconds must exceed heartbeatIntervalSeconds",
    ),
    InvalidCase(
        "progress-timeout-below-heartbeat-timeout",
        _spec(liveness={"heartbeatTimeoutSeconds": 120, "progressTimeoutSeconds": 60}),
        "spec.liveness.progressTimeoutSeconds",
        "progressTimeoutSeconds must be at least heartbeatTimeoutSeconds",
    ),
    InvalidCase(
        "backoff-above-max",
        _spec(recovery={"backoffSeconds": 900, "maxBackoffSeconds": 60}),
        "spec.recovery.backoffSeconds",
        "backoffSeconds must not exceed maxBackoffSeconds",
    ),
    # --- Upper bounds of the durations a job sets (every wait of the operator ends).
    _too_long(
        "heartbeat-interval",
        "liveness",
        "heartbeatIntervalSeconds",
        601,
        heartbeatTimeoutSeconds=1200,
    ),
    _too_long(
        "heartbeat-timeout",
        "liveness",
        "heartbeatTimeoutSeconds",
        3601,
        progressTimeoutSeconds=7200,
    ),
    _too_long("progress-timeout", "liveness", "progressTimeoutSeconds", 86401),
    _too_long("restart-backoff", "recovery", "backoffSeconds", 3601, maxBackoffSeconds=7200),
    _too_long("restart-max-backoff", "recovery", "maxBackoffSeconds", 86401),
    _too_long("cluster-recovery-timeout", "recovery", "clusterRecoveryTimeoutSeconds", 86401),
    InvalidCase(
        "provisioning-timeout-too-long",
        _spec(provisioningTimeoutSeconds=604801),
        "spec.provisioningTimeoutSeconds",
    ),
    InvalidCase(
        "active-deadline-too-long",
        _spec(activeDeadlineSeconds=10**15),
        "spec.activeDeadlineSeconds",
    ),
    InvalidCase(
        "ttl-after-finished-too-long",
        _spec(ttlSecondsAfterFinished=31536001),
        "spec.ttlSecondsAfterFinished",
    ),
    # --- Types as the API server reads them, and text only its regular expressions accept.
    InvalidCase(
        "group-size-as-text", _spec(algorithm={"groupSize": "8"}), "spec.algorithm.groupSize"
    ),
    InvalidCase("suspend-as-text", _spec(suspend="true"), "spec.suspend"),
    InvalidCase(
        "reward-function-non-ascii",
        _spec(reward={"function": "tasks:scöre"}),
        "spec.reward.function",
    ),
    InvalidCase(
        "ray-version-non-ascii-digits",
        _spec(rayVersion="\u0662.\u0666\u0660.\u0660"),
        "spec.rayVersion",
    ),
]
"""What is wrong with the job as a whole, rather than with one part of its spec."""

INVALID_CASES: list[InvalidCase] = [
    *JOB_CASES,
    *ALGORITHM_CASES,
    *RESEARCH_CASES,
    *ROLE_CASES,
    *REWARD_CASES,
    *CHECKPOINT_CASES,
    *POD_OVERRIDE_CASES,
    *ENVIRONMENT_CASES,
]

MODEL_ONLY_CASES: list[InvalidCase] = [
    InvalidCase(
        "checkpoint-volume-two-sources",
        _spec(checkpoint={"volume": {"persistentVolumeClaim": {"claimName": "c"}, "emptyDir": {}}}),
        "spec.checkpoint.volume",
        "a volume has one source",
    ),
    InvalidCase(
        "pod-volume-two-sources",
        _spec(pods={"volumes": [{"name": "models", "emptyDir": {}, "configMap": {"name": "m"}}]}),
        "spec.pods.volumes[0]",
        "a volume has one source",
    ),
    InvalidCase(
        "pod-volume-without-a-source",
        _role("trainer", pod={"volumes": [{"name": "models"}]}),
        "spec.roles.trainer.pod.volumes[0]",
        "a volume needs a source",
    ),
    # Without a source Kubernetes makes the volume an empty directory: checkpoints written
    # there would be lost with the pod.
    InvalidCase(
        "checkpoint-volume-without-a-source",
        _spec(checkpoint={"volume": {}}),
        "spec.checkpoint.volume",
        "a volume needs a source",
    ),
    InvalidCase(
        "checkpoint-volume-of-no-kubernetes-source",
        _spec(checkpoint={"volume": {"foo": 1}}),
        "spec.checkpoint.volume",
        "'foo' is no Kubernetes volume source",
    ),
    InvalidCase(
        "pod-volume-of-no-kubernetes-source",
        _spec(pods={"volumes": [{"name": "models", "persistentVolume": {"claimName": "m"}}]}),
        "spec.pods.volumes[0]",
        "'persistentVolume' is no Kubernetes volume source",
    ),
    InvalidCase(
        "checkpoint-volume-source-not-an-object",
        _spec(checkpoint={"volume": {"hostPath": "/data"}}),
        "spec.checkpoint.volume.hostPath",
        "must be an object",
    ),
    # Sizes the server cannot measure (CEL has no serialisation): each costs the operator.
    InvalidCase(
        "random-init-too-large",
        _spec(model={"policy": None, "randomInit": {"model_type": "llama", "pad": "x" * 70000}}),
        "spec.model.randomInit",
        "more than the 65536 allowed",
    ),
    InvalidCase(
        "spec-too-large",
        _spec(pods={"env": [{"name": f"PAD{i}", "value": "x" * 30000} for i in range(5)]}),
        "spec",
        "more than the 131072 allowed",
    ),
]
"""Refused by the models only: a volume source is free-form to the CRD (one of some thirty
kinds), CEL sees only the properties a schema declares, and it cannot measure sizes."""
