"""Building the policy, reference and critic networks from `spec.model`.

Every role starts from the same recipe: a Hugging Face causal LM loaded from `spec.model.policy`
(a local path) or built from the config dict `spec.model.randomInit` with weights drawn from a
seeded generator, so every trainer rank, the reference and the critic start from identical
weights. The critic is the policy's transformer backbone with a fresh scalar value head.
`causal_lm` is the one builder: the HF rollout engine (`engines.ModelSource.build`) uses it too,
so an engine built from the same seed holds the trainer's initial weights.

Given a ZeRO-3 DeepSpeed config (`zero`), a saved checkpoint is loaded partitioned from the start
(`zero.partitioned_loading`): no rank holds the whole model. Random weights are always drawn
whole, on the CPU, in float32, because their values must depend on the seed alone, not on how
many ranks share the model; they are for tests and benchmarks, where models are small.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import Tensor, nn

from rlhf_trainer.modeling import logprobs as lp
from rlhf_trainer.modeling.zero import partitioned_loading
from rlhfjob.api import CONTEXT_WINDOW_KEYS, FUSED_LOGPROBS_MODEL_TYPES, ModelSpec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def training_dtype(spec: ModelSpec, on_gpu: bool) -> torch.dtype:
    """The dtype weights and activations use: `spec.dtype` on GPUs, float32 on the CPU."""
    return DTYPES[spec.dtype] if on_gpu else torch.float32


def hf_config(config: dict[str, Any]) -> Any:
    """A transformers config object from a plain dict with ``model_type`` (`randomInit`)."""
    from transformers import AutoConfig

    fields = dict(config)
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise ValueError("spec.model.randomInit needs model_type (for example qwen2)")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as error:  # a model type this transformers does not know
        raise ValueError(f"spec.model.randomInit.model_type: {error}") from error


def model_config(spec: ModelSpec) -> Any:
    """The Hugging Face config of the policy (from `randomInit` or the policy's directory)."""
    from transformers import AutoConfig

    if spec.random_init is not None:
        return hf_config(spec.random_init)
    assert spec.policy is not None  # the API requires exactly one of policy and randomInit
    return AutoConfig.from_pretrained(spec.policy)


def check_context_window(
    config: Any,
    prompt_tokens: int,
    response_tokens: int,
    response_field: str = "algorithm.maxResponseLength",
) -> None:
    """ValueError when a prompt and its response can exceed the policy's context window:
    generation would fail (vLLM refuses the request) or run past the positions the model has.
    The API refuses it at apply where the window is in `randomInit`; this is the check for a
    saved model's `config.json` and for a model type's default window."""
    window = next(
        (
            value
            for key in CONTEXT_WINDOW_KEYS
            if isinstance(value := getattr(config, key, None), int)
        ),
        None,
    )
    if window is not None and prompt_tokens + response_tokens > window:
        raise ValueError(
            f"spec.{response_field}: algorithm.maxPromptLength + "
            f"{response_field} ({prompt_tokens} + {response_tokens}) exceed the "
            f"policy's context window of {window} tokens (its config's "
            f"{' or '.join(CONTEXT_WINDOW_KEYS)})"
        )


def pretrained(
    loader: Any, path: str, dtype: torch.dtype, zero: dict[str, Any] | None = None
) -> nn.Module:
    """``loader.from_pretrained(path)`` in `dtype`, partitioned under a ZeRO-3 `zero` config."""
    with partitioned_loading(zero) if zero is not None else contextlib.nullcontext():
        return cast(nn.Module, loader.from_pretrained(path, dtype=dtype))


def causal_lm(
    path: str | None,
    config: dict[str, Any] | None,
    seed: int,
    dtype: torch.dtype = torch.float32,
    zero: dict[str, Any] | None = None,
) -> nn.Module:
    """A causal LM: pretrained weights from `path`, or random ones from the HF `config` dict.

    Random weights are drawn in float32 under `seed` (the caller's RNG left as it was) and only
    then cast to `dtype`, so every build of one seed, whatever its dtype, starts from the same
    values: the trainer's ranks, its reference and critic, and the HF rollout engines.
    """
    from transformers import AutoModelForCausalLM

    if config is None:
        assert path is not None
        return pretrained(AutoModelForCausalLM, path, dtype, zero)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config(config))
    return model.to(dtype)


class KernelsError(ValueError):
    """`spec.model.kernels` cannot serve this model (a type the library has no kernels for,
    or the library missing from the image)."""


def liger_patch() -> Any:
    """Liger Kernel's instance patcher (what Hugging Face's Trainer calls for `use_liger_kernel`):
    it picks the model type's patch and passes it only the switches that patch takes."""
    try:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
    except ImportError as error:
        raise KernelsError(
            f"spec.model.kernels: liger needs the liger-kernel package in the image ({error})"
        ) from error
    return _apply_liger_kernel_to_instance


def check_kernels(kernels: str, model_type: str) -> None:
    """KernelsError unless `kernels` can patch a model of `model_type` (the driver's check at
    start, before any rank builds a network)."""
    if kernels == "eager":
        return
    liger_patch()
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise KernelsError(
            f"spec.model.kernels: Liger Kernel has no kernels for model type {model_type!r}"
        )


