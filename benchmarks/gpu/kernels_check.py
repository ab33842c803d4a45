"""`model.kernels: liger` through the trainer's own builders, on one GPU.

    python benchmarks/gpu/kernels_check.py --out DIR     # DIR/gpu-kernels-check.json

`fused_kernels.py` measured Liger Kernel on a hand-patched model; this checks what a job gets:
the policy built by `rlhf_trainer.modeling.networks.build_causal_lm` from a spec with `kernels:
eager` and with `kernels: liger` (the same seed, so the same weights), each through the plain
PyTorch step of `colocated.py update` and the trainer's own log-prob and entropy pass. It reports,
against the eager model in float32 throughout (what both bf16 paths approximate), the largest
log-prob difference and the largest gradient difference, and the step time of each (median of
`--steps`), so `liger_vs_eager_step_ratio` (eager time over liger's) is measured beside its
own ceiling run.

The eager runs come first: Liger's rotary patch is module-wide, so every Qwen2 model built
after it uses it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from colocated import median, model_config, synthetic_batch, update_flops
from fused_kernels import batch_arguments, compare, one_micro_batch, run_header, timed_steps


def policy(kernels: str, shape: str) -> Any:
    """The trainer's policy network for a spec with `kernels`, on the GPU, float32 master
    weights (autocast gives the bf16 compute), in training mode."""
    import torch

    from rlhf_trainer.modeling.networks import build_causal_lm
    from rlhfjob.api import ModelSpec

    spec = ModelSpec.model_validate({"randomInit": model_config(shape), "kernels": kernels})
    model: Any = build_causal_lm(spec, seed=0, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    return model.to("cuda").train()


def main() -> None:
    args = batch_arguments(__doc__).parse_args()

    import torch

    config = model_config(args.shape)
    batch = synthetic_batch(args.rows, args.prompt_len, args.seq_len, config["vocab_size"])
    batch = batch.to(torch.device("cuda"))
    chunk = next(iter(batch.micro_batches(args.micro)))
    result = run_header("gpu-kernels-check", args)
    runs: dict[str, Any] = {}
    reference = None
    for kernels in ("eager", "liger"):
        model = policy(kernels, args.shape)
        if reference is None:
            reference = one_micro_batch(model, "eager", chunk, bf16=False)
        # "eager" here is fused_kernels.py's loss path (the logits, then the trainer's fused
        # log-prob and entropy pass); the kernels are inside the model.
        result |= compare(reference, one_micro_batch(model, "eager", chunk), chunk.action_mask,
                          kernels)  # fmt: skip
        params = sum(p.numel() for p in model.parameters())
        times = timed_steps(model, "eager", batch, args.micro, args.warmup, args.steps)
        flops = update_flops(config, params, int(batch.attention_mask.sum()), args.seq_len)
        runs[kernels] = {
            "step_seconds": median(times),
            "mfu": flops / median(times) / 1e12 / result["matmul_tflops"],
            "tflops": flops / median(times) / 1e12,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
        del model
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        print(json.dumps({kernels: runs[kernels]}), flush=True)
    result["runs"] = runs
    result["liger_vs_eager_step_ratio"] = (
        runs["eager"]["step_seconds"] / runs["liger"]["step_seconds"]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-kernels-check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
