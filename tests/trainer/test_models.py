"""The trainer and the rollout engines build the policy with one builder (`models.causal_lm`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from transformers import AutoModelForCausalLM  # noqa: E402

from rlhf_trainer.modeling.networks import build_causal_lm, build_critic, build_reference  # noqa: E402
from rlhf_trainer.rollout.engines import HFEngine  # noqa: E402
from rlhf_trainer.rollout.model_source import ModelSource  # noqa: E402
from rlhfjob.config import load_job  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-tiny-cpu.yaml"


def test_the_engine_and_the_trainer_initialise_the_same_weights_for_one_seed() -> None:
    spec = load_job(EXAMPLE).spec
    seed = spec.algorithm.seed
    trainer = dict(build_causal_lm(spec.model, seed).named_parameters())
    engine = dict(HFEngine(ModelSource.from_spec(spec.model, seed=seed)).model.named_parameters())
    assert trainer.keys() == engine.keys()
    assert all(torch.equal(trainer[name], engine[name]) for name in trainer)
    other = dict(build_causal_lm(spec.model, seed + 1).named_parameters())
    assert not all(torch.equal(trainer[name], other[name]) for name in trainer)


def test_the_reference_and_the_critic_start_from_the_policy_weights() -> None:
    spec = load_job(EXAMPLE).spec
    seed = spec.algorithm.seed
    policy = build_causal_lm(spec.model, seed)
    reference = dict(build_reference(spec.model, seed).named_parameters())
    assert all(torch.equal(p, reference[name]) for name, p in policy.named_parameters())
    backbone = dict(build_critic(spec.model, seed).backbone.named_parameters())
    decoder = dict(policy.get_decoder().named_parameters())
    assert decoder.keys() == backbone.keys()
    assert all(torch.equal(decoder[name], backbone[name]) for name in decoder)


def test_random_init_is_drawn_in_float32_then_cast() -> None:
    spec = load_job(EXAMPLE).spec
    full = dict(build_causal_lm(spec.model, 3).named_parameters())
    half = dict(build_causal_lm(spec.model, 3, torch.bfloat16).named_parameters())
    assert all(half[name].dtype == torch.bfloat16 for name in half)
    assert all(torch.equal(full[name].to(torch.bfloat16), half[name]) for name in full)


def test_activation_checkpointing_recomputes_each_layer_and_keeps_the_gradients() -> None:
    """`model.activationCheckpointing`: each decoder layer runs again in the backward pass,
    and the gradients are those of the plain model."""
    from rlhf_trainer.modeling.networks import with_activation_checkpointing

    spec = load_job(EXAMPLE).spec
    input_ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))

    def layer_calls_and_gradients(enabled: bool) -> tuple[int, dict[str, Any]]:
        model = with_activation_checkpointing(build_causal_lm(spec.model, 3), enabled)
        model.train()
        calls = 0

        def count(*_: Any) -> None:
            nonlocal calls
            calls += 1

        model.get_decoder().layers[0].self_attn.register_forward_pre_hook(count)
        model(input_ids=input_ids).logits.float().pow(2).mean().backward()
        return calls, {name: p.grad for name, p in model.named_parameters()}

    plain_calls, plain = layer_calls_and_gradients(False)
    calls, checkpointed = layer_calls_and_gradients(True)
    assert (plain_calls, calls) == (1, 2)
    assert all(torch.allclose(plain[n], checkpointed[n], atol=1e-6) for n in plain)
    critic = with_activation_checkpointing(build_critic(spec.model, 3), True)
    assert critic.backbone.is_gradient_checkpointing


def test_fused_logprobs_score_the_models_own_logits_and_hand_back_its_head() -> None:
    """`model.fusedLogprobs` through the whole model (tied embeddings, padding): the same
    log-probs, entropies and gradients as its logits scored; the head is the class's again."""
    from rlhf_trainer.algo.batch import build_batch
    from rlhf_trainer.ranks.actors import next_token_scores

    spec = load_job(EXAMPLE).spec
    model = build_causal_lm(spec.model, 3).double()
    batch = build_batch([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10, 11]])
    rows, length = batch.input_ids.shape
    weights = torch.randn(2, rows, length - 1, generator=torch.Generator().manual_seed(0))

    def scores_and_gradients(fused: bool) -> list[torch.Tensor]:
        model.zero_grad()
        model_spec = spec.model.model_copy(update={"fused_logprobs": fused})
        logprobs, entropy = next_token_scores(model, batch, 0.9, model_spec)
        loss = (logprobs * weights[0]).sum() + (entropy * weights[1]).sum()
        loss.backward()
        return [logprobs, entropy] + [p.grad.clone() for p in model.parameters()]

    plain, fused = scores_and_gradients(False), scores_and_gradients(True)
    for mine, theirs in zip(fused, plain, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-12)
    assert "forward" not in vars(model.get_output_embeddings())  # the swap is undone


def test_fused_logprobs_refuse_a_head_with_a_bias_and_a_model_type_that_reshapes_logits() -> None:
    from rlhf_trainer.algo.batch import build_batch
    from rlhf_trainer.modeling.networks import KernelsError, check_fused_logprobs
    from rlhf_trainer.ranks.actors import next_token_scores

    check_fused_logprobs(True, "qwen2")
    check_fused_logprobs(False, "gemma2")
    with pytest.raises(KernelsError, match=r"spec.model.fusedLogprobs: a 'gemma2' model"):
        check_fused_logprobs(True, "gemma2")
    spec = load_job(EXAMPLE).spec
    model = build_causal_lm(spec.model, 3)
    head = model.get_output_embeddings()
    model.set_output_embeddings(torch.nn.Linear(head.in_features, head.out_features))
    with pytest.raises(KernelsError, match="bias-free linear head"):
        fused = spec.model.model_copy(update={"fused_logprobs": True})
        next_token_scores(model, build_batch([[1, 2]], [[3]]), 1.0, fused)


