"""`model.optimizerOffload: cpu` on one GPU: its checkpoints, and where an offloaded step goes.

    python benchmarks/gpu/offload_check.py --out DIR     # DIR/offload-check.json

* **Checkpoints**: a ZeRO-2 engine with its optimizer in host memory (DeepSpeed's CPU Adam, as
  the trainer builds it) trains two steps and is saved with the trainer's own
  `reshard.save_engine_state`; a fresh offloaded engine and a fresh engine with the optimizer
  on the GPU each load it. Right after loading, their fp32 master weights and AdamW moments
  must equal the saved ones exactly (`max_abs_diff_after_load`, 0), and one more step of the
  same batch must move them as it moved the engine that saved (`max_abs_diff_after_step`,
  bf16-small; CUDA's backward is not bitwise deterministic).
* **Where the step goes** (``--shape``, 1.5B by default): forward and backward on the GPU,
  then `engine.step()` (the gradients' copy to the host, CPU Adam, the weights' copy back),
  against the same model with the optimizer on the GPU. Per parameter, that says what a
  7B-class step costs on this host.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from colocated import Report, model_config

REPO = Path(__file__).resolve().parents[2]
STARTED = time.perf_counter()


def progress(what: str) -> None:
    """A line per stage, with the seconds since start: a stall shows where it is."""
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {what}", flush=True)


def _distributed() -> None:
    import deepspeed

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)


def engine(shape: str, offload: bool, micro: int) -> Any:
    """A policy engine as `PolicyWorker` builds it (ZeRO-2 on one GPU, bf16)."""
    import deepspeed
    import torch

    from rlhf_trainer.modeling.networks import build_causal_lm, with_activation_checkpointing
    from rlhf_trainer.modeling.zero import cpu_adam, deepspeed_config
    from rlhfjob.api import AlgorithmSpec, ModelSpec

    algorithm = AlgorithmSpec.model_validate(
        {"name": "grpo", "microBatchSize": micro, "totalSteps": 10}
    )
    spec = ModelSpec.model_validate({"randomInit": model_config(shape)})
    config = deepspeed_config(
        algorithm, accumulation_steps=1, bf16=True, on_gpu=True, stage=2,
        optimizer_offload=offload,
    )  # fmt: skip
    model = with_activation_checkpointing(build_causal_lm(spec, 0, torch.bfloat16, config), True)
    optimizer = (
        cpu_adam(model.parameters(), 1e-4)
        if offload
        else torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    )
    built, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return built


def batch(shape: str, rows: int, length: int) -> Any:
    import torch

    vocab = model_config(shape)["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    return torch.randint(1, vocab, (rows, length), generator=generator).cuda()


def train_step(trained: Any, tokens: Any) -> dict[str, float]:
    """One step; the seconds of forward + backward and of `engine.step()`."""
    import torch

    torch.cuda.synchronize()
    started = time.perf_counter()
    logits = trained(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
    trained.backward(logits.float().logsumexp(-1).mean())
    torch.cuda.synchronize()
    backward_done = time.perf_counter()
    trained.step()
    torch.cuda.synchronize()
    return {
        "forward_backward_s": backward_done - started,
        "step_s": time.perf_counter() - backward_done,
    }


def state_difference(a: Path, b: Path) -> dict[str, float]:
    from rlhf_trainer.state.reshard import read_saved_state, whole_tensors

    return {
        kind: max(
            float((whole_tensors(a, kind)[name].float() - tensor.float()).abs().max())
            for name, tensor in whole_tensors(b, kind).items()
        )
        for kind in read_saved_state(a).kinds
    }


def checkpoints(report: Report, work: Path) -> None:
    from rlhf_trainer.state import reshard

    shape, tokens = "0.5b", batch("0.5b", 8, 256)
    progress("building the offloaded engine (CPU Adam built on first use)")
    saving = engine(shape, offload=True, micro=8)
    for _ in range(2):
        progress("a step")
        train_step(saving, tokens)
    progress("saving")
    reshard.save_engine_state(saving, work / "saved", rank=0, world_size=1)
    train_step(saving, tokens)
    reshard.save_engine_state(saving, work / "saver-after-step", rank=0, world_size=1)
    del saving
    results = {}
    for name, offload in (("offloaded", True), ("on_gpu", False)):
        progress(f"loading into a fresh engine, optimizer {name}")
        loaded = engine(shape, offload=offload, micro=8)

        def zero_step(fresh: Any = loaded) -> None:
            import torch

            ids = torch.ones((1, 2), dtype=torch.long, device="cuda")
            fresh.backward(fresh(input_ids=ids, attention_mask=ids).logits.float().sum() * 0.0)
            fresh.step()

        reshard.load_engine_state(loaded, work / "saved", zero_step)
        reshard.save_engine_state(loaded, work / f"{name}-loaded", rank=0, world_size=1)
        train_step(loaded, tokens)
        reshard.save_engine_state(loaded, work / f"{name}-after-step", rank=0, world_size=1)
        results[name] = {
            "max_abs_diff_after_load": state_difference(work / "saved", work / f"{name}-loaded"),
            "max_abs_diff_after_step": state_difference(
                work / "saver-after-step", work / f"{name}-after-step"
            ),
        }
        del loaded
    report.update(checkpoints=results)


def step_costs(report: Report, shape: str, steps: int) -> None:
    import torch

    tokens = batch(shape, 32, 512)
    runs = {}
    for name, offload in (("offloaded", True), ("on_gpu", False)):
        trained = engine(shape, offload=offload, micro=32)
        timings = [train_step(trained, tokens) for _ in range(steps + 1)][1:]
        params = sum(p.numel() for p in trained.module.parameters())
        step_s = sorted(t["step_s"] for t in timings)[len(timings) // 2]
        runs[name] = {
            "params": params,
            "forward_backward_s": sorted(t["forward_backward_s"] for t in timings)[
                len(timings) // 2
            ],
            "step_s": step_s,
            "step_ns_per_param": step_s / params * 1e9,
        }
        del trained
        torch.cuda.empty_cache()
    report.update(step_costs={"shape": shape, "tokens": 32 * 512, "runs": runs})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/offload")))
    parser.add_argument("--shape", default="1.5b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stall-dump-s", type=float, default=240, help="stacks to stderr then")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.stall_dump_s, repeat=True)  # where a stall sits
    report = Report(args.out / "offload-check.json", " ".join(sys.argv))
    _distributed()
    with tempfile.TemporaryDirectory() as work, report.section("checkpoints"):
        checkpoints(report, Path(work))
    with report.section("step_costs"):
        step_costs(report, args.shape, args.steps)
    print(json.dumps({k: v for k, v in report.data.items() if k != "versions"}, indent=2))


if __name__ == "__main__":
    main()
