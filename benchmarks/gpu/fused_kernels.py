"""Fused kernels for the policy update on one GPU: Liger Kernel's against the eager modules.

    python benchmarks/gpu/fused_kernels.py --out DIR     # DIR/gpu-fused-kernels.json

What issue 25 asks before the trainer takes a kernel library: on the Qwen2 1.5B shape, how
much of a policy update do Liger Kernel's RMSNorm, RoPE and SwiGLU save, and its fused linear
+ cross entropy (log-probs straight from the last hidden state, no ``[B, L, V]`` logits), and do
they give the same log-probs and gradients? Every variant is the plain PyTorch step of
``colocated.py update`` (fp32 master weights, bf16 autocast, fused AdamW, gradient clipping) on
the same weights and batch:

* ``eager``: Hugging Face's modules; log-probs (and the entropy) by the trainer's own fused pass,
  `algorithms.next_token_logprobs_and_entropy`;
* ``liger``: Liger's RMSNorm, RoPE and SwiGLU patched into the model; the same loss;
* ``liger-flce``: and the log-probs from Liger's fused linear cross entropy (``reduction="none"``:
  minus the log-prob of each next token) on the last hidden state. It computes no entropy,
  which the trainer logs each step: a lower bound on what that path would cost.

Each is timed (median of `--steps` after `--warmup`) beside a bf16 matmul of the same run (MFU),
and compared on one micro-batch from the same initial weights with ``eager`` and with the eager
model in float32 throughout (what both bf16 paths approximate): the largest difference of a
token's log-prob, and of a gradient element relative to the largest gradient.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from colocated import (
    SHAPES,
    matmul_tflops,
    median,
    model_config,
    synthetic_batch,
    timed,
    update_flops,
)

VARIANTS = ("eager", "liger", "liger-flce")


def build_model(shape: str) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config: Any = Qwen2Config(**model_config(shape))
    config._attn_implementation = "sdpa"
    model: Any = Qwen2ForCausalLM(config)
    return model.to(device=torch.device("cuda"), dtype=torch.float32).train()


def logprobs_fn(model: Any, variant: str) -> Callable[[Any], Any]:
    """The variant's per-token log-probs of a micro-batch, ``[B, L - 1]``, with gradients."""
    from rlhf_trainer.modeling import logprobs as lp

    if variant != "liger-flce":

        def from_logits(chunk: Any) -> Any:
            logits = model(input_ids=chunk.input_ids, attention_mask=chunk.attention_mask).logits
            logprobs, _ = lp.next_token_logprobs_and_entropy(logits, chunk.input_ids, 1.0)
            return logprobs

        return from_logits

    import torch
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    cross_entropy = LigerFusedLinearCrossEntropyLoss(reduction="none")

    def from_hidden(chunk: Any) -> Any:
        hidden = model.model(
            input_ids=chunk.input_ids, attention_mask=chunk.attention_mask
        ).last_hidden_state[:, :-1]
        rows, length, width = hidden.shape
        # bf16 on both sides, as autocast gives the eager head: the backward, which recomputes
        # the logits chunk by chunk, runs outside autocast and would otherwise be float32.
        weight = model.lm_head.weight.to(torch.bfloat16)
        targets = chunk.input_ids[:, 1:].reshape(-1)
        nll = cross_entropy(weight, hidden.reshape(-1, width).to(torch.bfloat16), targets)
        return -nll.view(rows, length)

    return from_hidden


def patched_modules(model: Any) -> dict[str, str]:
    """Where each patched kernel now comes from, so a patch that did not take shows."""
    from transformers.models.qwen2 import modeling_qwen2

    layer = model.model.layers[0]
    return {
        "rope": modeling_qwen2.apply_rotary_pos_emb.__module__,
        "rms_norm": type(layer.input_layernorm).forward.__module__
        if not hasattr(layer.input_layernorm.forward, "__func__")
        else layer.input_layernorm.forward.__func__.__module__,
        "swiglu": layer.mlp.forward.__func__.__module__
        if hasattr(layer.mlp.forward, "__func__")
        else type(layer.mlp).forward.__module__,
    }


def policy_loss(logprobs: Any, chunk: Any, total_tokens: float) -> Any:
    from rlhf_trainer.algo import formulas as alg

    loss = alg.clipped_policy_loss(
        logprobs,
        chunk.fields["old_logprobs"],
        chunk.fields["advantages"],
        chunk.action_mask,
        clip_range=0.2,
    ).loss
    return loss * float(chunk.action_mask.sum()) / total_tokens


