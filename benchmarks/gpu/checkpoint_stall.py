"""How long a checkpoint stops training on one GPU: written in place, or snapshotted to host
memory and written in the background (`checkpoint.background`).

    python benchmarks/gpu/checkpoint_stall.py --out DIR     # DIR/gpu-checkpoint-stall.json

One trainer rank as a job runs it (`rlhf_trainer.modeling.networks.build_causal_lm`, the trainer's
DeepSpeed config and stage for one GPU), on the 0.5B shape of `examples/grpo-1gpu.yaml`; it
reserves its host buffers as a rank does at start, then trains two optimizer steps (so AdamW's
moments exist). Then, each `--repeats` times:

* ``save_seconds``: `reshard.save_engine_state` - what a checkpoint blocked for before;
* ``snapshot_seconds``: `reshard.snapshot_engine_state` into the pinned buffers the rank
  reserved at start (``reserve_seconds`` blocking, then pinned on a thread beside the first
  steps: ``pinning_seconds_left_after_two_steps`` is what was still left of it after two) -
  what a background checkpoint blocks for;
* ``write_seconds``: the snapshot's files written, and ``step_seconds_while_writing`` against
  ``step_seconds``: a training step beside the write, and alone.

``stall_fraction`` is the snapshot's time over the save's, and ``checkpoint_stall_percent``
the snapshot's time over the training time between two checkpoints of
`examples/grpo-1gpu.yaml` (`intervalSteps` x the step time of its GPU job,
`gpu-colocated.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from colocated import model_config  # noqa: E402


def engine_of(shape: str) -> tuple[Any, Any]:
    """One ZeRO rank of the trainer's policy on GPU 0 and a training step for it."""
    import deepspeed
    import torch

    from rlhf_trainer.modeling.networks import build_causal_lm
    from rlhf_trainer.modeling.zero import (
        deepspeed_config,
        skip_unused_deepspeed_builds,
        zero_stage,
    )
    from rlhfjob.api import AlgorithmSpec, ModelSpec

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1")  # fmt: skip
    torch.cuda.set_device(0)
    skip_unused_deepspeed_builds(on_gpu=True)
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    algorithm = AlgorithmSpec.model_validate({"microBatchSize": 8, "totalSteps": 1})
    config = deepspeed_config(algorithm, accumulation_steps=1, bf16=True, on_gpu=True,
                              train=True, stage=zero_stage(1, True))  # fmt: skip
    spec = ModelSpec.model_validate({"randomInit": model_config(shape)})
    model = build_causal_lm(spec, 0, torch.bfloat16, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    tokens = torch.randint(1, 1000, (8, 1024), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))  # fmt: skip

    def step() -> None:
        logits = engine(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits
        engine.backward(logits.float().logsumexp(-1).mean())
        engine.step()
        torch.cuda.synchronize()

    return engine, step


def timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def one_round(engine: Any, step: Any, buffers: Any, work: Path) -> dict[str, float]:
    """A save in place; a snapshot; a step alone; the snapshot's write beside a step."""
    from rlhf_trainer.state import reshard

    save = timed(lambda: reshard.save_engine_state(engine, work / "sync", 0, 1))
    started = time.perf_counter()
    snapshot = reshard.snapshot_engine_state(engine, 0, 1, buffers)
    snapshot_seconds = time.perf_counter() - started
    alone = timed(step)
    written: dict[str, float] = {}
    writer = threading.Thread(
        target=lambda: written.update(s=timed(lambda: snapshot.write(work / "background")))
    )
    writer.start()
    beside = timed(step)
    writer.join()
    return {
        "save_seconds": save,
        "snapshot_seconds": snapshot_seconds,
        "write_seconds": written["s"],
        "step_seconds": alone,
        "step_seconds_while_writing": beside,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="0.5b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()

    import torch

    from rlhf_trainer.state import reshard

    engine, step = engine_of(args.shape)
    buffers = reshard.HostBuffers()
    # As a rank does at start (no moments yet): reserve, then train while the buffers pin.
    reserving = timed(lambda: reshard.reserve_host_buffers(engine, 0, buffers))
    step()
    step()
    pinning = timed(buffers.wait_allocated)
    first_snapshot = timed(lambda: reshard.snapshot_engine_state(engine, 0, 1, buffers))
    state_bytes = sum(
        t.numel() * t.element_size()
        for f in reshard.snapshot_engine_state(engine, 0, 1, buffers).files.values()
        for t in f.tensors.values()
    )
    rows = []
    for repeat in range(args.repeats):
        rows.append(one_round(engine, step, buffers, Path(tempfile.mkdtemp(dir=args.work))))
        print(json.dumps({"repeat": repeat, **rows[-1]}), flush=True)

    def med(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    example = yaml.safe_load((REPO / "examples" / "grpo-1gpu.yaml").read_text())
    interval = int(example["spec"]["checkpoint"]["intervalSteps"])
    colocated = json.loads((REPO / "benchmarks/results/gpu-colocated.json").read_text())
    job_steps = [s["step_seconds"] for s in colocated["benchmarks"]["job"]["steps"][1:]]
    job_step = statistics.median(job_steps)
    result = {
        "benchmark": "gpu-checkpoint-stall",
        "command": "python benchmarks/gpu/checkpoint_stall.py --out DIR",
        "device": torch.cuda.get_device_name(),
        "shape": args.shape,
        "zero_stage": int(engine.zero_optimization_stage()),
        "state_bytes": state_bytes,
        "cpu_count": os.cpu_count(),
        "reserve_seconds": reserving,
        "pinning_seconds_left_after_two_steps": pinning,
        "first_snapshot_seconds": first_snapshot,
        "runs": rows,
        "checkpoint_sync_seconds_0_5b": med("save_seconds"),
        "checkpoint_blocking_seconds_0_5b": med("snapshot_seconds"),
        "snapshot_gb_per_s": state_bytes / med("snapshot_seconds") / 1e9,
        "write_seconds": med("write_seconds"),
        "step_seconds": med("step_seconds"),
        "step_seconds_while_writing": med("step_seconds_while_writing"),
        "stall_fraction": med("snapshot_seconds") / med("save_seconds"),
        "example": "examples/grpo-1gpu.yaml",
        "example_interval_steps": interval,
        "example_step_seconds": job_step,
        "checkpoint_stall_percent": 100 * med("snapshot_seconds") / (interval * job_step),
        "checkpoint_stall_percent_sync": 100 * med("save_seconds") / (interval * job_step),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-checkpoint-stall.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
