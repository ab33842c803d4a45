"""What to train and how: the model, the algorithm, the dataset, rewards, checkpoints and the
object store, recovery and liveness, and `RLHFJobSpec`, the spec as a whole.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
)

from rlhfjob.api.algorithm import AlgorithmSpec, cel_in, critic_estimators
from rlhfjob.api.base import (
    CONTEXT_WINDOW_KEYS,
    DNS_SUBDOMAIN_PATTERN,
    HTTP_URL_PATTERN,
    IMAGE_PATTERN,
    REWARD_FUNCTION_PATTERN,
    ApiModel,
    RandomInitConfig,
    VolumeSource,
)
from rlhfjob.api.environment import EnvironmentSpec, environment_rules, lengths_fit_the_window
from rlhfjob.api.placement import ROLE_NAMES, HeadSpec, Roles, RoleSpec
from rlhfjob.api.pods import ObjectName, PodDefaults, PodOverrides, _free_mount_path
from rlhfjob.api.research import EvaluationSpec, ExportSpec, TrackingSpec
from rlhfjob.cel import CelRule, clean_path, immutable

LIGER_MODEL_TYPES = (
    "gemma", "gemma2", "granite", "llama", "mistral", "mixtral", "olmo2", "phi3", "qwen2", "qwen3",
)  # fmt: skip
"""Hugging Face model types whose dense decoder the pinned Liger Kernel patches (RMSNorm,
rotary embeddings and the gated MLP), for `model.kernels: liger`; a unit test holds it to the
library's own table."""

FUSED_LOGPROBS_MODEL_TYPES = (
    "llama", "mistral", "mixtral", "olmo2", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
)  # fmt: skip
"""Hugging Face model types whose causal LM returns its output head's projection unchanged (no
bias, soft-capping or scaling after it), for `model.fusedLogprobs`, which replaces that
projection."""


class ModelSpec(ApiModel):
    """Which weights each role starts from."""

    policy: str | None = Field(default=None, min_length=1)
    """Policy weights: a path in the image or on the checkpoint volume, or a model URI."""
    random_init: RandomInitConfig | None = None
    """A Hugging Face model config; the policy starts from random weights (smoke tests). At most
    64 KiB as JSON (refused by `rlhfjob validate` and the operator)."""
    reference: str | None = Field(default=None, min_length=1)
    """Reference weights; defaults to the policy's initial weights."""
    reward: str | None = Field(default=None, min_length=1)
    """Reward model (sequence classification head), for `reward.type: model`."""
    critic: str | None = Field(default=None, min_length=1)
    """Critic initial weights; defaults to the policy's (with a fresh value head)."""
    tokenizer: str | None = Field(default=None, min_length=1)
    """Tokenizer directory (Hugging Face format); defaults to the policy's directory when that
    holds one. Text and chat prompts, stopping at the end-of-sequence token and text rewards
    need it; a randomInit policy has none unless this is set."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Training and rollout dtype; CPU runs use float32 regardless."""
    kernels: Literal["eager", "liger"] = "eager"
    """The kernels of the trainer's networks (policy, reference, critic). `eager`: Hugging
    Face's own modules. `liger`: Liger Kernel's fused Triton kernels for RMSNorm, rotary
    embeddings and SwiGLU, patched into them (a 1.5B update 1.2x faster on one H200, the
    same log-probs within bf16 rounding; BENCHMARKS.md). Needs trainer GPUs and a model type
    Liger patches (llama, mistral, qwen2, qwen3, gemma, phi3 and a few more; another is refused
    with the list). Rollout engines keep their own kernels."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (the policy and the critic): about a third more update compute for the activation memory
    of one layer, which is what lets a large model's update fit beside its optimizer."""
    fused_logprobs: bool = False
    """Score tokens straight from the last hidden states: the output head's matmul fused with
    the log-softmax and entropy, a chunk of tokens at a time and recomputed in the backward
    pass, so a micro-batch's logits (tokens x vocabulary) and their gradient never exist
    whole. The same log-probs and entropies; gradients equal within bf16 rounding. For a model
    whose output head is a plain bias-free projection (the trainer refuses another at its
    first step, naming this field); the policy's and the reference's log-probs use it."""
    compiled_logprobs: bool = False
    """Compile the per-token math of the log-probs and the entropy (the log-softmax over the
    vocabulary, the entropy and their gradient) with `torch.compile` into one fused kernel per
    direction, instead of several passes over the logits each. On one GPU, a 1.5B update
    11 % faster (BENCHMARKS.md), the same values within float32 rounding; the first step pays
    the compile (seconds). Works with or without `fusedLogprobs`; on CPU trainers it needs a
    C++ compiler in the image."""
    optimizer_offload: Literal["none", "cpu"] = "none"
    """Where the trainer's optimizer lives. `cpu`: the fp32 master weights, AdamW's moments and
    the fp32 gradients in host memory, updated there by DeepSpeed's CPU Adam (ZeRO-Offload),
    16 bytes a parameter; the GPU keeps the bf16 weights and gradients, 4 bytes a parameter.
    What trains a 7B-class model on one H200 (BENCHMARKS.md); size the trainer's `memory`
    for it. Needs trainer GPUs (on the CPU the optimizer is in host memory already)."""

    cel_rules = (
        CelRule(
            "has(self.policy) != has(self.randomInit)",
            "set exactly one of policy and randomInit",
            ".policy",
        ),
        CelRule(
            "!has(self.kernels) || self.kernels != 'liger' || !has(self.randomInit)"
            f" || self.randomInit.model_type in {list(LIGER_MODEL_TYPES)}",
            "kernels liger: Liger Kernel has no kernels for this randomInit.model_type "
            f"(it has {', '.join(LIGER_MODEL_TYPES)})",
            ".kernels",
        ),
        CelRule(
            "!has(self.fusedLogprobs) || !self.fusedLogprobs || !has(self.randomInit)"
            f" || self.randomInit.model_type in {list(FUSED_LOGPROBS_MODEL_TYPES)}",
            "fusedLogprobs: this randomInit.model_type does more than a plain projection after "
            "its last hidden state (fused log-probs serve "
            f"{', '.join(FUSED_LOGPROBS_MODEL_TYPES)})",
            ".fusedLogprobs",
        ),
    )


