"""GPU check: ZeRO-3 trainer -> weight sync over NCCL -> vLLM, then greedy outputs must agree.

Runs on one machine with Ray (started here), see docs/gpu-validation.md:

1. A DeepSpeed ZeRO-3 trainer actor (NCCL default group, world size 1, bf16) builds a Qwen2 model
   from a config (random weights) and trains it for a few steps on a counting pattern, so its
   greedy continuations are confident (random weights give near-ties that bf16 kernel
   differences would flip).
2. A vLLM engine actor from `create_rollout_engines` starts from vLLM's dummy weights.
3. The trainer opens the weight-sync group (trainer + the engine's workers); weights are
   gathered a layer at a time and broadcast in buckets (`rlhf_trainer.rollout.weight_sync`), several
   times; then bare broadcasts of the same bytes on the same group give the ceiling.
4. Greedy continuations of the same prompts from vLLM (before and after the sync) and from the
   trainer's model are compared token for token; vLLM's log-probs are compared with the
   trainer's teacher-forced log-probs of the same tokens.
5. Rollout throughput: the same batch of sampled requests through the engine actor's
   ``generate`` (the path the trainer uses) and through a bare ``vllm.LLM.generate`` in the
   same process (the ceiling).

Prints one JSON object (also written to ``--json-out`` after every phase, with the error and
its traceback if a phase fails); exits 1 if vLLM's greedy output after the sync differs from
the trainer's, 3 on an error. NCCL needs 2 GPUs (one per side: NCCL refuses two ranks of one
communicator on the same GPU); with 1 GPU use ``--sync-backend gloo``. ``--device cpu`` runs
the same orchestration on CPU (HF engine, gloo, float32) as a smoke test of this script.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import ray
import torch

from rlhf_trainer.rollout.base import SamplingParams
from rlhf_trainer.rollout.engines import RolloutEngineActor, create_rollout_engines
from rlhf_trainer.rollout.model_source import ModelSource
from rlhf_trainer.rollout.sync_plan import SyncPlan, plan_weight_sync
from rlhf_trainer.rollout.weight_sync import Backend

SHAPES: dict[str, dict[str, Any]] = {
    # The shape of Qwen2.5-0.5B (random weights; nothing is downloaded).
    "0.5b": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "tiny": {
        "model_type": "qwen2",
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
}
PATTERN_LOW, PATTERN_SPAN = 1000, 64
"""The counting pattern: token t+1 = LOW + (token t - LOW + 1) mod SPAN."""
TRAIN_BATCH, TRAIN_SEQ_LEN = 16, 48
# Keep NVLink multicast off wherever NCCL runs (shared hosts; see docs/gpu-validation.md), and
# give every actor vLLM's NCCL_CUMEM_ENABLE=0: NCCL peers that disagree on it can hang.
ACTOR_ENV = {
    "NCCL_CUMEM_ENABLE": "0",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


def counting(start: int, length: int) -> list[int]:
    return [PATTERN_LOW + (start + i) % PATTERN_SPAN for i in range(length)]


def follows_pattern(prompt: list[int], completion: list[int]) -> float:
    """Fraction of completion tokens that continue the counting pattern."""
    expected = counting(prompt[-1] - PATTERN_LOW + 1, len(completion))
    return sum(a == b for a, b in zip(completion, expected, strict=True)) / max(1, len(completion))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Report:
    """The JSON result, rewritten to `path` whenever it changes (partial results survive)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def update(self, **values: Any) -> None:
        self.data.update(values)
        self.save()

    def save(self) -> None:
        if self.path:
            partial = Path(self.path + ".tmp")
            partial.write_text(json.dumps(self.data, indent=2))
            partial.replace(self.path)


