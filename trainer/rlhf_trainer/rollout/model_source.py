"""Where an engine's weights come from: a saved model, or a config that the first weight sync
fills; and the sampling facts both engines share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlhf_trainer.modeling.networks import causal_lm, hf_config

if TYPE_CHECKING:
    from rlhfjob.api import ModelSpec

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this decode greedily (vLLM's threshold)."""


@dataclass(frozen=True)
class ModelSource:
    """A model to build: a path (HF format) or a HF config dict with random weights."""

    path: str | None = None
    config: dict[str, Any] | None = None
    """A Hugging Face config as a dict, with ``model_type`` (e.g. ``"qwen2"``)."""
    seed: int = 0
    """Seeds the random initialisation of a `config` model."""
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if (self.path is None) == (self.config is None):
            raise ValueError("set exactly one of path and config")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("a model config needs a 'model_type'")

    @classmethod
    def from_spec(cls, spec: ModelSpec, *, seed: int = 0, on_gpu: bool = False) -> ModelSource:
        """The policy of an RLHFJob's ``spec.model`` (CPU runs use float32 regardless)."""
        dtype = spec.dtype if on_gpu else "float32"
        if spec.random_init is not None:
            return cls(config=dict(spec.random_init), seed=seed, dtype=dtype)
        return cls(path=spec.policy, dtype=dtype)

    def build(self, device: torch.device | str = "cpu") -> Any:
        """A transformers causal LM in eval mode on `device`, built by the trainer's own
        builder (`models.causal_lm`), so its random weights are the trainer's for one seed."""
        model = causal_lm(self.path, self.config, self.seed, getattr(torch, self.dtype))
        return model.to(device).eval()


def causal_lm_config(config: dict[str, Any]) -> Any:
    """`hf_config` with ``architectures`` naming the causal-LM class (e.g. ``Qwen2ForCausalLM``).

    A config built from a dict has no ``architectures``; vLLM then falls back to the *base*
    model class of the ``model_type`` (``Qwen2Model``), which it serves as a pooling
    (embedding) model that cannot generate.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    result = hf_config(config)
    if not getattr(result, "architectures", None):
        result.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[result.model_type]]
    return result