SYNTHETIC_TASKS = ("copy_first", "even_tokens", "target_token")
"""The synthetic tasks the trainer has (`dataset.source: synthetic:<task>`): the API refuses
another at apply, and `rlhf_trainer.data.tasks` implements exactly these (a unit test holds
both)."""


class DatasetSpec(ApiModel):
    """Where prompts come from."""

    source: str = Field(min_length=1, max_length=4096)
    """A JSON-lines file, a Parquet file (`.parquet`) — a path in the image or on a volume —
    or `synthetic:<task>` (a task the trainer has: copy_first, even_tokens or target_token)."""
    prompt_field: str = Field(default="prompt", min_length=1)
    """The field of each record that holds the prompt: token ids, text, or chat messages (a list
    of {role, content} objects). Text and messages need a tokenizer (model.tokenizer)."""
    shuffle: bool = True
    """Serve the prompts in a new seeded order each epoch (a checkpoint keeps the position)."""
    chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template and its generation prompt.
    Off: a dataset with chat messages is refused at start."""
    overlong_prompts: Literal["truncate", "skip"] = "truncate"
    """A prompt longer than algorithm.maxPromptLength keeps its last maxPromptLength tokens
    (truncate) or is left out of the dataset (skip); both are counted at start."""

    cel_rules = (
        CelRule(
            "!self.source.startsWith('synthetic:')"
            f" || {cel_in('self.source', tuple(f'synthetic:{t}' for t in SYNTHETIC_TASKS))}",
            f"the trainer has no such synthetic task: it has {', '.join(SYNTHETIC_TASKS)}",
            ".source",
        ),
    )


class RemoteRewardSpec(ApiModel):
    """An HTTP reward server the trainer calls, batched, with timeouts and retries."""

    url: str = Field(pattern=HTTP_URL_PATTERN, max_length=2048)
    """The endpoint; requests are POSTed to this URL as is (for example
    `http://rm.team.svc:8000/classify`). The installation must approve it as egress."""
    protocol: Literal["rlhfjob", "classify"] = "rlhfjob"
    """`rlhfjob`: this project's JSON protocol (`{prompts, responses, metadata}` in, `{rewards}`
    out; docs/reward-protocol.md). `classify`: the classification API of vLLM and other
    OpenAI-compatible servers (`{model, input}` in, `{data: [{probs}]}` out) serving a
    sequence-classification reward model; the reward is the raw logit of label 0."""
    model: str | None = Field(default=None, min_length=1, max_length=512)
    """The model name sent with `classify` requests (a server serving one model ignores it)."""
    timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    """Seconds one request may take; at most an hour (3600)."""
    max_retries: int = Field(default=3, ge=0, le=100)
    """Retries of a request that timed out, could not connect or got a 5xx or 429; the step
    fails (retryably) once they are spent. A 4xx other than 429 fails the job at once."""
    backoff_seconds: float = Field(default=1.0, ge=0, le=600)
    """Seconds before the first retry; doubles with each retry. At most 10 minutes (600)."""
    max_concurrency: int = Field(default=4, ge=1, le=256)
    """Requests in flight at once."""
    batch_size: int = Field(default=64, ge=1, le=65536)
    """Samples (prompt and response pairs) per request."""


class RewardSourceSpec(ApiModel):
    """One way to score responses: a rule function, the reward-model role, or a remote server."""

    type: Literal["function", "model", "remote"] = "function"
    """`function`: a rule function; `model`: the reward-model role (roles.reward serving
    model.reward); `remote`: an HTTP reward server."""
    function: str | None = Field(default=None, pattern=REWARD_FUNCTION_PATTERN)
    """A rule reward as `module:function` importable in the trainer image."""
    remote: RemoteRewardSpec | None = None
    """The HTTP reward server, for `type: remote`."""

    cel_rules = (
        CelRule(
            "self.type != 'function' || has(self.__function__)",
            "type function needs function (module:function)",
            ".function",
        ),
        CelRule(
            "self.type != 'model' || !has(self.__function__)",
            "function must be empty when type is model",
            ".function",
        ),
        CelRule(
            "self.type != 'remote' || has(self.remote)",
            "type remote needs remote (url)",
            ".remote",
        ),
        CelRule(
            "self.type == 'remote' || !has(self.remote)",
            "remote must be empty unless type is remote",
            ".remote",
        ),
    )


class RewardComponentSpec(RewardSourceSpec):
    """One weighted part of a combined reward."""

    name: str | None = Field(
        default=None, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63
    )
    """Its label in metrics and the step log; defaults to its type. Labels that two components
    share get each component's position appended."""
    weight: float = Field(default=1.0, ge=-1000, le=1000)
    """Its factor in the sum."""