class ZeroTrainer:
    """Trainer rank 0 of a world-size-1 DeepSpeed ZeRO-3 group, plus the weight-sync sender."""

    def __init__(
        self, config: dict[str, Any], dtype: str, seed: int, lr: float, device: str
    ) -> None:
        import deepspeed
        import torch.distributed as dist

        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(0)  # Ray gives this actor its own CUDA_VISIBLE_DEVICES
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
        )
        deepspeed.init_distributed(
            dist_backend="nccl" if self.device.type == "cuda" else "gloo",
            auto_mpi_discovery=False,
            verbose=False,
        )
        assert dist.is_initialized()
        model = ModelSource(config=config, seed=seed, dtype="float32").build()
        ds_config = {
            "train_micro_batch_size_per_gpu": TRAIN_BATCH,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "bf16": {"enabled": dtype == "bfloat16"},
            # Partition every parameter, however small, so the sync really gathers.
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            # torch's AdamW: no JIT-built fused kernels needed.
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True},
            },
            "zero_allow_untested_optimizer": True,
        }
        self.engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        self.sender: Any = None

    def ready(self) -> str:
        return str(next(self.engine.module.parameters()).dtype)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def train(self, steps: int, seed: int) -> list[float]:
        generator = torch.Generator().manual_seed(seed)
        self.engine.train()
        losses = []
        for _ in range(steps):
            starts = torch.randint(0, PATTERN_SPAN, (TRAIN_BATCH,), generator=generator).tolist()
            ids = torch.tensor([counting(s, TRAIN_SEQ_LEN) for s in starts], device=self.device)
            loss = self.engine(input_ids=ids, labels=ids).loss
            self.engine.backward(loss)
            self.engine.step()
            losses.append(float(loss))
        self.engine.eval()
        return losses

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        """The trainer model's own greedy continuations (full recompute per token), with the
        margin between the top two logits at every step (small margins are near-ties)."""
        tokens, margins = [], []
        for prompt in prompts:
            ids = torch.tensor([prompt], device=self.device)
            step_margins = []
            for _ in range(max_tokens):
                logits = self.engine(input_ids=ids).logits[0, -1].float()
                top = logits.topk(2)
                step_margins.append(float(top.values[0] - top.values[1]))
                ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
            tokens.append(ids[0, len(prompt) :].tolist())
            margins.append(step_margins)
        return {"tokens": tokens, "margins": margins}

    @torch.no_grad()
    def logprobs(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probs (temperature 1) of `completions`."""
        from rlhf_trainer.modeling.logprobs import logprobs_from_logits

        results = []
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = torch.tensor([prompt + completion], device=self.device)
            logits = self.engine(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            results.append(logprobs_from_logits(logits, ids[0, len(prompt) :]).tolist())
        return results

    def metadata(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        from rlhf_trainer.rollout.sync_plan import zero3_parameter_metadata

        return zero3_parameter_metadata(self.engine.module)

    def open_sync(self, world_size: int, backend: Backend, timeout_s: float) -> Any:
        from rlhf_trainer.rollout.weight_sync import WeightSyncSender, default_host

        device = self.device if backend == "nccl" else torch.device("cpu")
        self.sender = WeightSyncSender(
            world_size, backend=backend, host=default_host(), timeout_s=timeout_s, device=device
        )
        return self.sender.info

    def connect_sync(self) -> None:
        self.sender.connect()

    def send(self, plan: SyncPlan) -> dict[str, Any]:
        """One sync; ``seconds`` is the sender's own figure, ``synced_seconds`` the same call
        bracketed by device synchronisation (what the bare broadcast is timed with)."""
        from rlhf_trainer.rollout.sync_plan import iter_zero3_parameters

        self._synchronize()
        start = time.perf_counter()
        stats = self.sender.send(plan, iter_zero3_parameters(self.engine.module)).to_dict()
        self._synchronize()
        stats["synced_seconds"] = time.perf_counter() - start
        return stats

    def broadcast_bytes(self, nbytes: int, repeats: int) -> list[float]:
        return self.sender.broadcast_bytes(nbytes, repeats)


def bare_vllm_generate(actor: Any, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Runs inside the engine actor (``__ray_call__``): the same requests straight through
    ``vllm.LLM.generate`` (no log-probs, no conversion): [seconds, generated tokens]."""
    from vllm import SamplingParams as VLLMSamplingParams

    params = VLLMSamplingParams(
        n=1, temperature=1.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    requests = [{"prompt_token_ids": list(prompt)} for prompt in prompts]
    start = time.perf_counter()
    outputs = actor.engine._llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return [seconds, float(sum(len(output.outputs[0].token_ids) for output in outputs))]


def run(args: argparse.Namespace, report: Report) -> int:
    on_cpu = args.device == "cpu"
    gpus = 0 if on_cpu else torch.cuda.device_count()
    backend: Backend = args.sync_backend
    if args.sync_backend == "auto":
        backend = "nccl" if gpus >= 2 else "gloo"
    if on_cpu and backend == "nccl":
        raise SystemExit("--device cpu syncs over gloo")
    if not on_cpu and (gpus < 1 or (backend == "nccl" and gpus < 2)):
        raise RuntimeError(
            f"{gpus} GPUs: an NCCL sync needs 2 (NCCL refuses two ranks on one GPU); "
            "use --sync-backend gloo on one GPU"
        )
    dtype = "float32" if on_cpu else args.dtype
    shared_gpu = not on_cpu and gpus < 2  # trainer and vLLM share GPU 0
    memory = args.gpu_memory_utilization or (0.4 if shared_gpu else 0.85)
    config = SHAPES[args.shape]
    engine_backend = "hf" if on_cpu else "vllm"
    report.update(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        argv=sys.argv[1:],
        phase="start",
        shape=args.shape,
        dtype=dtype,
        device=args.device,
        engine_backend=engine_backend,
        sync_backend=backend,
        gpus=gpus,
        gpu_name=torch.cuda.get_device_name(0) if gpus else None,
        torch=torch.__version__,
        nccl=".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
        ray=ray.__version__,
        vllm=package_version("vllm"),
        deepspeed=package_version("deepspeed"),
        transformers=package_version("transformers"),
        gpu_memory_utilization=memory,
    )

    env = dict(ACTOR_ENV)
    if os.environ.get("PYTHONPATH"):  # vLLM's engine process imports rlhf_trainer too
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    os.environ.update(env)
    # A private single-node cluster: no auth token to set up, no usage reporting (no network).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Give a slow or busy node time to start its agents (Ray's default is 15 s).
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
    ray.init(
        num_cpus=args.ray_cpus,
        resources={"rlhf-role-rollout": 1},
        runtime_env={"env_vars": env},
        include_dashboard=False,
    )

    started = time.perf_counter()
    trainer_gpus = 0 if on_cpu else (0.5 if shared_gpu else 1)
    trainer: Any = (
        ray.remote(ZeroTrainer)
        .options(num_gpus=trainer_gpus)
        .remote(config, dtype, args.seed, args.lr, args.device)
    )
    source = ModelSource(config=config, dtype=dtype, seed=args.seed)
    engine_gpus = 0 if on_cpu else (0.5 if shared_gpu else None)
    try:
        from rlhfjob.api import RolloutRoleSpec

        spec = RolloutRoleSpec(
            replicas=1,
            gpus=0 if on_cpu else 1,
            backend=engine_backend,
            gpu_memory_utilization=memory,
        )
        (engine,) = create_rollout_engines(
            spec,
            source,
            count=1,
            seed=args.seed,
            enforce_eager=args.enforce_eager,
            num_gpus=engine_gpus,
        )
        report.update(engine_factory="create_rollout_engines")
    except ImportError:  # rlhfjob.api needs pydantic and cel-python, which the image may lack
        options: dict[str, Any] = {}
        if engine_backend == "vllm":
            options = {"gpu_memory_utilization": memory, "enforce_eager": args.enforce_eager}
        engine = (
            ray.remote(RolloutEngineActor)
            .options(
                num_gpus=1 if engine_gpus is None else engine_gpus,
                resources={"rlhf-role-rollout": 1},
            )
            .remote(engine_backend, source, options)
        )
        report.update(engine_factory="RolloutEngineActor (rlhfjob.api not importable)")

    # Both start concurrently; record when each is up.
    pending = {engine.policy_version.remote(): "engine", trainer.ready.remote(): "trainer"}
    while pending:
        (ready,), _ = ray.wait(list(pending), num_returns=1)
        name = pending.pop(ready)
        value = ray.get(ready)
        report.update(**{f"{name}_start_seconds": round(time.perf_counter() - started, 1)})
        if name == "trainer":
            report.update(trainer_param_dtype=value)
    report.update(phase="train")

    begun = time.perf_counter()
    losses = ray.get(trainer.train.remote(args.train_steps, args.seed))
    report.update(
        train_seconds=round(time.perf_counter() - begun, 1),
        train_steps=args.train_steps,
        train_loss_first_last=[round(losses[0], 4), round(losses[-1], 4)],
        phase="greedy before sync",
    )

    generator = torch.Generator().manual_seed(args.seed + 1)
    prompts = [
        counting(int(torch.randint(0, PATTERN_SPAN, (1,), generator=generator)), length)
        for length in torch.randint(4, 13, (args.prompts,), generator=generator).tolist()
    ]
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=args.max_tokens)
    trainer_result = ray.get(trainer.greedy.remote(prompts, args.max_tokens))
    trainer_greedy, margins = trainer_result["tokens"], trainer_result["margins"]
    before = [c[0].token_ids for c in ray.get(engine.generate.remote(prompts, greedy))]
    report.update(
        greedy_match_before_sync=before == trainer_greedy,
        pattern_accuracy_trainer=round(
            statistics.mean(
                follows_pattern(p, c) for p, c in zip(prompts, trainer_greedy, strict=True)
            ),
            4,
        ),
        trainer_min_top2_margin=round(min(min(m) for m in margins), 4),
        phase="join sync group",
    )

    # Join the sync group: rank 0 is the trainer, ranks 1.. the engine's workers.
    world_size = 1 + ray.get(engine.weight_sync_ranks.remote())
    info = ray.get(trainer.open_sync.remote(world_size, backend, args.timeout_s))
    begun = time.perf_counter()
    ray.get([trainer.connect_sync.remote(), engine.init_weight_sync.remote(info, 1)])
    report.update(sync_join_seconds=round(time.perf_counter() - begun, 2), phase="syncs")

    metadata = ray.get(trainer.metadata.remote())
    bucket_bytes = args.bucket_mib * 2**20
    sent_all: list[dict[str, Any]] = []
    receive_seconds: list[float] = []
    wall_seconds: list[float] = []
    version = 0
    plan: SyncPlan | None = None
    for version in range(1, args.syncs + 2):
        plan = plan_weight_sync(metadata, version, bucket_bytes)
        begun = time.perf_counter()
        sent, received = ray.get([trainer.send.remote(plan), engine.receive_weights.remote(plan)])
        wall = time.perf_counter() - begun
        if version == 1:  # the first sync allocates buffers and warms NCCL up
            report.update(first_sync_wall_seconds=round(wall, 4))
            continue
        wall_seconds.append(wall)
        sent_all.append(sent)
        receive_seconds.append(received.seconds)
    assert plan is not None
    total_bytes = plan.total_bytes
    sync_synced = [s["synced_seconds"] for s in sent_all]
    report.update(
        params=sum(int(torch.Size(shape).numel()) for _, shape, _ in metadata),
        tensors=plan.num_tensors,
        sync_bytes=total_bytes,
        bucket_bytes=bucket_bytes,
        buckets=len(plan.buckets),
        sync_seconds=[round(s, 4) for s in sync_synced],
        sync_seconds_median=round(median(sync_synced), 4),
        sync_sender_reported_seconds_median=round(median([s["seconds"] for s in sent_all]), 4),
        sync_receive_seconds_median=round(median(receive_seconds), 4),
        sync_wall_seconds_median=round(median(wall_seconds), 4),
        phase="bare broadcast",
    )
    bare, _ = ray.get(
        [
            trainer.broadcast_bytes.remote(total_bytes, args.syncs + 1),
            engine.broadcast_bytes.remote(total_bytes, args.syncs + 1),
        ]
    )
    bare = bare[1:]  # the first allocates and warms up
    sync_median, bare_median = median(sync_synced), median(bare)
    report.update(
        bare_broadcast_seconds=[round(s, 4) for s in bare],
        bare_broadcast_seconds_median=round(bare_median, 4),
        sync_GBps=round(total_bytes / sync_median / 1e9, 2),
        bare_GBps=round(total_bytes / bare_median / 1e9, 2),
        sync_fraction_of_bare=round(bare_median / sync_median, 3),
        phase="greedy after sync",
    )

    after = ray.get(engine.generate.remote(prompts, greedy))
    after_ids = [c[0].token_ids for c in after]
    trainer_logprobs = ray.get(trainer.logprobs.remote(prompts, after_ids))
    logprob_diff = max(
        abs(a - b)
        for completions, reference in zip(after, trainer_logprobs, strict=True)
        for a, b in zip(completions[0].logprobs, reference, strict=True)
    )
    mismatches = [
        {
            "prompt": i,
            "position": t,
            "vllm": a,
            "trainer": b,
            "trainer_top2_margin": round(margins[i][t], 4),
        }
        for i, (ours, theirs) in enumerate(zip(after_ids, trainer_greedy, strict=True))
        for t, (a, b) in enumerate(zip(ours, theirs, strict=True))
        if a != b
    ]
    agreement = 1 - len(mismatches) / (len(prompts) * args.max_tokens)
    report.update(
        prompts=len(prompts),
        max_tokens=args.max_tokens,
        policy_version_reported=after[0][0].policy_version,
        greedy_match=after_ids == trainer_greedy,
        greedy_token_agreement=round(agreement, 4),
        greedy_first_mismatches=mismatches[:10],
        pattern_accuracy_vllm=round(
            statistics.mean(follows_pattern(p, c) for p, c in zip(prompts, after_ids, strict=True)),
            4,
        ),
        max_abs_logprob_diff=round(logprob_diff, 5),
        example_prompt=prompts[0],
        example_vllm_greedy=after_ids[0],
    )
    passed = bool(report.data["greedy_match"]) and after[0][0].policy_version == version
    report.update(check_passed=passed)  # the verdict, before the throughput runs

    if args.throughput_repeats > 0:
        report.update(phase="throughput")
        throughput(args, report, engine, config["vocab_size"], engine_backend == "vllm")
    report.update(phase="done", passed=passed)
    return 0 if passed else 1


def throughput(
    args: argparse.Namespace, report: Report, engine: Any, vocab_size: int, bare: bool
) -> None:
    """Sampled rollouts of random prompts (fresh ones every run, so no prefix-cache hits):
    through the engine actor, then straight through vLLM; medians after one warm-up run."""
    requests, prompt_len, max_tokens = (
        args.throughput_requests,
        args.throughput_prompt_len,
        args.throughput_max_tokens,
    )
    generator = torch.Generator().manual_seed(args.seed + 2)

    def batch() -> list[list[int]]:
        return torch.randint(0, vocab_size, (requests, prompt_len), generator=generator).tolist()

    sampling = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=max_tokens)
    engine_rates: list[float] = []
    engine_seconds: list[float] = []
    for repeat in range(args.throughput_repeats + 1):
        prompts = batch()
        begun = time.perf_counter()
        results = ray.get(engine.generate.remote(prompts, sampling))
        seconds = time.perf_counter() - begun
        tokens = sum(len(c.token_ids) for completions in results for c in completions)
        if repeat:
            engine_seconds.append(seconds)
            engine_rates.append(tokens / seconds)
    report.update(
        throughput_requests=requests,
        throughput_prompt_tokens=prompt_len,
        throughput_generated_tokens_per_request=max_tokens,
        engine_generate_seconds=[round(s, 3) for s in engine_seconds],
        engine_generated_tokens_per_s_median=round(median(engine_rates)),
    )
    if not bare:
        return
    bare_rates: list[float] = []
    bare_seconds: list[float] = []
    for repeat in range(args.throughput_repeats + 1):
        call = engine.__ray_call__.remote(bare_vllm_generate, batch(), max_tokens)
        seconds, tokens = ray.get(call)
        if repeat:
            bare_seconds.append(seconds)
            bare_rates.append(tokens / seconds)
    report.update(
        bare_vllm_generate_seconds=[round(s, 3) for s in bare_seconds],
        bare_vllm_generated_tokens_per_s_median=round(median(bare_rates)),
        engine_fraction_of_bare_vllm=round(median(engine_rates) / median(bare_rates), 3),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--sync-backend", choices=["auto", "nccl", "gloo"], default="auto")
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--syncs", type=int, default=5, help="timed syncs (after one warm-up)")
    parser.add_argument("--train-steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--enforce-eager", action="store_true", help="skip vLLM's compile/graphs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--throughput-requests", type=int, default=512)
    parser.add_argument("--throughput-prompt-len", type=int, default=128)
    parser.add_argument("--throughput-max-tokens", type=int, default=256)
    parser.add_argument("--throughput-repeats", type=int, default=3, help="0: skip")
    parser.add_argument("--ray-cpus", type=int, default=None)
    parser.add_argument("--json-out", default=None, help="also write the JSON here, per phase")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    report = Report(args.json_out)
    try:
        status = run(args, report)
    except BaseException as error:  # keep what was measured, and why it stopped
        report.update(
            passed=False, error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc()
        )
        status = 3
    finally:
        if ray.is_initialized():
            ray.shutdown()
    print(json.dumps(report.data, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
