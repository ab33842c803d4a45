"""Invalid RLHFJobs and the field each must be blamed on.

One table, run at every layer that sees a job: the pydantic models (`tests/test_api.py`), the
generated CRD's schema and CEL rules (`tests/test_crd.py`) and the real API server (`e2e/`).
Each case is a patch on a small valid job; `None` in a patch deletes that key.

`MODEL_ONLY_CASES` are what only the models (and so `rlhfjob validate` and the operator) can
refuse: the API server cannot see the part of the object they are about.
"""

from __future__ import annotations

from rlhfjob.invalid_case import RANDOM_INIT, InvalidCase
from rlhfjob.invalid_case import role_patch as _role
from rlhfjob.invalid_case import spec_patch as _spec
from rlhfjob.invalid_case import toleration_patch as _toleration
from rlhfjob.invalid_pod_cases import POD_OVERRIDE_CASES

NFS_READ_ONLY_YES = {"server": "nfs.local", "path": "/models", "readOnly": "yes"}

INVALID_CASES: list[InvalidCase] = [
    InvalidCase("image-missing", _spec(image=None), "spec.image"),
    InvalidCase("image-empty", _spec(image=""), "spec.image"),
    InvalidCase(
        "model-neither",
        _spec(model={"policy": None}),
        "spec.model.policy",
        "set exactly one of policy and randomInit",
    ),
    InvalidCase("kernels-unknown", _spec(model={"kernels": "triton"}), "spec.model.kernels"),
    InvalidCase(
        "optimizer-offload-on-cpu-trainers",
        _spec(model={"optimizerOffload": "cpu"}),
        "spec.model.optimizerOffload",
        "model.optimizerOffload cpu moves the optimizer from the trainer's GPUs",
    ),
    InvalidCase(
        "optimizer-offload-unknown",
        _spec(model={"optimizerOffload": "nvme"}),
        "spec.model.optimizerOffload",
    ),
    InvalidCase(
        "kernels-liger-on-cpu-trainers",
        _spec(model={"kernels": "liger"}),
        "spec.model.kernels",
        "model.kernels liger runs Triton kernels on GPUs",
    ),
    InvalidCase(
        "kernels-liger-model-type-it-lacks",
        _spec(
            model={**RANDOM_INIT, "kernels": "liger", "randomInit": {"model_type": "gpt2"}},
            roles={"trainer": {"gpus": 1}},
        ),
        "spec.model.kernels",
        "kernels liger: Liger Kernel has no kernels for this randomInit",
    ),
    InvalidCase(
        "fused-logprobs-model-type-it-lacks",
        _spec(model={**RANDOM_INIT, "fusedLogprobs": True, "randomInit": {"model_type": "gemma2"}}),
        "spec.model.fusedLogprobs",
        "fusedLogprobs: this randomInit.model_type does more than a plain projection",
    ),
    InvalidCase(
        "model-both",
        _spec(model={"randomInit": {"model_type": "qwen2"}}),
        "spec.model.policy",
        "set exactly one of policy and randomInit",
    ),
    InvalidCase("algorithm-unknown", _spec(algorithm={"name": "dpo"}), "spec.algorithm.name"),
    InvalidCase(
        "grpo-group-of-one",
        _spec(algorithm={"groupSize": 1}),
        "spec.algorithm.groupSize",
        "grpo, rloo and reinforce-plus-plus-baseline need groupSize >= 2",
    ),
    InvalidCase(
        "rloo-group-of-one",
        _spec(algorithm={"name": "rloo", "groupSize": 1}),
        "spec.algorithm.groupSize",
        "grpo, rloo and reinforce-plus-plus-baseline need groupSize >= 2",
    ),
    InvalidCase(
        "policy-loss-unknown", _spec(algorithm={"policyLoss": "cispo"}), "spec.algorithm.policyLoss"
    ),
    InvalidCase(
        "loss-aggregation-unknown",
        _spec(algorithm={"lossAggregation": "seq-mean"}),
        "spec.algorithm.lossAggregation",
    ),
    InvalidCase(
        "clip-range-low-above-one",
        _spec(algorithm={"clipRangeLow": 1.5}),
        "spec.algorithm.clipRangeLow",
    ),
    InvalidCase(
        "dynamic-sampling-without-groups",
        _spec(algorithm={"name": "ppo", "dynamicSampling": {}}, roles={"critic": {}}),
        "spec.algorithm.dynamicSampling",
        "dynamicSampling drops groups of equal rewards",
    ),
    InvalidCase(
        "overlong-buffer-beyond-the-maximum",
        _spec(algorithm={"maxResponseLength": 16, "overlongShaping": {"bufferLength": 17}}),
        "spec.algorithm.overlongShaping.bufferLength",
        "overlongShaping.bufferLength must not exceed maxResponseLength",
    ),
    InvalidCase("group-size-zero", _spec(algorithm={"groupSize": 0}), "spec.algorithm.groupSize"),
    InvalidCase(
        "steps-and-epochs",
        _spec(algorithm={"epochs": 2}),
        "spec.algorithm.totalSteps",
        "set exactly one of totalSteps and epochs",
    ),
    InvalidCase(
        "neither-steps-nor-epochs",
        _spec(algorithm={"totalSteps": None}),
        "spec.algorithm.totalSteps",
        "set exactly one of totalSteps and epochs",
    ),
    InvalidCase(
        "micro-batch-too-large",
        _spec(algorithm={"promptsPerStep": 2, "groupSize": 2, "microBatchSize": 5}),
        "spec.algorithm.microBatchSize",
        "microBatchSize must not exceed the sequences of a step",
    ),
    InvalidCase("clip-range-zero", _spec(algorithm={"clipRange": 0}), "spec.algorithm.clipRange"),
    InvalidCase("kl-negative", _spec(algorithm={"klCoef": -0.1}), "spec.algorithm.klCoef"),
    InvalidCase(
        "kl-estimator-unknown", _spec(algorithm={"klEstimator": "k2"}), "spec.algorithm.klEstimator"
    ),
    InvalidCase("gamma-above-one", _spec(algorithm={"gamma": 1.5}), "spec.algorithm.gamma"),
    InvalidCase(
        "learning-rate-zero",
        _spec(algorithm={"policyLearningRate": 0}),
        "spec.algorithm.policyLearningRate",
    ),
    InvalidCase("top-p-above-one", _spec(algorithm={"topP": 1.5}), "spec.algorithm.topP"),
    InvalidCase(
        "ppo-without-critic",
        _spec(algorithm={"name": "ppo"}),
        "spec.roles",
        "ppo needs roles.critic",
    ),
    InvalidCase("roles-missing", _spec(roles=None), "spec.roles"),
    InvalidCase("reward-missing", _spec(reward=None), "spec.reward"),
    InvalidCase("rollout-missing", _spec(roles={"rollout": None}), "spec.roles.rollout"),
    InvalidCase(
        "rollout-gpus-not-multiple-of-tp",
        _role("rollout", gpus=3, tensorParallelSize=2, backend="vllm"),
        "spec.roles.rollout.gpus",
        "gpus must be a multiple of tensorParallelSize",
    ),
    InvalidCase(
        "tensor-parallel-zero",
        _role("rollout", tensorParallelSize=0),
        "spec.roles.rollout.tensorParallelSize",
    ),
    InvalidCase(
        "min-replicas-above-replicas",
        _role("rollout", replicas=2, minReplicas=3),
        "spec.roles.rollout.minReplicas",
        "minReplicas must not exceed replicas",
    ),
    InvalidCase(
        "trainer-without-replicas",
        _role("trainer", replicas=0),
        "spec.roles.trainer.replicas",
        "the trainer needs at least 1 replica",
    ),
    InvalidCase(
        "vllm-without-gpus",
        _role("rollout", backend="vllm", gpus=0),
        "spec.roles.rollout.backend",
        "the vllm backend needs gpus >= 1",
    ),
    InvalidCase(
        "colocated-with-rollout-gpus",
        _role("rollout", placement="colocated", gpus=8),
        "spec.roles.rollout.gpus",
        "colocated engines run on the trainer's GPUs",
    ),
    InvalidCase(
        "colocated-with-replicas",
        _role("rollout", placement="colocated", replicas=4),
        "spec.roles.rollout.replicas",
        "colocated engines come one per trainer rank",
    ),
    InvalidCase(
        "affinity-misspelt-field",
        _role(
            "trainer",
            affinity={
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchFields": []}],
                        "nodeSelectorTerm": [],
                    }
                }
            },
        ),
        "spec.roles.trainer.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerm",
    ),
    InvalidCase(
        "volume-source-misspelt-field",
        _spec(
            checkpoint={
                "volume": {"persistentVolumeClaim": {"claimName": "ckpt", "readonly": True}}
            }
        ),
        "spec.checkpoint.volume.persistentVolumeClaim.readonly",
    ),
    InvalidCase(
        "volume-source-without-a-required-field",
        _spec(checkpoint={"volume": {"nfs": {"path": "/exports/checkpoints"}}}),
        "spec.checkpoint.volume.nfs.server",
    ),
    InvalidCase(
        "volume-source-field-of-a-wrong-type",
        _spec(pods={"volumes": [{"name": "models", "nfs": NFS_READ_ONLY_YES}]}),
        "spec.pods.volumes[0].nfs.readOnly",
    ),
    InvalidCase(
        "volume-source-size-not-a-quantity",
        _spec(pods={"volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "lots"}}]}),
        "spec.pods.volumes[0].emptyDir.sizeLimit",
        "must be a Kubernetes quantity",
    ),
    InvalidCase(
        "affinity-weight-not-an-integer",
        _role(
            "rollout",
            affinity={
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": "high", "podAffinityTerm": {"topologyKey": "zone"}}
                    ]
                }
            },
        ),
        "spec.roles.rollout.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution"
        "[0].weight",
    ),
    InvalidCase(
        "max-staleness-with-colocated-engines",
        _spec(roles={"rollout": {"placement": "colocated"}}, algorithm={"maxStaleness": 1}),
        "spec.algorithm.maxStaleness",
        "colocated engines share the ranks' devices",
    ),
    InvalidCase(
        "partial-rollouts-on-policy",
        _spec(algorithm={"partialRolloutTokens": 4}),
        "spec.algorithm.partialRolloutTokens",
        "it needs maxStaleness >= 1",
    ),
    InvalidCase(
        "partial-rollout-segment-beyond-the-response",
        _spec(algorithm={"maxStaleness": 1, "maxResponseLength": 16, "partialRolloutTokens": 16}),
        "spec.algorithm.partialRolloutTokens",
        "must be fewer than maxResponseLength",
    ),
    InvalidCase(
        "colocated-with-min-replicas",
        _role("rollout", placement="colocated", minReplicas=1),
        "spec.roles.rollout.replicas",
        "colocated engines come one per trainer rank",
    ),
    InvalidCase(
        "colocated-with-own-pool",
        _role("rollout", placement="colocated", nodeSelector={"pool": "rollout"}),
        "spec.roles.rollout.placement",
        "colocated engines run in the trainer's pods",
    ),
    InvalidCase(
        "colocated-tensor-parallel",
        _spec(
            roles={
                "trainer": {"gpus": 4},
                "rollout": {"placement": "colocated", "backend": "vllm", "tensorParallelSize": 2},
            }
        ),
        "spec.roles.rollout.tensorParallelSize",
        "colocated engines span one GPU each for now",
    ),
    InvalidCase(
        "colocated-vllm-without-trainer-gpus",
        _role("rollout", placement="colocated", backend="vllm"),
        "spec.roles.rollout.placement",
        "colocated vllm engines need trainer GPUs",
    ),
    InvalidCase(
        "placement-unknown",
        _role("rollout", placement="shared"),
        "spec.roles.rollout.placement",
    ),
    InvalidCase(
        "sleep-level-three",
        _role("rollout", sleepLevel=3),
        "spec.roles.rollout.sleepLevel",
    ),
    InvalidCase("cpu-not-a-quantity", _role("trainer", cpu="lots"), "spec.roles.trainer.cpu"),
    InvalidCase(
        "memory-not-a-quantity", _role("rollout", memory="12 GB"), "spec.roles.rollout.memory"
    ),
    InvalidCase(
        "toleration-exists-with-value",
        _role("trainer", tolerations=[{"key": "gpu", "operator": "Exists", "value": "yes"}]),
        "spec.roles.trainer.tolerations[0].value",
        "value must be empty when operator is Exists",
    ),
    InvalidCase(
        "toleration-bad-effect",
        _role("trainer", tolerations=[{"key": "gpu", "effect": "Sometimes"}]),
        "spec.roles.trainer.tolerations[0].effect",
    ),
    InvalidCase(
        "reward-function-missing",
        _spec(reward={"function": None}),
        "spec.reward.function",
        "type function needs function (module:function)",
    ),
    InvalidCase(
        "reward-function-malformed",
        _spec(reward={"function": "just a name"}),
        "spec.reward.function",
    ),
    InvalidCase(
        "reward-model-without-role",
        _spec(reward={"type": "model", "function": None}),
        "spec.reward",
        "reward.type model needs roles.reward and model.reward",
    ),
    InvalidCase(
        "reward-model-component-without-role",
        _spec(
            reward={
                "type": "combined",
                "function": None,
                "components": [{"function": "tasks:score"}, {"type": "model", "weight": 0.5}],
            }
        ),
        "spec.reward",
        "reward.type model needs roles.reward and model.reward",
    ),
    InvalidCase(
        "reward-remote-without-url",
        _spec(reward={"type": "remote", "function": None}),
        "spec.reward.remote",
        "type remote needs remote (url)",
    ),
    InvalidCase(
        "reward-remote-url-not-http",
        _spec(reward={"type": "remote", "function": None, "remote": {"url": "ftp://rm/score"}}),
        "spec.reward.remote.url",
    ),
    InvalidCase(
        "reward-remote-zero-concurrency",
        _spec(
            reward={
                "type": "remote",
                "function": None,
                "remote": {"url": "http://rm:8000/score", "maxConcurrency": 0},
            }
        ),
        "spec.reward.remote.maxConcurrency",
    ),
    InvalidCase(
        "reward-combined-without-components",
        _spec(reward={"type": "combined", "function": None}),
        "spec.reward.components",
        "type combined needs components",
    ),
    InvalidCase(
        "reward-components-without-combined",
        _spec(reward={"components": [{"function": "tasks:score"}]}),
        "spec.reward.components",
        "components must be empty unless type is combined",
    ),
    InvalidCase(
        "reward-component-remote-without-url",
        _spec(reward={"type": "combined", "function": None, "components": [{"type": "remote"}]}),
        "spec.reward.components[0].remote",
        "type remote needs remote (url)",
    ),
    InvalidCase(
        "stop-string-empty",
        _spec(algorithm={"stopStrings": [""]}),
        "spec.algorithm.stopStrings[0]",
    ),
    InvalidCase(
        "checkpoint-path-relative", _spec(checkpoint={"path": "ckpt"}), "spec.checkpoint.path"
    ),
    InvalidCase(
        "checkpoint-interval-zero",
        _spec(checkpoint={"intervalSteps": 0}),
        "spec.checkpoint.intervalSteps",
    ),
    InvalidCase("keep-last-zero", _spec(checkpoint={"keepLast": 0}), "spec.checkpoint.keepLast"),
    InvalidCase(
        "object-store-upload-interval-not-a-multiple",
        _spec(
            checkpoint={
                "intervalSteps": 10,
                "objectStore": {"bucket": "ckpts", "intervalSteps": 15},
            }
        ),
        "spec.checkpoint.objectStore.intervalSteps",
        "objectStore.intervalSteps must be a multiple of intervalSteps",
    ),
    InvalidCase(
        "object-store-bucket-uppercase",
        _spec(checkpoint={"objectStore": {"bucket": "My_Bucket"}}),
        "spec.checkpoint.objectStore.bucket",
    ),
    InvalidCase(
        "object-store-endpoint-not-a-url",
        _spec(checkpoint={"objectStore": {"bucket": "ckpts", "endpoint": "s3.example.com"}}),
        "spec.checkpoint.objectStore.endpoint",
    ),
    InvalidCase(
        "object-store-prefix-without-slash",
        _spec(checkpoint={"objectStore": {"bucket": "ckpts", "prefix": "team-a"}}),
        "spec.checkpoint.objectStore.prefix",
    ),
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
    InvalidCase("ray-version-not-semver", _spec(rayVersion="latest"), "spec.rayVersion"),
    InvalidCase("unknown-field", _spec(learningRate=0.1), "spec.learningRate"),
    InvalidCase("name-too-long", {"metadata": {"name": "x" * 64}}, "metadata.name"),
    InvalidCase("dataset-source-missing", _spec(dataset={"source": None}), "spec.dataset.source"),
    InvalidCase(
        "active-deadline-zero", _spec(activeDeadlineSeconds=0), "spec.activeDeadlineSeconds"
    ),
    InvalidCase("pull-policy-unknown", _spec(imagePullPolicy="Sometimes"), "spec.imagePullPolicy"),
    # --- Names: the job's name is the RayCluster's (a DNS-1035 label of at most 53 characters,
    # KubeRay's limit) and the stem of the ConfigMap's, ServiceAccount's and Role's names.
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
    # --- Resource quantities the kubelet would refuse.
    InvalidCase(
        "cpu-negative",
        _role("trainer", cpu="-2"),
        "spec.roles.trainer.cpu",
        "must not be negative",
    ),
    InvalidCase(
        "memory-negative-integer",
        _role("rollout", memory=-1),
        "spec.roles.rollout.memory",
        "must not be negative",
    ),
    InvalidCase("cpu-two-decimal-points", _role("trainer", cpu="1.2.3"), "spec.roles.trainer.cpu"),
    InvalidCase("head-memory-bad-suffix", _spec(head={"memory": "16Gii"}), "spec.head.memory"),
    InvalidCase("memory-as-a-boolean", _role("trainer", memory=True), "spec.roles.trainer.memory"),
    # --- Node selectors: label keys and values.
    InvalidCase(
        "node-selector-key-with-space",
        _role("trainer", nodeSelector={"gpu pool": "a100"}),
        "spec.roles.trainer.nodeSelector",
        "every key must be a label key",
    ),
    InvalidCase(
        "node-selector-key-uppercase-prefix",
        _role("rollout", nodeSelector={"Example.COM/pool": "rollout"}),
        "spec.roles.rollout.nodeSelector",
        "every key must be a label key",
    ),
    InvalidCase(
        "node-selector-key-name-too-long",
        _spec(head={"nodeSelector": {"x" * 64: "cpu"}}),
        "spec.head.nodeSelector",
        "every key must be a label key",
    ),
    InvalidCase(
        "node-selector-value-leading-dash",
        _role("trainer", nodeSelector={"pool": "-gpu"}),
        "spec.roles.trainer.nodeSelector.pool",
    ),
    InvalidCase(
        "node-selector-value-too-long",
        _spec(head={"nodeSelector": {"pool": "c" * 64}}),
        "spec.head.nodeSelector.pool",
    ),
    InvalidCase(
        "node-selector-too-many-labels",
        _role("trainer", nodeSelector={f"label-{i}": "x" for i in range(65)}),
        "spec.roles.trainer.nodeSelector",
    ),
    # --- Tolerations the pod API would refuse.
    InvalidCase(
        "toleration-key-with-space",
        _toleration("trainer", key="nvidia gpu", operator="Exists"),
        "spec.roles.trainer.tolerations[0].key",
    ),
    InvalidCase(
        "toleration-value-not-a-label-value",
        _toleration("trainer", key="pool", value="a100 x8"),
        "spec.roles.trainer.tolerations[0].value",
    ),
    InvalidCase(
        "toleration-equal-without-key",
        _toleration("trainer", operator="Equal", value="gpu"),
        "spec.roles.trainer.tolerations[0].operator",
        "operator must be Exists when key is empty",
    ),
    InvalidCase(
        "toleration-seconds-without-no-execute",
        _toleration("rollout", key="gpu", effect="NoSchedule", tolerationSeconds=30),
        "spec.roles.rollout.tolerations[0].tolerationSeconds",
        "tolerationSeconds needs effect NoExecute",
    ),
    InvalidCase(
        "toleration-operator-unknown",
        _toleration("trainer", key="gpu", operator="In"),
        "spec.roles.trainer.tolerations[0].operator",
    ),
    InvalidCase(
        "head-toleration-exists-with-value",
        _spec(head={"tolerations": [{"key": "cpu", "operator": "Exists", "value": "x"}]}),
        "spec.head.tolerations[0].value",
        "value must be empty when operator is Exists",
    ),
    # --- What the trainer would refuse at start, decided by the spec alone.
    InvalidCase(
        "random-init-without-model-type",
        _spec(model={"policy": None, "randomInit": {"hidden_size": 64}}),
        "spec.model.randomInit.model_type",
        "randomInit needs model_type",
    ),
    InvalidCase(
        "stop-strings-without-tokenizer",
        _spec(model=RANDOM_INIT, algorithm={"stopStrings": ["</answer>"]}),
        "spec.algorithm.stopStrings",
        "algorithm.stopStrings needs a tokenizer",
    ),
    InvalidCase(
        "reward-model-without-tokenizer",
        _spec(
            model={**RANDOM_INIT, "reward": "/models/rm"},
            reward={"type": "model", "function": None},
            roles={"reward": {}},
        ),
        "spec.model.tokenizer",
        "a reward model scores text, which needs a tokenizer",
    ),
    InvalidCase(
        "lengths-beyond-the-context-window",
        _spec(
            model={
                **RANDOM_INIT,
                "randomInit": {"model_type": "qwen2", "max_position_embeddings": 8},
            },
            algorithm={"maxPromptLength": 4, "maxResponseLength": 5},
        ),
        "spec.algorithm.maxResponseLength",
        "algorithm.maxPromptLength + algorithm.maxResponseLength exceed the model's context",
    ),
    InvalidCase(
        "lengths-beyond-gpt2s-n-positions",
        _spec(
            model={**RANDOM_INIT, "randomInit": {"model_type": "gpt2", "n_positions": 8}},
            algorithm={"maxPromptLength": 4, "maxResponseLength": 5},
        ),
        "spec.algorithm.maxResponseLength",
        "context window (model.randomInit.max_position_embeddings or n_positions)",
    ),
    InvalidCase(
        "dataset-synthetic-without-task",
        _spec(dataset={"source": "synthetic:"}),
        "spec.dataset.source",
        "the trainer has no such synthetic task",
    ),
    InvalidCase(
        "dataset-synthetic-task-unknown",
        _spec(dataset={"source": "synthetic:repeat-target"}),
        "spec.dataset.source",
        "the trainer has no such synthetic task: it has copy_first, even_tokens, target_token",
    ),
    # --- Schedule consistency.
    InvalidCase(
        "ppo-micro-batch-above-prompts",
        _spec(
            algorithm={"name": "ppo", "promptsPerStep": 4, "microBatchSize": 8},
            roles={"critic": {}},
        ),
        "spec.algorithm.microBatchSize",
        "microBatchSize must not exceed the sequences of a step",
    ),
    InvalidCase(
        "warmup-as-long-as-the-run",
        _spec(algorithm={"warmupSteps": 10}),
        "spec.algorithm.warmupSteps",
        "warmupSteps must be fewer than the run's optimizer steps",
    ),
    InvalidCase(
        "warmup-beyond-update-epochs",
        _spec(algorithm={"updateEpochs": 2, "warmupSteps": 25}),
        "spec.algorithm.warmupSteps",
        "warmupSteps must be fewer than the run's optimizer steps",
    ),
    InvalidCase(
        "total-steps-beyond-bound",
        _spec(algorithm={"totalSteps": 10_000_000_000}),
        "spec.algorithm.totalSteps",
    ),
    # --- Checkpoint volume and path: the pod API would refuse the mount.
    InvalidCase(
        "checkpoint-path-with-dot-dot",
        _spec(checkpoint={"path": "/mnt/checkpoints/../../etc"}),
        "spec.checkpoint.path",
        "path must not contain . or .. segments nor //",
    ),
    InvalidCase(
        "checkpoint-path-with-empty-segment",
        _spec(checkpoint={"path": "/mnt//checkpoints"}),
        "spec.checkpoint.path",
        "path must not contain . or .. segments nor //",
    ),
    InvalidCase(
        "object-store-prefix-up",
        _spec(checkpoint={"objectStore": {"bucket": "ckpt", "prefix": "team-a/../team-b/"}}),
        "spec.checkpoint.objectStore.prefix",
        "prefix must not contain . or .. segments nor //",
    ),
    InvalidCase(
        "checkpoint-path-root",
        _spec(checkpoint={"path": "/"}),
        "spec.checkpoint.path",
        "path must not be /, where the operator mounts a volume",
    ),
    InvalidCase(
        "checkpoint-path-is-tmp",
        _spec(checkpoint={"path": "/tmp/"}),
        "spec.checkpoint.path",
        "path must not be /, where the operator mounts a volume",
    ),
    InvalidCase(
        "checkpoint-path-in-job-config",
        _spec(checkpoint={"path": "/etc/rlhfjob/checkpoints"}),
        "spec.checkpoint.path",
        "nor inside the read-only /etc/rlhfjob",
    ),
    InvalidCase(
        "checkpoint-volume-named",
        _spec(checkpoint={"volume": {"name": "ckpt", "persistentVolumeClaim": {"claimName": "c"}}}),
        "spec.checkpoint.volume.name",
        "leave out name",
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
    *POD_OVERRIDE_CASES,
    InvalidCase(
        "colocated-with-own-pod",
        _role("rollout", placement="colocated", pod={"labels": {"team": "a"}}),
        "spec.roles.rollout.placement",
        "colocated engines run in the trainer's pods",
    ),
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
]
"""Refused by the models only: a volume source is free-form to the CRD (one of some thirty
kinds), and CEL sees only the properties a schema declares."""