class RewardSpec(ApiModel):
    """How responses are scored: one source, or (`type: combined`) a weighted sum of several."""

    type: Literal["function", "model", "remote", "combined"] = "function"
    """`function`: a rule function; `model`: the reward-model role (roles.reward serving
    model.reward); `remote`: an HTTP reward server; `combined`: the weighted sum of
    `components`."""
    function: str | None = Field(default=None, pattern=REWARD_FUNCTION_PATTERN)
    """A rule reward as `module:function` importable in the trainer image."""
    remote: RemoteRewardSpec | None = None
    """The HTTP reward server, for `type: remote`."""
    components: list[RewardComponentSpec] = Field(default_factory=list, max_length=16)
    """The parts of a `combined` reward: reward = sum of weight x score."""
    normalize: bool = False
    """Standardise each source's scores over the step's batch (mean 0, std 1) before weighting,
    so weights compare sources of different scales."""
    batch_size: int = Field(default=32, ge=1, le=65536)
    """Samples (prompt and response pairs) per scoring call to a reward-model replica."""

    cel_rules = (
        *RewardSourceSpec.cel_rules[:3],
        CelRule(
            "self.type == 'remote' || !has(self.remote)",
            "remote must be empty unless type is remote",
            ".remote",
        ),
        CelRule(
            "self.type != 'combined' || (has(self.components) && size(self.components) >= 1)",
            "type combined needs components",
            ".components",
        ),
        CelRule(
            "self.type == 'combined' || !has(self.components) || size(self.components) == 0",
            "components must be empty unless type is combined",
            ".components",
        ),
        CelRule(
            "self.type != 'combined' || !has(self.__function__)",
            "function must be empty when type is combined (name it in a component)",
            ".function",
        ),
    )

    def sources(self) -> list[tuple[str, RewardSourceSpec, float]]:
        """``(name, source, weight)`` for each part: the components, or the spec itself."""
        if self.type != "combined":
            single = RewardSourceSpec(type=self.type, function=self.function, remote=self.remote)
            return [(self.type, single, 1.0)]
        labels = [component.name or component.type for component in self.components]
        named: list[tuple[str, RewardSourceSpec, float]] = []
        for index, component in enumerate(self.components):
            label = labels[index]
            if labels.count(label) > 1:  # two of a type (or one name given twice): add the position
                label = f"{label}-{index}"
            named.append((label, component, component.weight))
        return named

    def uses_model(self) -> bool:
        """Whether the reward-model role scores (alone or as a component)."""
        return any(source.type == "model" for _, source, _ in self.sources())


