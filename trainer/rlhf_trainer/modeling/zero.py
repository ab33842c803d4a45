"""DeepSpeed ZeRO-3 settings derived from `spec.algorithm`, and the learning-rate schedule.

Pure functions, so what DeepSpeed is told can be read and tested without starting it.

CPU notes (the same code runs on GPUs):

* DeepSpeed detects the CPU accelerator by itself when no GPU is visible; the process group then
  uses gloo. No `DS_ACCELERATOR` variable is needed.
* The optimizer is a client `torch.optim.AdamW` (`zero_allow_untested_optimizer`). DeepSpeed's
  own "AdamW" compiles a C++ extension (its CPU fused Adam) on first use, which takes minutes on
  a small machine; torch's AdamW computes the same update. On GPUs torch uses its fused kernel.
* On the CPU DeepSpeed would also JIT-compile a small shared-memory allreduce extension the first
  time it starts (80 s to a few minutes on two busy cores, once per machine). It is only used
  when `LOCAL_SIZE` is set, which the actors never set, so gloo does the work:
  `skip_unused_deepspeed_builds` turns the build off.
* DeepSpeed imports MLflow for its autotuner whenever MLflow is installed (the `tracking` extra
  installs its client): 1.3 s of CPU per rank for a feature the ranks never use.
  `import_deepspeed` imports DeepSpeed without it.
* Parameters of any size are sharded on the CPU (`stage3_param_persistence_threshold: 0`):
  DeepSpeed otherwise keeps tensors under 100k elements whole on every rank, which for the tiny
  test models is all of them, and ZeRO-3's gather paths would never run.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from rlhfjob.api import AlgorithmSpec

ONE_GPU_STAGE = 2
"""ZeRO stage of a one-GPU trainer: partitioning buys nothing there, and on one H200 the 1.5B
update ran at 1.05x a plain PyTorch step with ZeRO-2 against 0.54x with ZeRO-3
(`benchmarks/results/gpu-colocated.json`, `update`)."""


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"
"""DeepSpeed's Muon optimizer: every ZeRO optimizer imports it to ask whether it is in use."""


class _UnusedMuon:
    """Stands in for DeepSpeed's `MuonWithAuxAdam`: the ranks' optimizer is never one."""


UNUSED_BY_DEEPSPEED = ("mlflow",)
"""Modules DeepSpeed imports when installed but the ranks never need it to (see above)."""


def import_deepspeed() -> types.ModuleType:
    """`import deepspeed`, the modules of `UNUSED_BY_DEEPSPEED` hidden from it while it loads
    unless the process already imported them; later imports of them work as usual."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hidden = [name for name in UNUSED_BY_DEEPSPEED if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # import raises ImportError
    try:
        import deepspeed
    finally:
        for name in hidden:
            del sys.modules[name]
    return deepspeed


def skip_unused_deepspeed_builds(on_gpu: bool) -> None:
    """Keep DeepSpeed from building what the ranks never use; call before `init_distributed`.

    * On the CPU, the shared-memory allreduce extension (see above): marked incompatible, it is
      neither compiled nor loaded, and gloo does every collective. GPUs have none to skip.
    * The Muon optimizer's module: ZeRO's optimizers import it only for an `isinstance` check,
      and importing it sets up `torch.compile` for its kernels (inductor's modules: 1.6 s of CPU
      per rank with bytecode cached, 3 s without). The ranks use torch's AdamW, so a stand-in
      module answers the check instead (unless a process already imported the real one).
    """
    if MUON_MODULE not in sys.modules:
        stand_in = types.ModuleType(
            MUON_MODULE, "Muon is not used here (rlhf_trainer.modeling.zero)"
        )
        stand_in.MuonWithAuxAdam = _UnusedMuon  # type: ignore[attr-defined]
        sys.modules[MUON_MODULE] = stand_in
    if not on_gpu:
        import deepspeed.ops

        # Probed once per process; DeepSpeed keeps edits to the one dict it caches.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def zero_stage(world_size: int, on_gpu: bool) -> int:
    """ZeRO-3 wherever partitioning pays (several ranks; every CPU run, which tests the
    partitioned path), a lighter stage on one GPU. `RLHF_ZERO_STAGE` overrides it (benchmarks).

    Neither the job's spec nor the checkpoint layout depends on the stage: a group that
    restarts with other ranks may change stage (two GPUs ZeRO-3, then one ZeRO-2), and its
    checkpoint loads across (`rlhf_trainer.state.reshard`).
    """
    override = os.environ.get("RLHF_ZERO_STAGE")
    if override:
        return int(override)
    return ONE_GPU_STAGE if on_gpu and world_size == 1 else 3


def deepspeed_config(
    algorithm: AlgorithmSpec,
    *,
    accumulation_steps: int,
    bf16: bool,
    on_gpu: bool,
    train: bool = True,
    stage: int = 3,
    optimizer_offload: bool = False,
) -> dict[str, Any]:
    """The DeepSpeed config of a ZeRO engine (train=False for the frozen reference).

    `optimizer_offload` (`model.optimizerOffload: cpu`, GPUs only) keeps the optimizer in host
    memory (ZeRO-Offload; the engine's optimizer must then be DeepSpeed's CPU Adam,
    `cpu_adam`). Unpinned: pinning 16 bytes a parameter of a 7B-class model would lock most of
    the host's memory, and the copies it would speed up are a few percent of such a step.
    """
    # An optimizer-less engine (the reference) has nothing to partition below ZeRO-3.
    zero: dict[str, Any] = {"stage": stage if train or stage == 3 else 0}
    if train and optimizer_offload:
        if not on_gpu or stage == 0:
            raise ValueError("optimizer offload needs GPUs and a ZeRO stage of 1 or more")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if not on_gpu and zero["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": algorithm.micro_batch_size,
        "gradient_accumulation_steps": accumulation_steps,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
    if train:
        config["gradient_clipping"] = algorithm.max_grad_norm
        config["zero_allow_untested_optimizer"] = True
    return config


@contextlib.contextmanager
def partitioned_loading(config: dict[str, Any]) -> Iterator[None]:
    """Under a ZeRO-3 `config`, Hugging Face models loaded inside this block are built
    partitioned from the start: transformers constructs them under ``deepspeed.zero.Init`` and
    copies each checkpoint tensor into its partitions as it reads it, so no rank ever holds a
    full copy of the model. Below ZeRO-3 the block changes nothing.

    transformers looks for a live ``HfDeepSpeedConfig`` (through a weak reference); the block
    keeps one alive and removes it on exit, so models built afterwards are ordinary again.
    """
    if config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    marker = HfDeepSpeedConfig(config)
    try:
        yield
    finally:
        del marker
        unset_hf_deepspeed_config()


def lr_multiplier(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Factor applied to the base learning rate at optimizer step `n` (for `LambdaLR`).

    Linear warmup from 0 over `warmup_steps`, then constant, linearly decaying to 0, or cosine
    decaying to 0 at `total_steps`.
    """
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown lr schedule {schedule!r}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def cpu_adam(parameters: Any, learning_rate: float) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam in AdamW mode (no weight decay, as the GPU path's AdamW): the
    optimizer ZeRO-Offload runs on the host. Its C++ extension is built on first use (about a
    minute) unless the image built it with DeepSpeed (`DS_BUILD_CPU_ADAM=1`)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return cast(
        torch.optim.Optimizer,
        DeepSpeedCPUAdam(parameters, lr=learning_rate, weight_decay=0.0, adamw_mode=True),
    )
