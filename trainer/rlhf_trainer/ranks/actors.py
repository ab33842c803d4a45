"""ZeRO-3 training ranks as Ray actors: the policy, the critic and the frozen reference.

Each role's ranks form one torch.distributed group (gloo on the CPU, NCCL on GPUs): the driver
starts one actor per rank with the role's Ray custom resource (so Ray places it on that role's
node pool), asks rank 0 for a rendezvous address and hands it to every rank. Each rank then wraps
its model in a DeepSpeed ZeRO-3 engine, which shards parameters, gradients and optimizer state
across the group.

The driver sends every rank the *whole* batch (one object in Ray's store) and each rank takes its
own shard (`ShardPlan`), so ranks always run the same number of micro-batches, as ZeRO-3's
collective parameter gathers require. Per-rank results come back in rank order and the driver
reassembles them with `ShardPlan.unshard`.

`rlhf_trainer.ranks.group.WorkerGroup` is the driver's handle on one role's ranks.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlhf_trainer.algo import formulas as alg
from rlhf_trainer.algo.batch import Batch, ShardPlan
from rlhf_trainer.algo.losses import PolicyObjective
from rlhf_trainer.modeling import logprobs as lp
from rlhf_trainer.modeling.networks import (
    build_causal_lm,
    build_critic,
    build_reference,
    scoring_head,
    training_dtype,
    with_activation_checkpointing,
)
from rlhf_trainer.modeling.zero import (
    cpu_adam,
    deepspeed_config,
    import_deepspeed,
    lr_multiplier,
    skip_unused_deepspeed_builds,
    zero_stage,
)
from rlhf_trainer.ranks.adoption import spec_digest
from rlhf_trainer.rollout import sync_plan
from rlhf_trainer.rollout import weight_sync as ws
from rlhf_trainer.rollout.base import Completion, SamplingParams
from rlhf_trainer.rollout.colocated import ColocatedEngine
from rlhf_trainer.state import checkpoint as ckpt
from rlhf_trainer.state import export, reshard
from rlhf_trainer.topology import rollout_rows
from rlhfjob.api import ModelSpec, RLHFJobSpec

logger = logging.getLogger(__name__)

DIST_TIMEOUT = timedelta(minutes=10)
"""How long a collective may wait for a peer before the group fails (a dead rank, not a hang)."""
CPU_SYNC_BUCKET_BYTES = 1 << 20
"""Weight-sync bucket size on the CPU (GPUs use `sync_plan.DEFAULT_BUCKET_BYTES`)."""


def free_port() -> int:
    """A TCP port that was free a moment ago (the rendezvous of a new process group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


CHECKPOINT_WRITES = "checkpoint-writes"
"""The ranks' Ray concurrency group for `ZeroWorker.wait_saved`: its own thread, so the driver
can wait for a background checkpoint's writes while the default thread trains."""


class ZeroWorker:
    """One rank of a ZeRO-3 group. Subclasses build their engines in `_build`."""

    state_dir: str | None = None
    """The subdirectory of a checkpoint that holds this role's state (None: it has none)."""
    engine: Any
    """The role's DeepSpeed engine that trains (policy, critic), built by `_build`."""

    def __init__(self, spec_json: str, rank: int, world_size: int) -> None:
        self.spec = RLHFJobSpec.model_validate_json(spec_json)
        self.spec_digest = spec_digest(spec_json)
        self.rank = rank
        self.world_size = world_size
        self.ready = False
        """True once `setup` built the engines (a driver may adopt only a ready rank)."""
        self.on_gpu = torch.cuda.is_available()
        if self.on_gpu:
            # vLLM's workers run NCCL with cuMem off; the weight-sync group's NCCL communicator
            # on rank 0 must agree, or its broadcasts can hang.
            os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        else:
            torch.set_num_threads(1)  # actors share a few cores; oversubscription slows all
        self.dtype = training_dtype(self.spec.model, self.on_gpu)
        self.plan = ShardPlan(
            rollout_rows(self.spec), world_size, self.spec.algorithm.micro_batch_size
        )
        self.seed = self.spec.algorithm.seed
        self._host_buffers = reshard.HostBuffers()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write")
        self._write: Future[None] | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's address and a free port for the group's TCP store."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int, total_optimizer_steps: int) -> None:
        """Join the process group and build the DeepSpeed engines (blocks until all ranks join)."""
        deepspeed = import_deepspeed()
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",  # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES
        )
        if self.on_gpu:
            torch.cuda.set_device(0)
        skip_unused_deepspeed_builds(self.on_gpu)
        deepspeed.init_distributed(
            dist_backend="nccl" if self.on_gpu else "gloo",
            auto_mpi_discovery=False,
            timeout=DIST_TIMEOUT,
            verbose=False,
        )
        started = time.perf_counter()
        self._build(total_optimizer_steps)
        if self.on_gpu and self.state_dir is not None and self.spec.checkpoint.background:
            reshard.reserve_host_buffers(self.engine, self.rank, self._host_buffers)
        self.build_report = {
            "seconds": time.perf_counter() - started,
            "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_gpu_bytes": torch.cuda.max_memory_reserved() if self.on_gpu else 0,
        }
        """How long building the engines took and the peak memory so far (model loading)."""
        self.ready = True

    def build_report_of(self) -> dict[str, Any]:
        """`build_report` (set by `setup`)."""
        return dict(self.build_report)

    def ping(self) -> dict[str, Any]:
        """Cheap liveness check for adoption: which spec, rank and group, and whether set up.

        A rank still busy with a dead driver's call (stuck in a collective, say) cannot answer,
        which is what keeps a restarted driver from adopting it.
        """
        return {
            "spec": self.spec_digest,
            "rank": self.rank,
            "world_size": self.world_size,
            "ready": self.ready,
        }

    def _build(self, total_optimizer_steps: int) -> None:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0) if self.on_gpu else torch.device("cpu")

    def _config(self, train: bool) -> dict[str, Any]:
        return deepspeed_config(
            self.spec.algorithm,
            accumulation_steps=self.plan.accumulation_steps,
            bf16=self.dtype == torch.bfloat16,
            on_gpu=self.on_gpu,
            train=train,
            stage=zero_stage(self.world_size, self.on_gpu),
            optimizer_offload=self.optimizer_offloaded,
        )

    @property
    def optimizer_offloaded(self) -> bool:
        """Whether this rank's optimizer lives in host memory (`model.optimizerOffload`)."""
        return self.on_gpu and self.spec.model.optimizer_offload == "cpu"

    def _training_engine(
        self, model: nn.Module, learning_rate: float, total_optimizer_steps: int
    ) -> Any:
        import deepspeed

        algorithm = self.spec.algorithm
        optimizer = (
            cpu_adam(model.parameters(), learning_rate)
            if self.optimizer_offloaded
            else torch.optim.AdamW(
                model.parameters(), lr=learning_rate, weight_decay=0.0, fused=self.on_gpu
            )
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lr_multiplier(algorithm.lr_schedule, algorithm.warmup_steps, total_optimizer_steps),
        )
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=schedule, config=self._config(True)
        )
        return engine

    def _inference_engine(self, model: nn.Module) -> Any:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=self._config(False))
        engine.eval()
        return engine

    def _shard(self, batch: Batch) -> Batch:
        return self.plan.shard(batch, self.rank).to(self.device)

    def _global_means(self, sums: dict[str, float], weight: float) -> dict[str, float]:
        """Weighted sums from every rank turned into group-wide means (same on every rank)."""
        names = sorted(sums)
        totals = torch.tensor([*(sums[name] for name in names), weight], dtype=torch.float64)
        totals = totals.to(self.device)
        dist.all_reduce(totals)
        totals = totals.cpu()
        count = max(float(totals[-1]), 1.0)
        return {name: float(totals[i]) / count for i, name in enumerate(names)}

    # -- checkpoints -------------------------------------------------------------------------

    def _output(self, engine: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """What the engine's model returns for a batch (logits, values): `_step_on_zeros`."""
        raise NotImplementedError

    def _step_on_zeros(self, engine: Any) -> None:
        """One optimizer step whose gradients are all zero: it changes no weight (AdamW moves
        nothing without a gradient; no weight decay), but makes a fresh optimizer create and
        link its state the way each ZeRO stage does, so a loaded checkpoint can overwrite it."""
        engine.train()
        input_ids = torch.ones((1, 2), dtype=torch.long, device=self.device)
        for _ in range(self.plan.accumulation_steps):  # the step comes at the boundary
            output = self._output(engine, input_ids, torch.ones_like(input_ids))
            engine.backward(output.float().sum() * 0.0)
            engine.step()

    def save(self, directory: str) -> None:
        """This rank's part of the role's state and its RNG states, written into checkpoint
        `directory` before this returns."""
        self.snapshot(directory)
        self.wait_saved()

    def snapshot(self, directory: str) -> None:
        """Copy this rank's part of the role's state (`rlhf_trainer.state.reshard`) and its RNG
        states to host memory now, and write them into checkpoint `directory` on a thread of
        this rank while it trains on (`checkpoint.background`); `wait_saved` waits for the
        write. Waits for the previous write first, whatever its outcome (which went to the
        driver that waited for it, if any): its host buffers are reused."""
        if self._write is not None:
            futures_wait([self._write])
        if self.state_dir is None:
            return
        self._before_snapshot()
        target = Path(directory) / self.state_dir
        state = reshard.snapshot_engine_state(
            self.engine, self.rank, self.world_size, self._host_buffers
        )
        rng = ckpt.capture_rng_state()

        def write() -> None:
            state.write(target)
            ckpt.save_rng_state(rng, target / reshard.rng_file(self.rank))
            if self.rank == 0 and self.state_dir == export.POLICY_DIR:  # config, tokenizer
                export.save_model_files(self.spec.model, target / export.MODEL_FILES_DIR)

        self._write = self._writer.submit(write)

    def wait_saved(self) -> None:
        """Wait for this rank's last checkpoint write (`snapshot`); raises what it raised. The
        driver calls it in the `CHECKPOINT_WRITES` concurrency group, beside training."""
        if self._write is not None:
            self._write.result()

    def _before_snapshot(self) -> None:
        """Before its state is read: the colocated policy takes its memory back (its engine
        sleeps, and at level 2 loses its weights: `ColocatedRollout.maintain`)."""

    def _load_engine(self, engine: Any, directory: Path, step: int) -> None:
        """Load a role's state saved by any number of ranks, then this rank's RNG states: its
        own file when the group has the size that saved it, else seeded from (seed, step, rank)
        (`reshard.resized_rank_seed`): after a resize no file belongs to a rank."""
        if not reshard.is_saved_state(directory):
            raise ckpt.CheckpointError(
                f"{directory}: no {reshard.STATE_FILE} (not a checkpoint of this trainer's format)"
            )
        saved = reshard.load_engine_state(engine, directory, lambda: self._step_on_zeros(engine))
        rng_file = directory / reshard.rng_file(self.rank)
        if saved.world_size == self.world_size and rng_file.is_file():
            ckpt.restore_rng_state(ckpt.load_rng_state(rng_file))
        else:
            reshard.seed_every_rng(reshard.resized_rank_seed(self.seed, step, self.rank))


def next_token_scores(
    engine: Any, micro: Batch, temperature: float, model: ModelSpec
) -> tuple[Tensor, Tensor]:
    """(log-prob of each next token, entropy at each position) of a causal LM (a DeepSpeed
    engine or the bare network) on `micro`, both ``[rows, L - 1]``: from its logits, or with
    `model.fused_logprobs` straight from its last hidden states (`model.compiled_logprobs`:
    the per-token math compiled either way)."""
    inputs = {"input_ids": micro.input_ids, "attention_mask": micro.attention_mask}
    compiled = model.compiled_logprobs
    if not model.fused_logprobs:
        logits = engine(**inputs).logits
        return lp.next_token_logprobs_and_entropy(
            logits, micro.input_ids, temperature, compiled=compiled
        )
    with scoring_head(getattr(engine, "module", engine), micro.input_ids, temperature, compiled):
        scores = engine(**inputs).logits
    return scores[0], scores[1]


def _sequence_logprobs(engine: Any, batch: Batch, spec: RLHFJobSpec) -> Tensor:
    """Log-probs of every next token of every row, ``[rows, L - 1]``, without gradients."""
    algorithm, parts = spec.algorithm, []
    with torch.no_grad():
        for micro in batch.micro_batches(algorithm.micro_batch_size):
            logprobs, _ = next_token_scores(engine, micro, algorithm.temperature, spec.model)
            parts.append(logprobs.float())
    return torch.cat(parts).cpu()


class PolicyWorker(ZeroWorker):
    """A policy rank: log-probs, the clipped-surrogate update, weights for sync, checkpoints.

    When the job has no reference role, the policy ranks also hold the frozen reference (a
    second, optimizer-less ZeRO-3 engine over the same group).
    """

    state_dir = export.POLICY_DIR
    rollout: ColocatedEngine | None = None
    """This rank's own rollout engine when the rollout is colocated
    (`rlhf_trainer.rollout.colocated`)."""

    def _build(self, total_optimizer_steps: int) -> None:
        model = with_activation_checkpointing(
            build_causal_lm(self.spec.model, self.seed, self.dtype, self._config(True)),
            self.spec.model.activation_checkpointing,
        )
        self.engine = self._training_engine(
            model, self.spec.algorithm.policy_learning_rate, total_optimizer_steps
        )
        self.reference = None
        if self.spec.roles.reference is None and self.spec.algorithm.kl_coef > 0:
            ref = build_reference(self.spec.model, self.seed, self.dtype, self._config(False))
            self.reference = self._inference_engine(ref)
        if self.spec.roles.rollout.colocated:
            # Built last, so vLLM sizes its KV cache from what the trainer leaves free.
            self.rollout = ColocatedEngine(self.spec, self.rank, self.device)

    def _for_training(self) -> None:
        if self.rollout is not None:
            self.rollout.for_training(self.engine)

    def _before_snapshot(self) -> None:
        self._for_training()

    # -- colocated rollout (see rlhf_trainer.rollout.colocated) --------------------------------

    def _colocated(self) -> ColocatedEngine:
        if self.rollout is None:
            raise RuntimeError("this job's rollout is not colocated")
        return self.rollout

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        """Sample with this rank's own engine (the trainer's state makes room first)."""
        return self._colocated().generate(self.engine, prompts, sampling)

    def update_rollout_engine(self, version: int) -> dict[str, Any]:
        """Load the current weights into this rank's engine as `version` (every rank calls it:
        the ZeRO-3 gathers are collective)."""
        rollout = self._colocated()
        self._for_training()
        return rollout.load(self.engine.module, version)

    def rollout_holds_weights(self) -> bool:
        return self._colocated().holds_weights()  # else it needs a load before it generates

    def colocation_report(self) -> dict[str, Any]:
        """Time this rank spent handing memory between trainer and engine, by kind, and the
        peak GPU memory of each mode."""
        r = self._colocated()
        return {"seconds": dict(r.seconds), "peak_memory_bytes": dict(r.peak_memory)}

    # -- training -----------------------------------------------------------------------------

    def logprobs(self, batch: Batch) -> Tensor:
        """Current-policy log-probs of this rank's shard (for the old log-probs of a rollout)."""
        self._for_training()
        self.engine.eval()
        return _sequence_logprobs(self.engine, self._shard(batch), self.spec)

    def reference_logprobs(self, batch: Batch) -> Tensor:
        if self.reference is None:
            raise RuntimeError("this job has no reference model on the trainer (klCoef is 0)")
        self._for_training()
        return _sequence_logprobs(self.reference, self._shard(batch), self.spec)

    def train(self, batch: Batch) -> dict[str, float]:
        """`updateEpochs` optimizer steps on the batch; returns group-wide mean metrics.

        Needs fields ``old_logprobs`` and ``advantages`` (and ``ref_logprobs`` for a KL loss).
        Each micro-batch's loss is scaled so that the accumulated, rank-averaged gradient is
        that of the spec's aggregation (a token mean by default) over the *whole* batch,
        however rows fall into shards (`losses.PolicyObjective`).
        """
        algorithm = self.spec.algorithm
        shard = self._shard(batch)
        objective = PolicyObjective(algorithm)
        scale = self.plan.loss_scale(objective.units(batch.action_mask))

        self._for_training()
        self.engine.train()
        sums: dict[str, float] = {}
        grad_norms = []
        for _epoch in range(algorithm.update_epochs):
            for micro in shard.micro_batches(algorithm.micro_batch_size):
                tokens = float(micro.action_mask.sum())
                logprobs, entropies = next_token_scores(
                    self.engine, micro, algorithm.temperature, self.spec.model
                )
                micro_loss = objective(logprobs, entropies, micro.fields, micro.action_mask)
                self.engine.backward(micro_loss.loss * micro_loss.units * scale)
                self.engine.step()
                for name, value in micro_loss.terms.items():
                    sums[name] = sums.get(name, 0.0) + float(value.detach()) * tokens
            grad_norms.append(float(self.engine.get_global_grad_norm() or 0.0))
        tokens_seen = float(shard.num_action_tokens * algorithm.update_epochs)
        metrics = self._global_means(sums, tokens_seen)
        metrics["grad_norm"] = grad_norms[-1]
        metrics["learning_rate"] = float(self.engine.get_lr()[0])
        return metrics

    def local_parameter_count(self) -> int:
        """Parameter elements this rank stores: its ZeRO-3 shard, not the whole model."""
        return sum(param.ds_tensor.numel() for param in self.engine.module.parameters())

    def state_dict(self) -> dict[str, Tensor] | None:
        """All full parameters, copied, on rank 0 (None on the others). Every rank must call it."""
        gathered = {}
        for name, tensor in sync_plan.iter_zero3_parameters(self.engine.module):
            if self.rank == 0:
                gathered[name] = tensor.detach().to("cpu", copy=True)
        return gathered if self.rank == 0 else None

    # -- weight sync to the rollout engines (rank 0 sends; see rlhf_trainer.rollout.weight_sync)
    # -----

    sender: ws.WeightSyncSender | None = None

    def open_weight_sync(
        self, world_size: int, timeout_s: float = 120.0, connect_timeout_s: float = 600.0
    ) -> ws.SyncGroupInfo:
        """Rank 0: open a new sync group's store for `world_size` ranks (this one included).

        The previous group, if any, is closed first: the driver builds a new group whenever the
        set of rollout engines changes (and an adopted rank may hold a dead driver's group).
        """
        self.close_weight_sync()
        self.sender = ws.WeightSyncSender(
            world_size,
            backend="nccl" if self.on_gpu else "gloo",
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
        )
        return self.sender.info

    def close_weight_sync(self) -> None:
        sender: ws.WeightSyncSender | None = getattr(self, "sender", None)
        if sender is not None:
            sender.close()
        self.sender = None

    def connect_weight_sync(self) -> None:
        """Rank 0: wait until every rollout worker has joined the sync group."""
        if self.sender is None:
            raise ws.WeightSyncError("open_weight_sync() first")
        self.sender.connect()

    def weight_sync_plan(self, version: int) -> sync_plan.SyncPlan:
        """The bucket layout of a sync, from parameter metadata only (no gather)."""
        bucket_bytes = sync_plan.DEFAULT_BUCKET_BYTES if self.on_gpu else CPU_SYNC_BUCKET_BYTES
        metadata = sync_plan.zero3_parameter_metadata(self.engine.module)
        return sync_plan.plan_weight_sync(metadata, version, bucket_bytes)

    def send_weights(self, plan: sync_plan.SyncPlan) -> ws.SyncStats | None:
        """Gather parameters a module at a time (all ranks); rank 0 broadcasts them.

        The gathers are collective, so every rank runs the iterator to its end, rank 0 too when
        its send fails part-way (a rollout engine died): otherwise the other ranks would wait
        in a gather forever and the next call would pair mismatched collectives.
        """
        parameters = sync_plan.iter_zero3_parameters(self.engine.module)
        try:
            if self.rank == 0:
                if self.sender is None:
                    raise ws.WeightSyncError("open_weight_sync() first")
                return self.sender.send(plan, parameters)
            return None
        finally:
            for _ in parameters:
                pass

    def _output(self, engine: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return engine(input_ids=input_ids, attention_mask=attention_mask).logits

    def load(self, directory: str, step: int) -> None:
        """The policy's state from checkpoint `directory` of training step `step`."""
        self._for_training()
        self._load_engine(self.engine, Path(directory) / export.POLICY_DIR, step)


class ReferenceWorker(ZeroWorker):
    """A rank of the reference role: the frozen initial policy, sharded with ZeRO-3."""

    def _build(self, total_optimizer_steps: int) -> None:
        del total_optimizer_steps
        self.reference = self._inference_engine(
            build_reference(self.spec.model, self.seed, self.dtype, self._config(False))
        )

    def reference_logprobs(self, batch: Batch) -> Tensor:
        return _sequence_logprobs(self.reference, self._shard(batch), self.spec)

    def load(self, directory: str, step: int) -> None:
        """Nothing to load: the reference is rebuilt from the spec, on any number of ranks."""


class CriticWorker(ZeroWorker):
    """A critic rank (PPO): per-token values and the clipped value-regression update."""

    state_dir = "critic"

    def _build(self, total_optimizer_steps: int) -> None:
        model = with_activation_checkpointing(
            build_critic(self.spec.model, self.seed, self.dtype, self._config(True)),
            self.spec.model.activation_checkpointing,
        )
        self.engine = self._training_engine(
            model, self.spec.algorithm.critic_learning_rate, total_optimizer_steps
        )

    def values(self, batch: Batch) -> Tensor:
        """Value estimates on the next-token grid, ``[rows, L - 1]`` for this rank's shard."""
        self.engine.eval()
        parts = []
        with torch.no_grad():
            for micro in self._shard(batch).micro_batches(self.spec.algorithm.micro_batch_size):
                values = self.engine(micro.input_ids, micro.attention_mask)
                parts.append(values[:, :-1])
        return torch.cat(parts).cpu()

    def train(self, batch: Batch) -> dict[str, float]:
        """`updateEpochs` steps regressing values on ``returns`` (fields ``old_values``, ...)."""
        algorithm = self.spec.algorithm
        shard = self._shard(batch)
        scale = self.plan.loss_scale(batch.num_action_tokens)
        self.engine.train()
        sums: dict[str, float] = {}
        for _epoch in range(algorithm.update_epochs):
            for micro in shard.micro_batches(algorithm.micro_batch_size):
                tokens = float(micro.action_mask.sum())
                values = self.engine(micro.input_ids, micro.attention_mask)[:, :-1]
                result = alg.value_loss(
                    values,
                    micro.fields["old_values"],
                    micro.fields["returns"],
                    micro.action_mask,
                    clip_range=algorithm.value_clip_range,
                )
                self.engine.backward(result.loss * tokens * scale)
                self.engine.step()
                sums["value_loss"] = sums.get("value_loss", 0.0) + float(result.loss) * tokens
                sums["value_clip_fraction"] = (
                    sums.get("value_clip_fraction", 0.0) + float(result.clip_fraction) * tokens
                )
        return self._global_means(sums, float(shard.num_action_tokens * algorithm.update_epochs))

    def _output(self, engine: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return engine(input_ids, attention_mask)

    def load(self, directory: str, step: int) -> None:
        """The critic's state from checkpoint `directory` of training step `step`."""
        self._load_engine(self.engine, Path(directory) / "critic", step)