def check_fused_logprobs(enabled: bool, model_type: str) -> None:
    """KernelsError unless `spec.model.fusedLogprobs` can serve a model of `model_type` (one
    whose causal LM returns its output projection unchanged)."""
    if enabled and model_type not in FUSED_LOGPROBS_MODEL_TYPES:
        raise KernelsError(
            f"spec.model.fusedLogprobs: a {model_type!r} model does more than a plain projection "
            f"after its last hidden state (fused log-probs serve "
            f"{', '.join(FUSED_LOGPROBS_MODEL_TYPES)})"
        )


@contextlib.contextmanager
def scoring_head(
    model: nn.Module, input_ids: Tensor, temperature: float, compiled: bool = False
) -> Iterator[None]:
    """Inside, `model`'s output head returns, instead of the logits, the log-prob of each
    next token of `input_ids` and the entropy at each position, stacked ``[2, B, L - 1]``
    (`algorithms.linear_next_token_logprobs_and_entropy`), which the model's forward passes
    on as its ``logits``.

    The head's forward is swapped rather than called apart from the model, so that the
    model runs as always (DeepSpeed's engine forward, ZeRO-3 gathering the head's weight
    for the forward and again for the backward pass)."""
    head = cast(Any, model).get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise KernelsError(
            f"spec.model.fusedLogprobs: the output head is {type(head).__name__} with a bias "
            "or not a projection; fused log-probs need a bias-free linear head"
        )

    def scores(hidden: Tensor) -> Tensor:
        logprobs, entropy = lp.linear_next_token_logprobs_and_entropy(
            hidden, head.weight, input_ids, temperature, compiled=compiled
        )
        return torch.stack((logprobs, entropy))

    head.forward = scores
    try:
        yield
    finally:
        del head.forward  # the class's again


def with_kernels(model: nn.Module, kernels: str) -> nn.Module:
    """`model` with `spec.model.kernels` patched in: for `liger`, Liger's RMSNorm, rotary and
    gated-MLP kernels replace the modules' forwards in place (their weights stay, so ZeRO-3's
    partitioning and hooks are untouched). The logits path is not patched: the loss needs the
    entropy and the temperature, which Liger's fused linear cross entropy does not give."""
    if kernels == "eager":
        return model
    config = getattr(model, "config", None)
    check_kernels(kernels, getattr(config, "model_type", "") or "")
    liger_patch()(
        model=model,
        rope=True,
        rms_norm=True,
        swiglu=True,
        geglu=True,  # the Gemma family's gated MLP
        cross_entropy=False,
        fused_linear_cross_entropy=False,
    )
    return model


def with_activation_checkpointing(model: nn.Module, enabled: bool) -> nn.Module:
    """`model` recomputing each decoder layer's activations in its backward pass when
    `enabled` (`spec.model.activationCheckpointing`; a trained network, the policy or the
    critic). Non-reentrant checkpointing: it needs no input that requires a gradient, and
    it leaves ZeRO-3's parameter hooks working in the recomputation."""
    if enabled:
        target = model.backbone if isinstance(model, CriticModel) else model
        cast(Any, target).gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    return model


def build_causal_lm(
    spec: ModelSpec,
    seed: int,
    dtype: torch.dtype = torch.float32,
    zero: dict[str, Any] | None = None,
) -> nn.Module:
    """The policy network: pretrained weights, or random ones that depend only on `seed`; with
    the spec's kernels."""
    return with_kernels(causal_lm(spec.policy, spec.random_init, seed, dtype, zero), spec.kernels)


def build_reference(
    spec: ModelSpec,
    seed: int,
    dtype: torch.dtype = torch.float32,
    zero: dict[str, Any] | None = None,
) -> nn.Module:
    """The frozen reference: `spec.model.reference`, else the policy's initial weights."""
    from transformers import AutoModelForCausalLM

    model: nn.Module
    if spec.reference is not None:
        model = with_kernels(
            pretrained(AutoModelForCausalLM, spec.reference, dtype, zero), spec.kernels
        )
    else:
        model = build_causal_lm(spec, seed, dtype, zero)
    model.requires_grad_(False)
    return model


class CriticModel(nn.Module):
    """A causal LM backbone with a linear value head: one value estimate per token position.

    The head starts at zero, so the first values are 0 and early GAE advantages equal the
    returns rather than noise from a random head.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask)
        return self.value_head(hidden.last_hidden_state).squeeze(-1).float()


def build_critic(
    spec: ModelSpec,
    seed: int,
    dtype: torch.dtype = torch.float32,
    zero: dict[str, Any] | None = None,
) -> CriticModel:
    """The critic: the policy's backbone (or `spec.model.critic`'s) plus a fresh value head
    (built whole; DeepSpeed partitions it with the rest)."""
    from transformers import AutoModel

    source = spec.critic or spec.policy
    backbone: Any
    if source is not None:
        backbone = with_kernels(pretrained(AutoModel, source, dtype, zero), spec.kernels)
    else:
        # The same seed as the policy, so the backbone starts from the policy's random weights.
        causal_lm = build_causal_lm(spec, seed, dtype)
        backbone = cast(Any, causal_lm).get_decoder()
    hidden_size = backbone.config.hidden_size
    return CriticModel(backbone, hidden_size).to(dtype)
