"""Invalid roles and their placement: which roles an algorithm needs, their sizes, colocated
engines, resources, affinities, node selectors and tolerations. Part of
`rlhfjob.invalid_cases.INVALID_CASES`."""

from __future__ import annotations

from rlhfjob.invalid_case import InvalidCase
from rlhfjob.invalid_case import role_patch as _role
from rlhfjob.invalid_case import spec_patch as _spec
from rlhfjob.invalid_case import toleration_patch as _toleration

ROLE_CASES: list[InvalidCase] = [
    # --- The roles an algorithm needs, and their sizes.
    InvalidCase(
        "ppo-without-critic",
        _spec(algorithm={"name": "ppo"}),
        "spec.roles",
        "ppo needs roles.critic",
    ),
    InvalidCase("roles-missing", _spec(roles=None), "spec.roles"),
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
        "trainer-replacement-timeout-too-long",
        _role("trainer", replicas=2, minReplicas=1, replacementTimeoutSeconds=86401),
        "spec.roles.trainer.replacementTimeoutSeconds",
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
        "sleep-level-three",
        _role("rollout", sleepLevel=3),
        "spec.roles.rollout.sleepLevel",
    ),
    # --- Colocated rollout engines: on the trainer's ranks, in its pods.
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
        "colocated-with-own-pod",
        _role("rollout", placement="colocated", pod={"labels": {"team": "a"}}),
        "spec.roles.rollout.placement",
        "colocated engines run in the trainer's pods",
    ),
    InvalidCase(
        "placement-unknown",
        _role("rollout", placement="shared"),
        "spec.roles.rollout.placement",
    ),
    # --- Resource quantities the kubelet would refuse.
    InvalidCase("cpu-not-a-quantity", _role("trainer", cpu="lots"), "spec.roles.trainer.cpu"),
    InvalidCase(
        "memory-not-a-quantity", _role("rollout", memory="12 GB"), "spec.roles.rollout.memory"
    ),
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
    # --- Affinity, in the Kubernetes schema the API carries.
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
]