class ObjectStoreSpec(ApiModel):
    """An S3-compatible bucket, the durable tier of the job's checkpoints. Training waits only
    for the save to the checkpoint volume; the driver uploads complete checkpoints in the
    background, the manifest last, so a partial upload is never chosen. A cluster whose volume
    lacks the newest checkpoint (a new one, an empty volume) resumes from the bucket."""

    bucket: str = Field(min_length=3, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
    """The bucket's name; it must exist. Checkpoints go under
    `<prefix><namespace>/<job name>/step-<8 digits>/`."""
    prefix: str = Field(default="", max_length=512, pattern=r"^([^/].*/)?$")
    """Key prefix inside the bucket, ending in `/` (for example `team-a/`); empty: none."""
    endpoint: str | None = Field(default=None, max_length=2048, pattern=HTTP_URL_PATTERN)
    """The S3 API's URL (for example `https://s3.example.com`) for a store other than AWS;
    unset: AWS's for the region (path-style). Either must be approved egress of the installation."""
    region: str | None = Field(default=None, max_length=64, pattern=r"^[a-z0-9-]+$")
    """The bucket's region (for example `us-east-1`); unset: the client's default."""
    credentials_secret: ObjectName | None = None
    """A Secret in the job's namespace with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY,
    given to the head's container only (the kubelet reads it; the operator never does). Unset:
    the pod's ambient credentials (a workload identity, an instance profile)."""
    interval_steps: int | None = Field(default=None, ge=1)
    """Upload every this many steps: a multiple of checkpoint.intervalSteps, so the volume takes
    frequent light saves and the bucket rarer ones. The last step's checkpoint and a drain's are
    always uploaded. Unset: every checkpoint."""
    keep_last: int | None = Field(default=None, ge=1, le=1000)
    """Complete checkpoints the trainer keeps in the bucket; it deletes older ones of this job
    (never anything else; the operator deletes none). Unset: checkpoint.keepLast."""

    cel_rules = (clean_path("prefix"),)


class CheckpointSpec(ApiModel):
    """Where and how often the trainer checkpoints; the operator never deletes checkpoints."""

    path: str = Field(default="/mnt/checkpoints", pattern=r"^/", max_length=4096)
    """Directory checkpoints are written under, mounted in every pod."""
    volume: VolumeSource | None = None
    """A Kubernetes volume source (for example a persistentVolumeClaim) mounted at path."""
    interval_steps: int = Field(default=50, ge=1)
    """Checkpoint every this many training steps (and at the last step and on SIGTERM)."""
    keep_last: int = Field(default=3, ge=1, le=1000)
    """Complete checkpoints the trainer keeps; older ones it removes (the operator never does)."""
    background: bool = False
    """Write checkpoints in the background: a step waits only while each rank copies its state
    to host memory (pinned, on GPUs), and the files are written, hashed and renamed into place
    while training goes on; the next checkpoint, a drain and the run's end wait for them. A
    checkpoint still appears whole or not at all. Costs host memory for one copy of each
    rank's state. Off: each checkpoint is written before training goes on."""
    stop_grace_period_seconds: int = Field(default=600, ge=0, le=86400)
    """Seconds a training driver gets to finish its step and checkpoint it when the job's
    cluster is released while it trains (suspend, preemption, a node drain): the operator asks
    it to stop, waits up to this long for it to exit, then releases the cluster anyway. 0:
    release at once, resuming from the last interval checkpoint. At most 86400 (a day)."""
    object_store: ObjectStoreSpec | None = None
    """An S3-compatible bucket checkpoints are also uploaded to, so they outlive the volume."""

    cel_rules = (
        _free_mount_path("path"),
        clean_path("path"),
        CelRule(
            "!has(self.objectStore) || !has(self.objectStore.intervalSteps)"
            " || self.objectStore.intervalSteps % self.intervalSteps == 0",
            "objectStore.intervalSteps must be a multiple of intervalSteps",
            ".objectStore.intervalSteps",
        ),
    )

    @property
    def upload_interval_steps(self) -> int | None:
        """Steps between uploads to the bucket; None without one."""
        store = self.object_store
        return None if store is None else (store.interval_steps or self.interval_steps)

    @property
    def bucket_keep_last(self) -> int | None:
        """Complete checkpoints kept in the bucket; None without one."""
        store = self.object_store
        return None if store is None else (store.keep_last or self.keep_last)


class RecoverySpec(ApiModel):
    """The recovery ladder's budget and pacing."""

    max_restarts: int = Field(default=3, ge=0, le=1000)
    """Restarts before the job is Failed (RestartsExhausted)."""
    backoff_seconds: int = Field(default=10, ge=0, le=3600)
    """Seconds (at most 3600) before restarting a trainer that failed before it trained a step
    (a start that fails); doubles with each such failure in a row, up to maxBackoffSeconds. A
    trainer that had trained and then failed (a killed driver, a lost node) restarts at once."""
    max_backoff_seconds: int = Field(default=300, ge=0, le=86400)
    """Seconds at which the doubling restart delay stops growing; at most a day (86400)."""
    restart_strategy: Literal["InPlaceFirst", "RecreateCluster"] = "InPlaceFirst"
    """InPlaceFirst climbs the ladder cheapest first; RecreateCluster always starts over."""
    cluster_recovery_timeout_seconds: int = Field(default=600, ge=1, le=86400)
    """Seconds an unhealthy RayCluster (its head not ready, its dashboard silent) may take to
    heal before it is recreated; at most a day (86400)."""

    cel_rules = (
        CelRule(
            "self.backoffSeconds <= self.maxBackoffSeconds",
            "backoffSeconds must not exceed maxBackoffSeconds",
            ".backoffSeconds",
        ),
    )


class LivenessSpec(ApiModel):
    """How the operator tells a hung or stalled trainer from a slow one."""

    heartbeat_interval_seconds: int = Field(default=10, ge=1, le=600)
    """Seconds between the trainer's renewals of its heartbeat Lease (it hears a stop request
    at the next one); at most 10 minutes (600)."""
    heartbeat_timeout_seconds: int = Field(default=60, ge=1, le=3600)
    """Seconds without a heartbeat after which the trainer is hung (TrainerHung); also the
    Lease's duration, and how long a drain waits for the trainer to acknowledge its stop
    request. At most an hour (3600)."""
    progress_timeout_seconds: int = Field(default=1800, ge=1, le=86400)
    """Seconds of heartbeats without a new step after which the trainer is stalled
    (TrainerStalled); at most a day (86400)."""

    cel_rules = (
        CelRule(
            "self.heartbeatTimeoutSeconds > self.heartbeatIntervalSeconds",
            "heartbeatTimeoutSeconds must exceed heartbeatIntervalSeconds",
            ".heartbeatTimeoutSeconds",
        ),
        CelRule(
            "self.progressTimeoutSeconds >= self.heartbeatTimeoutSeconds",
            "progressTimeoutSeconds must be at least heartbeatTimeoutSeconds",
            ".progressTimeoutSeconds",
        ),
    )


_USES_REWARD_MODEL = (
    "(self.reward.type == 'model' || (has(self.reward.components)"
    " && self.reward.components.exists(c, c.type == 'model')))"
)
_FIXED = ("image", "pods", "model", "algorithm", "dataset", "reward", "checkpoint", "environment")
"""The fields a job keeps from its creation."""
_HAS_TOKENIZER = "(!has(self.model.randomInit) || has(self.model.tokenizer))"
"""Whether the job may have a tokenizer: a randomInit policy has one only when it is named (a
policy directory may hold one; only the trainer can look)."""


POD_PLACES = ("head", *(f"roles.{role}" for role in ROLE_NAMES))
"""Where, below spec, a `pod` of overrides may be: the head and each role."""
_MOUNT_LISTS = ("pods.volumeMounts", *(f"{place}.pod.volumeMounts" for place in POD_PLACES))


def _present(path: str) -> str:
    """CEL: every step of `path` below self is set."""
    parts = path.split(".")
    return " && ".join(f"has(self.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))


def _mounts_name_a_volume(place: str) -> CelRule:
    mounts, own = f"{place}.pod.volumeMounts", f"{place}.pod.volumes"
    return CelRule(
        f"!({_present(mounts)}) || self.{mounts}.all(m,"
        f" ({_present('pods.volumes')} && self.pods.volumes.exists(v, v.name == m.name))"
        f" || ({_present(own)} && self.{own}.exists(v, v.name == m.name)))",
        "every volumeMount must name a volume of this pod or of spec.pods",
        f".{mounts}",
    )


def _mounts_avoid_the_checkpoint(mounts: str) -> CelRule:
    return CelRule(
        f"!({_present(mounts)}) || !has(self.checkpoint) || self.{mounts}.all(m,"
        " m.mountPath != self.checkpoint.path && m.mountPath != self.checkpoint.path + '/'"
        " && m.mountPath + '/' != self.checkpoint.path)",
        "no volumeMount may be at checkpoint.path, where the checkpoint volume is mounted",
        f".{mounts}",
    )


class RLHFJobSpec(ApiModel):
    """What to train, where, and how to keep it alive. At most 128 KiB as JSON: a larger spec is
    refused (by `rlhfjob validate` and the operator; the API server cannot measure one)."""

    image: str = Field(min_length=1, max_length=4096, pattern=IMAGE_PATTERN)
    """Container image with the trainer (Ray, DeepSpeed, vLLM):
    `[registry[:port]/]path[:tag][@digest]`, the path lowercase."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Pull policy of the Ray pods' image."""
    entrypoint: str | None = Field(default=None, min_length=1, max_length=4096)
    """Ray job entrypoint instead of `rlhfjob train` (custom drivers, smoke tests). The operator
    appends `--resume-from latest` when it resumes."""
    service_account_name: str | None = Field(
        default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN
    )
    """ServiceAccount of the Ray pods, if the installation allows it (its job policy); it must
    be allowed to renew this job's heartbeat Lease. Unset: the job's own, which the operator
    creates."""
    pods: PodDefaults | None = None
    """What every Ray pod gets, the head's too (a role's or the head's own `pod` adds to it):
    environment, volumes, labels, resources; and the job's priority class, scheduler and image
    pull secrets."""
    model: ModelSpec
    algorithm: AlgorithmSpec
    dataset: DatasetSpec
    reward: RewardSpec
    roles: Roles
    head: HeadSpec = Field(default_factory=HeadSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    liveness: LivenessSpec = Field(default_factory=LivenessSpec)
    evaluation: EvaluationSpec | None = None
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    export: ExportSpec = Field(default_factory=ExportSpec)
    environment: EnvironmentSpec | None = None
    """Agentic RL: multi-turn rollouts with tool calls. Unset: one response per sample."""
    ray_version: str = Field(default="2.60.0", pattern=r"^[0-9]+[.][0-9]+[.][0-9]+$")
    """The Ray version of the image (KubeRay's rayVersion). The driver refuses one of another
    minor release than its own Ray (Failed at once, non-retryable)."""
    suspend: bool = False
    """Stop training and release the cluster; checkpoints stay. Unset to resume."""
    active_deadline_seconds: int | None = Field(default=None, ge=1, le=31536000)
    """Seconds the job may run from its start (status.startTime) before it fails
    (DeadlineExceeded); unset: no deadline. At most a year (31536000)."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, le=31536000)
    """Seconds after it finished (status.completionTime) at which the RLHFJob is deleted, with
    what it owns (checkpoints stay); unset: it stays. At most a year (31536000)."""
    provisioning_timeout_seconds: int = Field(default=600, ge=1, le=604800)
    """Seconds the RayCluster may take to become ready after it was created before the job
    fails (ProvisioningTimeout); at most a week (604800)."""

    cel_rules = (
        CelRule(
            f"!({cel_in('self.algorithm.name', critic_estimators())}) || has(self.roles.critic)",
            f"{' and '.join(critic_estimators())} needs roles.critic",
            ".roles",
        ),
        CelRule(
            f"!{_USES_REWARD_MODEL} || (has(self.roles.reward) && has(self.model.reward))",
            "reward.type model needs roles.reward and model.reward",
            ".reward",
        ),
        CelRule(
            f"!{_USES_REWARD_MODEL} || {_HAS_TOKENIZER}",
            "a reward model scores text, which needs a tokenizer: a randomInit policy has none, "
            "set model.tokenizer",
            ".model.tokenizer",
        ),
        CelRule(
            "!has(self.model.kernels) || self.model.kernels != 'liger'"
            " || (has(self.roles.trainer.gpus) && self.roles.trainer.gpus >= 1)",
            "model.kernels liger runs Triton kernels on GPUs: it needs roles.trainer.gpus >= 1",
            ".model.kernels",
        ),
        CelRule(
            "!has(self.model.optimizerOffload) || self.model.optimizerOffload != 'cpu'"
            " || (has(self.roles.trainer.gpus) && self.roles.trainer.gpus >= 1)",
            "model.optimizerOffload cpu moves the optimizer from the trainer's GPUs to host "
            "memory: it needs roles.trainer.gpus >= 1",
            ".model.optimizerOffload",
        ),
        CelRule(
            "self.algorithm.maxStaleness == 0 || !has(self.roles.rollout.placement)"
            " || self.roles.rollout.placement != 'colocated'",
            "algorithm.maxStaleness generates while the ranks update: colocated engines share "
            "the ranks' devices and cannot (set roles.rollout.placement disaggregated)",
            ".algorithm.maxStaleness",
        ),
        CelRule(
            lengths_fit_the_window("self.algorithm.maxResponseLength"),
            "algorithm.maxPromptLength + algorithm.maxResponseLength exceed the model's context "
            f"window (model.randomInit.{' or '.join(CONTEXT_WINDOW_KEYS)})",
            ".algorithm.maxResponseLength",
        ),
        CelRule(
            "!has(self.algorithm.stopStrings) || size(self.algorithm.stopStrings) == 0"
            f" || {_HAS_TOKENIZER}",
            "algorithm.stopStrings needs a tokenizer: a randomInit policy has none, "
            "set model.tokenizer",
            ".algorithm.stopStrings",
        ),
        *environment_rules(_HAS_TOKENIZER),
        *(immutable(field) for field in _FIXED),
        *(_mounts_name_a_volume(place) for place in POD_PLACES),
        *(_mounts_avoid_the_checkpoint(mounts) for mounts in _MOUNT_LISTS),
    )

    def pod_places(self) -> dict[str, PodOverrides]:
        """The pod overrides the job sets, by field path (`spec.pods`, `spec.head.pod`,
        `spec.roles.trainer.pod`, ...): what the job policy checks."""
        places: dict[str, PodOverrides | None] = {"spec.pods": self.pods}
        for place in POD_PLACES:
            owner: Any = self
            for part in place.split("."):
                owner = getattr(owner, part) if owner is not None else None
            places[f"spec.{place}.pod"] = owner.pod if owner is not None else None
        return {path: pod for path, pod in places.items() if pod is not None}

    def pod_overrides(self, group: str) -> PodOverrides:
        """What the pods of `group` (``head`` or a role) get: their own over spec.pods."""
        owner: HeadSpec | RoleSpec | None = (
            self.head if group == "head" else getattr(self.roles, group)
        )
        assert owner is not None, f"no {group} in the job"
        return (self.pods or PodOverrides()).overlaid(owner.pod)
