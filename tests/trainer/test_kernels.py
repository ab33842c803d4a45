"""`spec.model.kernels`: Liger Kernel's RMSNorm, rotary and SwiGLU patched into the trainer's
networks, and refused for a model type Liger has no kernels for.

The kernels are Triton's and run only on GPUs: here the test checks that every module of the
policy, the reference and the critic is patched, and nothing else; that the patched forwards
give the eager log-probs and gradients is checked on the GPU (`benchmarks/gpu/kernels_check.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("liger_kernel")

from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402

from rlhf_trainer.modeling.networks import (  # noqa: E402
    KernelsError,
    build_causal_lm,
    build_critic,
    build_reference,
    check_kernels,
)
from rlhf_trainer.run.startup import NonRetryableError, check_model_config  # noqa: E402
from rlhfjob.api import LIGER_MODEL_TYPES  # noqa: E402
from rlhfjob.config import load_job  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-tiny-cpu.yaml"


@pytest.fixture(autouse=True)
def restore_qwen2_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Liger patches the module too (its classes and rotary function): undone after each test,
    so no later test of this process builds a Triton-only model on the CPU."""
    for name in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP"):
        monkeypatch.setattr(modeling_qwen2, name, getattr(modeling_qwen2, name))
    monkeypatch.setattr(
        modeling_qwen2.Qwen2ForCausalLM, "forward", modeling_qwen2.Qwen2ForCausalLM.forward
    )


def kernel_sources(model: Any) -> set[str]:
    """The module each RMSNorm's and each MLP's forward comes from."""
    sources = set()
    for module in model.modules():
        if type(module).__name__.endswith(("RMSNorm", "MLP")):
            sources.add(getattr(module.forward, "__func__", module.forward).__module__)
    return sources


def spec_with(kernels: str, **model: Any) -> Any:
    spec = load_job(EXAMPLE).spec
    return spec.model.model_copy(update={"kernels": kernels, **model})


def test_the_api_lists_only_model_types_the_pinned_liger_patches() -> None:
    assert set(LIGER_MODEL_TYPES) <= set(MODEL_TYPE_TO_APPLY_LIGER_FN)


def test_eager_leaves_hugging_faces_modules() -> None:
    model = build_causal_lm(spec_with("eager"), seed=1)
    assert kernel_sources(model) == {modeling_qwen2.__name__}
    assert modeling_qwen2.apply_rotary_pos_emb.__module__ == modeling_qwen2.__name__


def test_liger_patches_every_norm_and_mlp_of_policy_reference_and_critic(tmp_path: Path) -> None:
    eager = build_causal_lm(spec_with("eager"), seed=1)
    liger = spec_with("liger")
    networks = {
        "policy": build_causal_lm(liger, seed=1),
        "reference": build_reference(liger, seed=1),
        "critic": build_critic(liger, seed=1).backbone,
    }
    for role, model in networks.items():
        sources = kernel_sources(model)
        assert sources and all(s.startswith("liger_kernel.") for s in sources), (role, sources)
    assert modeling_qwen2.apply_rotary_pos_emb.__module__.startswith("liger_kernel.")
    # The same weights: the patch swaps forwards, never parameters.
    patched = dict(networks["policy"].named_parameters())
    assert all(torch.equal(p, patched[name]) for name, p in eager.named_parameters())

    # Saved weights too (a reference and a critic of their own directories).
    eager.save_pretrained(tmp_path / "saved")
    saved = spec_with("liger", reference=str(tmp_path / "saved"), critic=str(tmp_path / "saved"))
    for model in (build_reference(saved, seed=1), build_critic(saved, seed=1).backbone):
        assert all(s.startswith("liger_kernel.") for s in kernel_sources(model))


def test_a_model_type_liger_lacks_is_refused_at_start_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(KernelsError, match=r"spec\.model\.kernels.*'gpt2'"):
        check_kernels("liger", "gpt2")
    check_kernels("eager", "gpt2")  # eager takes any model
    # The driver's check at start: a saved directory's type (the API server cannot see it).
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16)).save_pretrained(
        tmp_path / "gpt2"
    )
    spec = load_job(EXAMPLE).spec
    model = spec.model.model_copy(
        update={"kernels": "liger", "policy": str(tmp_path / "gpt2"), "random_init": None}
    )
    with pytest.raises(NonRetryableError, match=r"spec\.model\.kernels"):
        check_model_config(spec.model_copy(update={"model": model}))
