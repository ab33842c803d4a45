"""The vLLM rollout engine (GPU): vLLM's offline `LLM` API on token ids, and the worker
extension that receives weight syncs inside vLLM's workers."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rlhf_trainer.rollout.base import Completion, SamplingParams
from rlhf_trainer.rollout.model_source import GREEDY_TEMPERATURE, ModelSource, causal_lm_config
from rlhf_trainer.rollout.sync_plan import SyncPlan
from rlhf_trainer.rollout.weight_sync import (
    NamedTensors,
    SyncGroupInfo,
    SyncStats,
    WeightSyncReceiver,
)

# --------------------------------------------------------------------------------------------
# vLLM engine (GPU)
# --------------------------------------------------------------------------------------------

WORKER_EXTENSION = "rlhf_trainer.rollout.vllm_engine.VLLMWorkerExtension"


class VLLMEngine:
    """`RolloutEngine` on vLLM's offline ``LLM`` API (token ids only, no tokenizer).

    A `ModelSource` with a config starts from vLLM's dummy weights (``load_format="dummy"``) in
    a temporary model directory holding only ``config.json``; the first weight sync brings the
    real ones. Weight syncs run inside every vLLM worker through `VLLMWorkerExtension` (passed
    as ``worker_extension_cls``) and ``LLM.collective_rpc``, and load through the model's own
    ``load_weights``, the path vLLM uses for checkpoints (fused QKV, tensor-parallel shards).
    """

    def __init__(
        self,
        model: ModelSource,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        seed: int = 0,
        colocated: bool = False,
        llm_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if colocated:
            # The engine runs inside the trainer rank's process, on its GPU and its
            # torch.distributed world, so weights pass as tensors, not over a process group.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self._model_dir: tempfile.TemporaryDirectory[str] | None = None
        if model.config is not None:
            self._model_dir = tempfile.TemporaryDirectory(prefix="rlhf-vllm-model-")
            causal_lm_config(model.config).save_pretrained(self._model_dir.name)
            path, load_format = self._model_dir.name, "dummy"
        else:
            assert model.path is not None
            path, load_format = model.path, "auto"
        kwargs: dict[str, Any] = {
            "model": path,
            "load_format": load_format,
            "skip_tokenizer_init": True,
            "dtype": model.dtype,
            "tensor_parallel_size": tensor_parallel_size,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enforce_eager": enforce_eager,
            "seed": seed,
            "worker_extension_cls": WORKER_EXTENSION,
            "logprobs_mode": "processed_logprobs",
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if colocated:
            kwargs["distributed_executor_backend"] = "external_launcher"
            kwargs["enable_sleep_mode"] = True
        elif tensor_parallel_size > 1:
            # Worker processes on the GPUs Ray gave this actor (not a nested Ray placement).
            kwargs["distributed_executor_backend"] = "mp"
        kwargs.update(llm_kwargs or {})
        self._llm = LLM(**kwargs)
        self._tensor_parallel_size = tensor_parallel_size
        self._version = 0
        self._consistent = True
        self.asleep: int | None = None
        """The sleep level the engine is at (None: awake)."""
        self._weights_awake = True
        self._weights_released = False
        """Level-2 sleep freed the weights and no load has filled them since."""
        self._reset_pending = False

    def policy_version(self) -> int:
        return self._version

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        from vllm import SamplingParams as VLLMSamplingParams

        if not self._consistent:
            raise RuntimeError("the last weight load failed part-way; load weights again first")
        if self._weights_released:
            raise RuntimeError(
                "the engine slept at level 2, which frees its weights, and none were loaded "
                "since: it would sample from uninitialised memory; load weights first"
            )
        if not prompts:
            return []
        if sampling.seed is not None and not sampling.prompt_seeds:
            # One seed for the whole call, not one per request: vLLM draws the noise of seeded
            # requests request by request (a kernel each, every token), which cost 27 % of the
            # rollout at the GRPO shape. The call stays reproducible given seed, weights and
            # prompts; the fleet fixes which prompts form a call (see `rlhf_trainer.rollout.fleet`).
            self._llm.collective_rpc("rlhf_seed", args=(sampling.seed % 2**63,))
        # Greedy samples are all the same: ask once (some vLLM versions reject n > 1 greedy).
        greedy = sampling.temperature < GREEDY_TEMPERATURE
        params = [
            VLLMSamplingParams(
                n=1 if greedy else sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                logprobs=0 if sampling.logprobs else None,
                stop_token_ids=list(sampling.stop_token_ids),
                ignore_eos=True,  # stop only where the caller says (no tokenizer EOS guessing)
                detokenize=False,
                # Multi-turn rollouts seed each request (its trajectory and turn), so that a
                # turn does not depend on which others share the call; that costs throughput.
                seed=prompt_seed % 2**63 if prompt_seed is not None else None,
            )
            for prompt_seed in (sampling.prompt_seeds or [None] * len(prompts))
        ]
        outputs = self._llm.generate(
            [{"prompt_token_ids": list(prompt)} for prompt in prompts], params, use_tqdm=False
        )
        results = []
        for output in outputs:
            completions = []
            for sample in sorted(output.outputs, key=lambda sample: sample.index):
                ids = list(sample.token_ids)
                logprobs: list[float] = []
                if sampling.logprobs:
                    assert sample.logprobs is not None, "vLLM returned no log-probs"
                    logprobs = [
                        float(position[token].logprob)
                        for position, token in zip(sample.logprobs, ids, strict=True)
                    ]
                completions.append(Completion(ids, logprobs, self._version))
            results.append(completions * sampling.n if greedy else completions)
        return results

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load tensors given directly (sent through vLLM's RPC: for small models and tests;
        training uses the weight-sync group)."""
        payload = [(name, tensor.detach().cpu()) for name, tensor in weights]
        self._consistent = False
        self._llm.collective_rpc("rlhf_load_weights", args=(payload,))
        self._llm.reset_prefix_cache()  # cached KV blocks came from the old weights
        self._version = int(version)
        self._consistent = True
        self._weights_released = False

    # ---- colocated: sleep, wake, load tensors in place ----------------------------------

    def sleep(self, level: int) -> None:
        """Release GPU memory for the trainer: level 1 moves the weights to host memory and
        frees the KV cache, level 2 frees both."""
        if self.asleep is None:
            self._llm.sleep(level=level)
            self.asleep = level
            self._weights_awake = False
            self._weights_released = self._weights_released or level == 2

    @property
    def holds_weights(self) -> bool:
        """Whether waking up gives back weights to sample from (not after a level-2 sleep
        that no load followed)."""
        return not self._weights_released

    def wake_weights(self) -> None:
        """Bring back the weights' memory (level 2: uninitialised until loaded)."""
        if self.asleep is not None and not self._weights_awake:
            self._llm.wake_up(tags=["weights"])
            self._weights_awake = True

    def wake(self) -> None:
        """Weights and KV cache back: ready to generate."""
        if self.asleep is not None:
            self.wake_weights()
            self._llm.wake_up(tags=["kv_cache"])
            self.asleep = None
        if self._reset_pending:
            self._llm.reset_prefix_cache()
            self._reset_pending = False

    def load_tensors(self, weights: NamedTensors) -> None:
        """Load tensors that are already on this GPU through the model's own `load_weights`.

        Colocated only: the worker lives in this process, so the RPC is a plain call and the
        tensors are neither copied to the host nor serialised. Call `finish_load` after the
        last bucket.
        """
        self._consistent = False
        self.wake_weights()
        self._llm.collective_rpc("rlhf_load_tensors", args=(list(weights),))

    def finish_load(self, version: int) -> None:
        self._weights_released = False
        if self.asleep is None:
            self._llm.reset_prefix_cache()  # cached KV blocks came from the old weights
        else:
            self._reset_pending = True  # the KV cache is asleep; reset it when it wakes
        self._version = int(version)
        self._consistent = True

    def weight_sync_ranks(self) -> int:
        return self._tensor_parallel_size

    def init_weight_sync(self, info: SyncGroupInfo | dict[str, Any], first_rank: int) -> None:
        """Every worker joins the group as ``first_rank + its rank in this engine``."""
        info_dict = SyncGroupInfo.from_dict(info).to_dict()
        self._llm.collective_rpc("rlhf_init_weight_sync", args=(info_dict, first_rank))

    def receive_weights(self, plan: SyncPlan | dict[str, Any]) -> SyncStats:
        plan = SyncPlan.from_dict(plan)
        self._consistent = False
        results = self._llm.collective_rpc("rlhf_receive_weights", args=(plan.to_dict(),))
        self._llm.reset_prefix_cache()  # cached KV blocks came from the old weights
        self._version = plan.version
        self._consistent = True
        # Report the slowest worker: the engine is ready once all of them are.
        return max((SyncStats(**result) for result in results), key=lambda stats: stats.seconds)

    def close_weight_sync(self) -> None:
        self._llm.collective_rpc("rlhf_close_weight_sync")

    def broadcast_bytes(self, nbytes: int, repeats: int = 5) -> list[float]:
        """Receiving side of a bare-broadcast measurement; the slowest worker's seconds."""
        results = self._llm.collective_rpc("rlhf_broadcast_bytes", args=(nbytes, repeats))
        return [max(seconds) for seconds in zip(*results, strict=True)]


