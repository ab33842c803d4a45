"""Colocated rollout (`roles.rollout.placement: colocated`): a hybrid engine per trainer rank.

Every policy rank hosts its own rollout engine on its own device, so a one-GPU job trains at
all, and no GPU idles while the other phase runs. The rank hands its memory back and forth:

* **generation**: the engine is awake; the ZeRO-3 trainer offloads its optimizer state,
  fp32 master weights and gradients to host memory (`ColocatedEngine.for_rollout`). Below
  ZeRO-3 DeepSpeed cannot offload them, and they stay (a one-GPU job has room); with
  `model.optimizerOffload: cpu` they live on the host throughout.
* **update**: the engine sleeps (`roles.rollout.sleepLevel`; level 1 moves its weights to the
  host, level 2 drops them; both free the KV cache) and the trainer reloads its state.
* **weight update**: parameters are gathered one module at a time (a ZeRO-3 collective, so
  every rank runs it) and loaded in place through vLLM's own ``load_weights`` (no NCCL, no
  copy to the host); unpartitioned parameters go in large buckets.

The transitions are lazy and idempotent: each rank method puts the rank in the mode it
needs, so a restored, adopted or freshly started rank is always right whatever ran last.

`ColocatedRollout` is the driver's side: the same calls as `RolloutFleet` (generate, sync,
maintain, shutdown), with chunk ``i`` of a step sampled by rank ``i`` with the seed of chunk
``i``, so samples do not depend on placement either. A colocated engine lives and dies with its
rank: losing one fails the step, and the operator restarts the group from its checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from rlhf_trainer.elastic import plan_chunks
from rlhf_trainer.rollout.base import (
    CALL_TIMEOUT_S,
    GENERATE_TIMEOUT_S,
    Completion,
    SamplingParams,
    SyncResult,
)
from rlhf_trainer.rollout.engines import HFEngine
from rlhf_trainer.rollout.model_source import ModelSource
from rlhf_trainer.rollout.sync_plan import (
    NamedTensors,
    ParameterGroups,
    iter_module_parameters,
    parameter_groups,
)
from rlhf_trainer.rollout.vllm_engine import VLLMEngine
from rlhf_trainer.seeds import derive_seed
from rlhf_trainer.topology import response_budget
from rlhfjob.api import RLHFJobSpec

BUCKET_BYTES = 1 << 30
"""Unpartitioned parameters are loaded in buckets of about this size (fewer, larger calls)."""

ROLLOUT = "rollout"
TRAINING = "training"


class ColocatedEngine:
    """One rank's rollout engine and the hand-over of the rank's memory between phases."""

    def __init__(self, spec: RLHFJobSpec, rank: int, device: torch.device) -> None:
        rollout = spec.roles.rollout
        on_gpu = device.type == "cuda"
        source = ModelSource.from_spec(spec.model, seed=spec.algorithm.seed, on_gpu=on_gpu)
        self.engine: HFEngine | VLLMEngine
        if rollout.backend == "vllm":
            algorithm = spec.algorithm
            self.engine = VLLMEngine(
                source,
                gpu_memory_utilization=rollout.gpu_memory_utilization,
                max_model_len=algorithm.max_prompt_length + response_budget(spec),
                seed=derive_seed(spec.algorithm.seed, rank) % 2**31,
                colocated=True,
            )
        else:
            self.engine = HFEngine(source, device=device, num_threads=1)
        self.sleep_level = rollout.sleep_level
        self.on_gpu = on_gpu
        self.mode = ROLLOUT
        self.offloaded = False
        self.seconds: dict[str, float] = {}
        """Time spent in each hand-over (sleep, wake, offload, reload, load), summed."""
        self.peak_memory: dict[str, int] = {}
        """GPU: the most memory in use on the device during each mode, in bytes."""
        self._groups: tuple[int, ParameterGroups] | None = None
        """The trainer module's parameter groups, walked once (keyed by the module's id)."""
        self._mark_start()

    def _mark_start(self) -> None:
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats()

    def _mark(self, mode: str) -> None:
        """Record the peak of the mode that ends: the caching allocator's peak plus what
        lives outside it (vLLM's sleep-mode pool, the CUDA context), seen by the device."""
        if not self.on_gpu:
            return
        free, total = torch.cuda.mem_get_info()
        outside = (total - free) - torch.cuda.memory_reserved()
        peak = torch.cuda.max_memory_reserved() + max(outside, 0)
        self.peak_memory[mode] = max(self.peak_memory.get(mode, 0), peak)
        self._mark_start()

    def _timed(self, name: str, action: Callable[[], Any]) -> None:
        started = time.perf_counter()
        action()
        if self.on_gpu:
            torch.cuda.synchronize()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def for_rollout(self, trainer: Any) -> None:
        """Offload the trainer's state (ZeRO-3) and wake the engine."""
        if self.mode == ROLLOUT:
            return
        self._mark(TRAINING)
        if self.on_gpu and _zero_stage(trainer) == 3 and not trainer.zero_cpu_offload():
            self._timed("trainer_offload", lambda: _offload(trainer))
            self.offloaded = True
        if self.on_gpu:  # the trainer's cached blocks back to the device, for the KV cache
            self._timed("trainer_empty_cache", torch.cuda.empty_cache)
        if isinstance(self.engine, VLLMEngine):
            self._timed("engine_wake", self.engine.wake)
        self.mode = ROLLOUT

    def for_training(self, trainer: Any) -> None:
        """Put the engine to sleep and bring the trainer's state back."""
        if self.mode == TRAINING:
            return
        self._mark(ROLLOUT)
        if isinstance(self.engine, VLLMEngine):
            self._timed("engine_sleep", self._sleep)
        if self.offloaded:
            self._timed("trainer_reload", trainer.reload_states)
            self.offloaded = False
        self.mode = TRAINING

    def _sleep(self) -> None:
        assert isinstance(self.engine, VLLMEngine)
        self.engine.sleep(self.sleep_level)

    def holds_weights(self) -> bool:
        """False after the engine slept at level 2 outside an update (a checkpoint's
        snapshot): it needs the weights loaded again before it generates."""
        return not isinstance(self.engine, VLLMEngine) or self.engine.holds_weights

    def load(self, module: nn.Module, version: int) -> dict[str, Any]:
        """Load `module`'s parameters (every rank gathers) into the engine as `version`."""
        if isinstance(self.engine, VLLMEngine):  # memory back first (not part of the load)
            self._timed("engine_wake_weights", self.engine.wake_weights)
        if self._groups is None or self._groups[0] != id(module):
            self._groups = (id(module), parameter_groups(module))
        with _collector_paused():
            return self._load_all(module, self._groups[1], version)

    def _load_all(self, module: nn.Module, groups: ParameterGroups, version: int) -> dict[str, Any]:
        started = time.perf_counter()
        loaded = 0
        bucket: NamedTensors = []
        bucket_bytes = 0
        for tensors, transient in iter_module_parameters(module, groups):
            loaded += sum(t.numel() * t.element_size() for _, t in tensors)
            if transient:  # freed when the iterator moves on: load now
                self._load(tensors)
                continue
            bucket += tensors
            bucket_bytes += sum(t.numel() * t.element_size() for _, t in tensors)
            if bucket_bytes >= BUCKET_BYTES:
                self._load(bucket)
                bucket, bucket_bytes = [], 0
        if bucket:
            self._load(bucket)
        if isinstance(self.engine, VLLMEngine):
            self.engine.finish_load(version)
        else:
            self.engine.set_version(version)
        if self.on_gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        self.seconds["weight_load"] = self.seconds.get("weight_load", 0.0) + seconds
        return {"version": version, "seconds": seconds, "bytes": loaded}

    def _load(self, tensors: NamedTensors) -> None:
        if isinstance(self.engine, VLLMEngine):
            self.engine.load_tensors(tensors)
        else:
            self.engine.copy_weights(tensors)

    def generate(
        self, trainer: Any, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        self.for_rollout(trainer)
        return self.engine.generate(prompts, sampling)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's garbage collector off for a few milliseconds: a collection of the rank's large
    heap (torch, Ray, vLLM) in the middle of a weight load made it up to 1.8x slower on one
    H200 (`BENCHMARKS.md`, weight update); a load allocates little, so nothing piles up."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _zero_stage(trainer: Any) -> int:
    return int(trainer.zero_optimization_stage())


def _offload(trainer: Any) -> None:
    """ZeRO-3: optimizer state, fp32 master weights and gradients to pinned host memory (the
    bf16 weights stay: generation does not need them, but reloading them would cost more
    than they free)."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    trainer.offload_states(
        include=[
            OffloadStateTypeEnum.optim_states,
            OffloadStateTypeEnum.hp_params,
            OffloadStateTypeEnum.lp_grads,
            OffloadStateTypeEnum.contiguous_grad_buffer,
        ]
    )


class ColocatedRollout:
    """The driver's handle on the policy ranks' engines: a `rollout.Rollout` whose engines live
    and die with their ranks (so none is ever lost alone and `maintain` has nothing to do)."""

    def __init__(
        self,
        policy: Any,
        *,
        on_change: Callable[[int, int], None] | None = None,
        generate_timeout_s: float = GENERATE_TIMEOUT_S,
        call_timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        self.policy = policy
        self.version: int | None = None
        """The version the engines were last given (`sync`)."""
        self.desired = self.minimum = len(policy.actors)
        self.on_change = on_change
        self.generate_timeout_s = generate_timeout_s
        self.call_timeout_s = call_timeout_s
        self._report(self.desired)

    def _report(self, live: int) -> None:
        if self.on_change is not None:
            self.on_change(live, self.desired)

    def maintain(self) -> None:
        """Nothing to re-admit (an engine is there as long as its rank is), but an engine
        that slept at level 2 outside an update (for a checkpoint) lost its weights: every
        rank loads them again (a ZeRO-3 gather is collective), before anything generates."""
        if self.version is None:
            return
        held = self.policy.call("rollout_holds_weights", timeout=self.call_timeout_s)
        if not all(held):
            self.sync(self.version)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        """`sampling.n` completions per prompt, in prompt order: chunk ``i`` on rank ``i``."""
        import ray

        chunks = plan_chunks(len(prompts), self.desired)
        refs = [
            self.policy.actors[chunk.index].generate.remote(
                prompts[chunk.start : chunk.stop],
                sampling.for_prompts(chunk.start, chunk.stop, chunk.seed(sampling.seed)),
            )
            for chunk in chunks
        ]
        results = ray.get(refs, timeout=self.generate_timeout_s)
        return [completions for result in results for completions in result]

    def sync(self, version: int) -> SyncResult:
        """Every rank loads the new weights into its own engine."""
        started = time.perf_counter()
        results = self.policy.call("update_rollout_engine", version, timeout=self.call_timeout_s)
        self.version = version
        return SyncResult(version, time.perf_counter() - started, int(results[0]["bytes"]))

    def shutdown(self) -> None:
        """The engines go with their ranks (`WorkerGroup.shutdown`)."""
        self._report(0)
