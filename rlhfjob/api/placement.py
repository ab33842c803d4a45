"""Placement: each role's worker group (replicas, GPUs, node pool, tolerations), the elastic
roles and the rollout's placement, the Ray resource a role advertises, and the head.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import (
    Field,
)

from rlhfjob.api.base import (
    _DNS_SUBDOMAIN,
    _LABEL_NAME,
    MAX_QUALIFIED_NAME_LENGTH,
    Affinity,
    ApiModel,
    LabelValue,
    NodeSelector,
    Quantity,
)
from rlhfjob.api.pods import PodOverrides
from rlhfjob.cel import CelRule, immutable


class Toleration(ApiModel):
    """A Kubernetes toleration, so a role's pods may land on tainted GPU nodes."""

    key: str | None = Field(
        default=None,
        max_length=MAX_QUALIFIED_NAME_LENGTH,
        pattern=f"^(({_DNS_SUBDOMAIN}/)?{_LABEL_NAME})?$",
    )
    """The taint key it tolerates, a label key (empty with Exists: every taint)."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """Equal matches the taint's value; Exists any value."""
    value: LabelValue | None = None
    """The taint value for operator Equal (a label value)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """The taint effect it tolerates (empty: every effect)."""
    toleration_seconds: int | None = None
    """For NoExecute: seconds the pod stays bound after the taint appears (unset: for ever)."""

    cel_rules = (
        CelRule(
            "self.operator != 'Exists' || !has(self.value)",
            "value must be empty when operator is Exists",
            ".value",
        ),
        CelRule(
            "self.operator == 'Exists' || (has(self.key) && self.key.size() > 0)",
            "operator must be Exists when key is empty (that tolerates every taint)",
            ".operator",
        ),
        CelRule(
            "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            "tolerationSeconds needs effect NoExecute",
            ".tolerationSeconds",
        ),
    )


class RoleSpec(ApiModel):
    """One role's worker group: how many replicas, what each asks for, where it may run."""

    replicas: int = Field(default=1, ge=0, le=1024)
    """Ray worker pods for this role."""
    gpus: int = Field(default=0, ge=0, le=64)
    """GPUs per replica (`nvidia.com/gpu`), requested and limited alike."""
    cpu: Quantity = "4"
    """CPU cores per replica, requested and limited alike: a Kubernetes quantity (4, 500m)."""
    memory: Quantity = "16Gi"
    """Memory per replica, requested and limited alike: a Kubernetes quantity of bytes (16Gi,
    512Mi)."""
    node_selector: NodeSelector = Field(default_factory=dict)
    """Labels of the node pool this role runs on."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Tolerations for the pool's taints (GPU pools are usually tainted)."""
    affinity: Affinity | None = None
    """A Kubernetes affinity (nodeAffinity, podAffinity, podAntiAffinity), checked against
    Kubernetes' own schema and passed to the pods."""
    pod: PodOverrides | None = None
    """What this role's pods add to spec.pods: environment, volumes, labels, resources."""

    placement_fields: ClassVar[tuple[str, ...]] = (
        "gpus",
        "cpu",
        "memory",
        "nodeSelector",
        "tolerations",
        "affinity",
        "pod",
    )


class TrainerRoleSpec(RoleSpec):
    """The DeepSpeed ZeRO-3 policy trainer: one rank (Ray actor) per GPU, or per replica on CPU.

    Elastic with `minReplicas`: when trainer pods are lost and not replaced within
    `replacementTimeoutSeconds`, training restarts from the newest checkpoint on the replicas
    left (the job is Degraded), and grows back to `replicas` at a checkpoint once they return.
    The global batch (rows per step) and the data position carry over: each rank takes more
    rows, so a step means the same thing on any number of ranks."""

    min_replicas: int | None = Field(default=None, ge=1)
    """Fewest replicas training may restart with; unset: `replicas` (not elastic, the job
    waits for every trainer pod)."""
    replacement_timeout_seconds: int = Field(default=300, ge=0, le=86400)
    """Seconds lost trainer pods may take to come back before an elastic trainer restarts on
    fewer replicas (0: at once); at most a day (86400)."""

    @property
    def effective_min_replicas(self) -> int:
        """`minReplicas` with its default applied."""
        return self.replicas if self.min_replicas is None else self.min_replicas

    cel_rules = (
        CelRule("self.replicas >= 1", "the trainer needs at least 1 replica", ".replicas"),
        CelRule(
            "!has(self.minReplicas) || self.minReplicas <= self.replicas",
            "minReplicas must not exceed replicas",
            ".minReplicas",
        ),
    )