class VLLMWorkerExtension:
    """Methods mixed into every vLLM worker (``worker_extension_cls``), called through
    ``LLM.collective_rpc``. Arguments arrive as plain data (vLLM serialises RPCs with msgpack).
    ``self`` is the vLLM worker: it has ``device`` and ``model_runner``."""

    device: torch.device
    model_runner: Any
    _rlhf_receiver: WeightSyncReceiver | None

    def rlhf_init_weight_sync(self, info: dict[str, Any], first_rank: int) -> int:
        from vllm.distributed.parallel_state import get_world_group

        sync_info = SyncGroupInfo.from_dict(info)
        rank = first_rank + get_world_group().rank
        device = self.device if sync_info.backend == "nccl" else torch.device("cpu")
        self.rlhf_close_weight_sync()
        self._rlhf_receiver = WeightSyncReceiver(sync_info, rank, device=device)
        return rank

    def rlhf_receive_weights(self, plan: dict[str, Any]) -> dict[str, Any]:
        receiver: WeightSyncReceiver | None = getattr(self, "_rlhf_receiver", None)
        if receiver is None:
            raise RuntimeError("rlhf_init_weight_sync first")
        stats = receiver.receive(plan, self._rlhf_load)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return stats.to_dict()

    def rlhf_broadcast_bytes(self, nbytes: int, repeats: int) -> list[float]:
        receiver: WeightSyncReceiver | None = getattr(self, "_rlhf_receiver", None)
        if receiver is None:
            raise RuntimeError("rlhf_init_weight_sync first")
        return receiver.broadcast_bytes(nbytes, repeats)

    def rlhf_seed(self, seed: int) -> None:
        """Seed the generator vLLM's sampler draws from for requests without their own seed
        (every worker alike, so tensor-parallel shards sample the same tokens)."""
        torch.manual_seed(seed)

    def rlhf_load_weights(self, weights: list[Sequence[Any]]) -> None:
        self._rlhf_load([(str(name), tensor.to(self.device)) for name, tensor in weights])

    def rlhf_load_tensors(self, weights: NamedTensors) -> None:
        """In-process (colocated) only: tensors already on this worker's GPU, by reference."""
        self._rlhf_load(weights)

    def rlhf_close_weight_sync(self) -> None:
        receiver: WeightSyncReceiver | None = getattr(self, "_rlhf_receiver", None)
        if receiver is not None:
            receiver.close()
        self._rlhf_receiver = None

    def _rlhf_load(self, weights: NamedTensors) -> None:
        self.model_runner.model.load_weights(weights=weights)