def one_micro_batch(
    model: Any, variant: str, chunk: Any, bf16: bool = True
) -> tuple[Any, dict[str, Any]]:
    """Log-probs and gradients of one micro-batch (no optimizer step); ``bf16=False``: in
    float32 throughout, the reference both bf16 paths are measured against."""
    import torch

    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        logprobs = logprobs_fn(model, variant)(chunk)
    policy_loss(logprobs, chunk, float(chunk.action_mask.sum())).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logprobs.detach().float(), grads


def compare(reference: tuple[Any, dict[str, Any]], other: tuple[Any, dict[str, Any]],
            mask: Any, suffix: str) -> dict[str, float]:  # fmt: skip
    """The largest log-prob difference and the largest gradient difference (absolute, and
    relative to the reference's largest gradient element)."""
    (ref_lp, ref_grads), (lp, grads) = reference, other
    action = mask.bool()
    largest = max(float(g.abs().max()) for g in ref_grads.values())
    grad_diff = max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items())
    return {
        f"logprob_max_abs_diff_{suffix}": float((lp - ref_lp)[action].abs().max()),
        f"grad_max_abs_diff_{suffix}": grad_diff,
        f"grad_max_rel_diff_{suffix}": grad_diff / largest,
    }


def timed_steps(model: Any, variant: str, batch: Any, micro: int, warmup: int,
                steps: int) -> list[float]:  # fmt: skip
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=True)
    total = float(batch.num_action_tokens)
    forward = logprobs_fn(model, variant)

    def step() -> None:
        for chunk in batch.micro_batches(micro):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logprobs = forward(chunk)
            policy_loss(logprobs, chunk, total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    return [timed(step) for _ in range(steps)]


def batch_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The options of a kernels benchmark: where results go, the shape and the batch."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    return parser


def run_header(benchmark: str, args: argparse.Namespace) -> dict[str, Any]:
    """What a kernels result starts with: the run, its device and versions, the batch's shape,
    and the bf16 matmul ceiling measured in this process."""
    import torch

    return {
        "benchmark": benchmark,
        "command": f"python benchmarks/gpu/{Path(sys.argv[0]).name} --out DIR",
        "device": torch.cuda.get_device_name(),
        "versions": {
            n: importlib.metadata.version(n)
            for n in ("torch", "transformers", "liger-kernel", "triton")
        },
        "shape": args.shape,
        "rows": args.rows,
        "micro_batch": args.micro,
        "seq_len": args.seq_len,
        "matmul_tflops": matmul_tflops(),
    }


def main() -> None:
    args = batch_arguments(__doc__).parse_args()

    import torch
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2

    args.out.mkdir(parents=True, exist_ok=True)
    result = run_header("gpu-fused-kernels", args) | {"variants": {}}
    config = model_config(args.shape)
    batch = synthetic_batch(args.rows, args.prompt_len, args.seq_len, config["vocab_size"])
    batch = batch.to(torch.device("cuda"))
    first = next(iter(batch.micro_batches(args.micro)))
    model = build_model(args.shape)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = sum(p.numel() for p in model.parameters())
    tokens = int(batch.attention_mask.sum())
    flops = update_flops(config, params, tokens, args.seq_len)
    float32 = one_micro_batch(model, "eager", first, bf16=False)
    reference = None
    for variant in VARIANTS:
        if variant == "liger":  # RoPE is patched module-wide: from here on every variant has it
            apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True,
                                        fused_linear_cross_entropy=False, model=model)  # fmt: skip
            result["patched"] = patched_modules(model)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(initial[name])
        checked = one_micro_batch(model, variant, first)
        entry: dict[str, Any] = compare(float32, checked, first.action_mask, "vs_float32")
        if reference is None:
            reference = checked
        else:
            entry.update(compare(reference, checked, first.action_mask, "vs_eager"))
        del checked
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        times = timed_steps(model, variant, batch, args.micro, args.warmup, args.steps)
        seconds = median(times)
        entry.update(
            step_seconds=seconds,
            step_seconds_all=times,
            tflops=flops / seconds / 1e12,
            mfu=flops / seconds / 1e12 / result["matmul_tflops"],
            peak_gpu_gb=torch.cuda.max_memory_allocated() / 2**30,
        )
        result["variants"][variant] = entry
        print(variant, json.dumps(entry), flush=True)
        torch.cuda.empty_cache()
    eager = result["variants"]["eager"]["step_seconds"]
    for entry in result["variants"].values():
        entry["speedup_vs_eager"] = eager / entry["step_seconds"]
    (args.out / "gpu-fused-kernels.json").write_text(json.dumps(result, indent=2) + "\n")
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k != "variants"}))


if __name__ == "__main__":
    main()