def _partitioned_loading_process(directory: str, results: Any) -> None:
    """A one-rank gloo group: load `directory` under ZeRO-3 and under ZeRO-2, report what came."""
    import deepspeed

    from rlhf_trainer.modeling.zero import deepspeed_config, skip_unused_deepspeed_builds

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    skip_unused_deepspeed_builds(on_gpu=False)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    spec = load_job(EXAMPLE).spec
    saved = dict(AutoModelForCausalLM.from_pretrained(directory).named_parameters())
    pretrained_spec = spec.model.model_copy(update={"random_init": None, "policy": directory})

    def config(stage: int) -> dict[str, Any]:
        return deepspeed_config(
            spec.algorithm, accumulation_steps=1, bf16=False, on_gpu=False, stage=stage
        )

    model = build_causal_lm(pretrained_spec, 0, zero=config(3))
    partitioned = all(
        hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters()
    )  # built partitioned: nothing whole, even before deepspeed.initialize
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        gathered = {name: p.detach().clone() for name, p in model.named_parameters()}
    ordinary_after = not any(
        hasattr(p, "ds_id") for p in build_causal_lm(pretrained_spec, 0).parameters()
    )
    below_zero3 = not any(
        hasattr(p, "ds_id")
        for p in build_causal_lm(pretrained_spec, 0, zero=config(2)).parameters()
    )
    random = build_causal_lm(spec.model, 0, zero=config(3))  # random weights: always whole
    results.put(
        {
            "partitioned": partitioned,
            "equal": gathered.keys() == saved.keys()
            and all(torch.equal(gathered[n], saved[n]) for n in saved),
            "ordinary_after": ordinary_after,
            "below_zero3": below_zero3,
            "random_whole": not any(hasattr(p, "ds_id") for p in random.parameters()),
        }
    )


def _init_distributed_process(extensions: str, results: Any) -> None:
    """A one-rank gloo group joined the way the trainer ranks join theirs, and a ZeRO-3 engine
    with their optimizer; reports whether DeepSpeed built or loaded its CPU shared-memory op (a
    JIT build of minutes on a cold machine) into the torch extensions directory `extensions`,
    and whether Muon's `torch.compile` set-up (inductor) was imported."""
    import sys

    os.environ["TORCH_EXTENSIONS_DIR"] = extensions
    from rlhf_trainer.modeling.zero import (
        deepspeed_config,
        import_deepspeed,
        skip_unused_deepspeed_builds,
    )

    deepspeed = import_deepspeed()
    import deepspeed.comm.comm as ds_comm

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    skip_unused_deepspeed_builds(on_gpu=False)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    group = torch.ones(2)
    torch.distributed.all_reduce(group)
    model = torch.nn.Linear(4, 2)
    config = deepspeed_config(
        load_job(EXAMPLE).spec.algorithm, accumulation_steps=1, bf16=False, on_gpu=False
    )
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config
    )
    engine.backward(engine(torch.ones(3, 4)).sum())
    engine.step()
    results.put(
        {
            "shm_op": ds_comm.cdb.shm_comm_op is not None,
            "built": sorted(str(p.relative_to(extensions)) for p in Path(extensions).rglob("*")),
            "all_reduce": group.tolist(),
            "inductor": "torch._inductor.compile_fx" in sys.modules,
            "mlflow": "mlflow" in sys.modules,
        }
    )


def _in_a_process(target: Any, *args: Any, timeout_s: float = 300) -> Any:
    """Run ``target(*args, queue)`` in a fresh process (its own process group) and return
    what it puts on the queue; fail at once if the process dies without answering."""
    context = mp.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=target, args=(*args, results))
    process.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                return results.get(timeout=1)
            except queue.Empty:
                assert process.is_alive(), f"the process died (exit code {process.exitcode})"
                assert time.monotonic() < deadline, "the process did not answer in time"
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()


@pytest.mark.slow
def test_a_saved_checkpoint_loads_partitioned_under_zero3(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    spec = load_job(EXAMPLE).spec
    build_causal_lm(spec.model, 11).save_pretrained(tmp_path / "policy")
    outcome = _in_a_process(_partitioned_loading_process, str(tmp_path / "policy"))
    assert outcome == {
        "partitioned": True,
        "equal": True,
        "ordinary_after": True,
        "below_zero3": True,
        "random_whole": True,
    }


@pytest.mark.slow
def test_a_rank_builds_no_unused_deepspeed_extension_nor_muon_kernels(tmp_path: Path) -> None:
    """DeepSpeed's CPU shared-memory allreduce is never used by the ranks (gloo is), so its JIT
    build (80 s to minutes on two busy cores) must not run when a rank joins its group; nor is
    Muon's torch.compile set-up imported for an optimizer that is AdamW, nor MLflow, which
    DeepSpeed imports for its autotuner."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("mlflow")  # installed: what DeepSpeed would import
    outcome = _in_a_process(_init_distributed_process, str(tmp_path / "extensions"))
    assert outcome == {
        "shm_op": False,
        "built": [],
        "all_reduce": [1.0, 1.0],
        "inductor": False,
        "mlflow": False,
    }