class ElasticRoleSpec(RoleSpec):
    """A role that may run below its replica count while training goes on (rollout, reward)."""

    min_replicas: int | None = Field(default=None, ge=0)
    """Fewest replicas training may continue with; defaults to `replicas` (not elastic)."""

    @property
    def effective_min_replicas(self) -> int:
        """`minReplicas` with its default applied: the one place that default is spelt out."""
        return self.replicas if self.min_replicas is None else self.min_replicas

    cel_rules = (
        CelRule(
            "!has(self.minReplicas) || self.minReplicas <= self.replicas",
            "minReplicas must not exceed replicas",
            ".minReplicas",
        ),
        *(immutable(field) for field in RoleSpec.placement_fields),
    )


RolloutPlacement = Literal["disaggregated", "colocated"]
COLOCATED: RolloutPlacement = "colocated"


def _unless_colocated(rule: str) -> str:
    return f"self.placement != '{COLOCATED}' || ({rule})"


class RolloutRoleSpec(ElasticRoleSpec):
    """Rollout engines: each replica hosts `gpus / tensorParallelSize` engines (one on CPU).

    Colocated, the engines have no pods of their own: every trainer rank hosts one engine on
    its own GPU (or CPU), and the pod fields of this role stay unset.
    """

    placement: RolloutPlacement = "disaggregated"
    """`disaggregated`: engines on this role's own pods and node pool, weights sent over a
    process group after each update. `colocated`: each trainer rank hosts an engine on its own
    GPU (a hybrid engine); vLLM sleeps during the update, the trainer offloads its optimizer
    state during generation, and weights pass in-process. Colocated engines live and die with
    their rank, so the role is not elastic then."""
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    """GPUs one engine spans (vLLM's tensor parallelism)."""
    backend: Literal["vllm", "hf"] = "vllm"
    """`vllm` on GPUs; `hf` (transformers) for CPU runs and tests."""
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    """Fraction (above 0, at most 1) of each GPU's memory vLLM may claim (colocated: the share
    beside the trainer)."""
    sleep_level: int = Field(default=2, ge=1, le=2)
    """Colocated vLLM only: what the engine releases while the trainer updates. 1 moves its
    weights to host memory and frees the KV cache; 2 frees both (the update's new weights are
    loaded at wake-up anyway)."""

    cel_rules = (
        *ElasticRoleSpec.cel_rules,
        CelRule("self.replicas >= 1", "rollout needs at least 1 replica", ".replicas"),
        CelRule(
            "self.gpus % self.tensorParallelSize == 0",
            "gpus must be a multiple of tensorParallelSize",
            ".gpus",
        ),
        CelRule(
            f"self.backend != 'vllm' || self.placement == '{COLOCATED}' || self.gpus >= 1",
            "the vllm backend needs gpus >= 1 (use backend: hf on CPU)",
            ".backend",
        ),
        CelRule(
            _unless_colocated("!has(self.gpus) || self.gpus == 0"),
            "colocated engines run on the trainer's GPUs: leave roles.rollout.gpus at 0",
            ".gpus",
        ),
        CelRule(
            _unless_colocated(
                "(!has(self.replicas) || self.replicas == 1) && !has(self.minReplicas)"
            ),
            "colocated engines come one per trainer rank: leave replicas and minReplicas unset",
            ".replicas",
        ),
        CelRule(
            _unless_colocated(
                "(!has(self.nodeSelector) || size(self.nodeSelector) == 0)"
                " && (!has(self.tolerations) || size(self.tolerations) == 0)"
                " && !has(self.affinity) && !has(self.pod)"
            ),
            "colocated engines run in the trainer's pods: set nodeSelector, tolerations, "
            "affinity and pod on roles.trainer",
            ".placement",
        ),
        CelRule(
            _unless_colocated("!has(self.tensorParallelSize) || self.tensorParallelSize == 1"),
            "colocated engines span one GPU each for now (tensorParallelSize 1)",
            ".tensorParallelSize",
        ),
        immutable("placement"),
        immutable("tensorParallelSize"),
        immutable("backend"),
    )

    @property
    def colocated(self) -> bool:
        return self.placement == COLOCATED


def ray_resource(role: str) -> str:
    """The Ray custom resource a role's nodes advertise and its actors request (decision 3)."""
    return f"rlhf-role-{role}"


def actor_slots(spec: RoleSpec) -> int:
    """Actors one replica of a role hosts: one per GPU (rollout: one per engine), one on CPU."""
    if isinstance(spec, RolloutRoleSpec):
        return max(1, spec.gpus // spec.tensor_parallel_size)
    return max(1, spec.gpus)


ROLE_NAMES = ("trainer", "rollout", "reference", "reward", "critic")
"""Every role, in the order of their worker groups (manifests must be deterministic)."""


class Roles(ApiModel):
    """The worker groups: trainer and rollout are required, the others optional."""

    trainer: TrainerRoleSpec
    rollout: RolloutRoleSpec
    reference: RoleSpec | None = None
    """Frozen reference model for KL; without it the trainer computes reference log-probs."""
    reward: ElasticRoleSpec | None = None
    """Reward-model servers, for `reward.type: model`."""
    critic: RoleSpec | None = None
    """Value model for PPO."""

    cel_rules = (
        immutable("trainer"),
        immutable("reference"),
        immutable("critic"),
        CelRule(
            f"self.rollout.placement != '{COLOCATED}' || self.rollout.backend != 'vllm'"
            " || self.trainer.gpus >= 1",
            "colocated vllm engines need trainer GPUs (roles.trainer.gpus >= 1)",
            ".rollout.placement",
        ),
        CelRule(
            f"self.rollout.placement != '{COLOCATED}'"
            " || self.trainer.gpus % self.rollout.tensorParallelSize == 0",
            "colocated engines need roles.trainer.gpus to be a multiple of tensorParallelSize",
            ".rollout.tensorParallelSize",
        ),
        CelRule(
            f"self.rollout.placement != '{COLOCATED}' || !has(self.trainer.minReplicas)"
            " || self.trainer.minReplicas == self.trainer.replicas",
            "an elastic trainer (minReplicas below replicas) needs a disaggregated rollout:"
            " colocated engines live in the trainer's ranks",
            ".trainer.minReplicas",
        ),
    )

    def enabled(self) -> dict[str, RoleSpec]:
        """Roles that get a worker group, in a fixed order (manifests must be deterministic).

        A colocated rollout has none: its engines live in the trainer's pods.
        """
        roles: dict[str, RoleSpec | None] = {role: getattr(self, role) for role in ROLE_NAMES}
        if self.rollout.colocated:
            roles["rollout"] = None
        return {name: spec for name, spec in roles.items() if spec is not None}


class HeadSpec(ApiModel):
    """The Ray head: CPU only, it runs the driver and the dashboard."""

    cpu: Quantity = "2"
    """CPU cores of the head pod, requested and limited alike: a Kubernetes quantity."""
    memory: Quantity = "8Gi"
    """Memory of the head pod, requested and limited alike: a Kubernetes quantity of bytes."""
    node_selector: NodeSelector = Field(default_factory=dict)
    """Node labels the head pod must land on."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Taints the head pod tolerates."""
    pod: PodOverrides | None = None
    """What the head pod adds to spec.pods: environment, volumes, labels, resources."""

    cel_rules = (immutable("pod"),)
