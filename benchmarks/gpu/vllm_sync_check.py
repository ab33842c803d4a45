"""GPU check: ZeRO-3 trainer -> weight sync over NCCL -> vLLM, then greedy outputs must agree.

Runs on one machine with Ray (started here), see docs/gpu-validation.md:

1. A DeepSpeed ZeRO-3 trainer actor (NCCL default group, world size 1, bf16) builds a Qwen2 model
   from a config (random weights) and trains it for a few steps on a counting pattern, so its
   greedy continuations are confident (random weights give near-ties that bf16 kernel
   differences would flip).
2. A vLLM engine actor from `create_rollout_engines` starts from vLLM's dummy weights.
3. The trainer opens the weight-sync group (trainer + the engine's workers); weights are
   gathered a layer at a time and broadcast in buckets (`rlhf_trainer.weight_sync`), several
   times; then one bare broadcast of the same bytes on the same group gives the ceiling.
4. Greedy continuations of the same prompts from vLLM (before and after the sync) and from the
   trainer's model are compared token for token; vLLM's log-probs are compared with the
   trainer's teacher-forced log-probs of the same tokens.

Prints one JSON object; exits 1 if vLLM's greedy output after the sync differs from the
trainer's. Needs 2 GPUs for NCCL (one per side); with 1 GPU use ``--sync-backend gloo``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

import ray
import torch

from rlhf_trainer.engines import ModelSource, RolloutEngineActor, create_rollout_engines
from rlhf_trainer.rollout import SamplingParams
from rlhf_trainer.weight_sync import Backend, SyncPlan, plan_weight_sync

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


class ZeroTrainer:
    """Trainer rank 0 of a world-size-1 DeepSpeed ZeRO-3 group, plus the weight-sync sender."""

    def __init__(self, config: dict[str, Any], dtype: str, seed: int, lr: float) -> None:
        import deepspeed
        import torch.distributed as dist

        from rlhf_trainer.engines import build_causal_lm

        torch.cuda.set_device(0)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
        )
        deepspeed.init_distributed(dist_backend="nccl")
        assert dist.is_initialized()
        model = build_causal_lm(ModelSource(config=config, seed=seed, dtype="float32"))
        ds_config = {
            "train_micro_batch_size_per_gpu": 16,
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

    def train(self, steps: int, seq_len: int, seed: int) -> list[float]:
        generator = torch.Generator().manual_seed(seed)
        self.engine.train()
        losses = []
        for _ in range(steps):
            starts = torch.randint(0, PATTERN_SPAN, (16,), generator=generator).tolist()
            ids = torch.tensor([counting(s, seq_len) for s in starts], device="cuda")
            loss = self.engine(input_ids=ids, labels=ids).loss
            self.engine.backward(loss)
            self.engine.step()
            losses.append(float(loss))
        self.engine.eval()
        return losses

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """The trainer model's own greedy continuations (full recompute per token)."""
        results = []
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            for _ in range(max_tokens):
                logits = self.engine(input_ids=ids).logits[0, -1].float()
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
            results.append(ids[0, len(prompt) :].tolist())
        return results

    @torch.no_grad()
    def logprobs(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probs (temperature 1) of `completions`."""
        from rlhf_trainer.algorithms import logprobs_from_logits

        results = []
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = torch.tensor([prompt + completion], device="cuda")
            logits = self.engine(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            results.append(logprobs_from_logits(logits, ids[0, len(prompt) :]).tolist())
        return results

    def metadata(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        from rlhf_trainer.weight_sync import zero3_parameter_metadata

        return zero3_parameter_metadata(self.engine.module)

    def open_sync(self, world_size: int, backend: Backend, timeout_s: float) -> Any:
        from rlhf_trainer.weight_sync import WeightSyncSender, default_host

        device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        self.sender = WeightSyncSender(
            world_size, backend=backend, host=default_host(), timeout_s=timeout_s, device=device
        )
        return self.sender.info

    def connect_sync(self) -> None:
        self.sender.connect()

    def send(self, plan: SyncPlan) -> dict[str, Any]:
        from rlhf_trainer.weight_sync import iter_zero3_parameters

        torch.cuda.synchronize()
        return self.sender.send(plan, iter_zero3_parameters(self.engine.module)).to_dict()

    def broadcast_bytes(self, nbytes: int, repeats: int) -> list[float]:
        return self.sender.broadcast_bytes(nbytes, repeats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--sync-backend", choices=["auto", "nccl", "gloo"], default="auto")
    parser.add_argument("--bucket-mib", type=int, default=256)
    parser.add_argument("--syncs", type=int, default=5, help="timed syncs (after one warm-up)")
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--enforce-eager", action="store_true", help="skip vLLM's compile/graphs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    gpus = torch.cuda.device_count()
    backend: Backend = args.sync_backend
    if args.sync_backend == "auto":
        backend = "nccl" if gpus >= 2 else "gloo"
    if gpus < 1 or (backend == "nccl" and gpus < 2):
        print(json.dumps({"error": f"{gpus} GPUs: NCCL sync needs 2 (one per side)"}))
        return 2
    shared_gpu = gpus < 2  # trainer and vLLM share GPU 0
    memory = args.gpu_memory_utilization or (0.4 if shared_gpu else 0.85)
    config = SHAPES[args.shape]

    # vLLM's workers run with NCCL_CUMEM_ENABLE=0; the trainer must match or NCCL can hang.
    env = {"NCCL_CUMEM_ENABLE": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    os.environ.update(env)
    ray.init(resources={"rlhf-role-rollout": 1}, runtime_env={"env_vars": env})
    report: dict[str, Any] = {
        "shape": args.shape,
        "dtype": args.dtype,
        "sync_backend": backend,
        "gpus": gpus,
        "torch": torch.__version__,
    }

    started = time.perf_counter()
    trainer_gpus = 0.5 if shared_gpu else 1
    trainer = (
        ray.remote(ZeroTrainer)
        .options(num_gpus=trainer_gpus)
        .remote(config, args.dtype, args.seed, args.lr)
    )
    source = ModelSource(config=config, dtype=args.dtype, seed=args.seed)
    engine_options = {"gpu_memory_utilization": memory, "enforce_eager": args.enforce_eager}
    try:
        from rlhfjob.api import RolloutRoleSpec

        spec = RolloutRoleSpec(replicas=1, gpus=1, backend="vllm", gpu_memory_utilization=memory)
        (engine,) = create_rollout_engines(
            spec,
            source,
            count=1,
            seed=args.seed,
            enforce_eager=args.enforce_eager,
            num_gpus=0.5 if shared_gpu else None,
        )
        report["engine_factory"] = "create_rollout_engines"
    except ImportError:  # rlhfjob.api needs pydantic and cel-python, which the image may lack
        engine = (
            ray.remote(RolloutEngineActor)
            .options(num_gpus=0.5 if shared_gpu else 1, resources={"rlhf-role-rollout": 1})
            .remote("vllm", source, engine_options)
        )
        report["engine_factory"] = "RolloutEngineActor (rlhfjob.api not importable)"
    ray.get(engine.policy_version.remote())
    ray.get(trainer.metadata.remote())
    report["startup_seconds"] = round(time.perf_counter() - started, 1)

    losses = ray.get(trainer.train.remote(args.train_steps, 48, args.seed))
    report["train_loss_first_last"] = [round(losses[0], 4), round(losses[-1], 4)]

    generator = torch.Generator().manual_seed(args.seed + 1)
    prompts = [
        counting(int(torch.randint(0, PATTERN_SPAN, (1,), generator=generator)), length)
        for length in torch.randint(4, 13, (args.prompts,), generator=generator).tolist()
    ]
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=args.max_tokens)
    trainer_greedy = ray.get(trainer.greedy.remote(prompts, args.max_tokens))
    before = [c[0].token_ids for c in ray.get(engine.generate.remote(prompts, greedy))]

    # Join the sync group: rank 0 is the trainer, ranks 1.. the engine's workers.
    world_size = 1 + ray.get(engine.weight_sync_ranks.remote())
    info = ray.get(trainer.open_sync.remote(world_size, backend, args.timeout_s))
    ray.get([trainer.connect_sync.remote(), engine.init_weight_sync.remote(info, 1)])

    metadata = ray.get(trainer.metadata.remote())
    bucket_bytes = args.bucket_mib * 2**20
    send_seconds, receive_seconds, wall_seconds = [], [], []
    for version in range(1, args.syncs + 2):
        plan = plan_weight_sync(metadata, version, bucket_bytes)
        begun = time.perf_counter()
        sent, received = ray.get([trainer.send.remote(plan), engine.receive_weights.remote(plan)])
        if version > 1:  # the first sync allocates buffers
            wall_seconds.append(time.perf_counter() - begun)
            send_seconds.append(sent["seconds"])
            receive_seconds.append(received.seconds)
    total_bytes = plan.total_bytes
    bare, _ = ray.get(
        [
            trainer.broadcast_bytes.remote(total_bytes, args.syncs + 1),
            engine.broadcast_bytes.remote(total_bytes, args.syncs + 1),
        ]
    )
    bare = bare[1:]

    after = ray.get(engine.generate.remote(prompts, greedy))
    after_ids = [c[0].token_ids for c in after]
    trainer_logprobs = ray.get(trainer.logprobs.remote(prompts, after_ids))
    logprob_diff = max(
        abs(a - b)
        for completions, reference in zip(after, trainer_logprobs, strict=True)
        for a, b in zip(completions[0].logprobs, reference, strict=True)
    )
    agreement = sum(
        a == b
        for ours, theirs in zip(after_ids, trainer_greedy, strict=True)
        for a, b in zip(ours, theirs, strict=True)
    ) / (len(prompts) * args.max_tokens)

    sync_median = statistics.median(send_seconds)
    bare_median = statistics.median(bare)
    report |= {
        "params": sum(int(torch.Size(shape).numel()) for _, shape, _ in metadata),
        "sync_bytes": total_bytes,
        "bucket_bytes": bucket_bytes,
        "buckets": len(plan.buckets),
        "sync_seconds": [round(s, 4) for s in send_seconds],
        "sync_seconds_median": round(sync_median, 4),
        "sync_receive_seconds_median": round(statistics.median(receive_seconds), 4),
        "sync_wall_seconds_median": round(statistics.median(wall_seconds), 4),
        "bare_broadcast_seconds": [round(s, 4) for s in bare],
        "bare_broadcast_seconds_median": round(bare_median, 4),
        "sync_GBps": round(total_bytes / sync_median / 1e9, 2),
        "bare_GBps": round(total_bytes / bare_median / 1e9, 2),
        "sync_fraction_of_bare": round(bare_median / sync_median, 3),
        "policy_version_reported": after[0][0].policy_version,
        "greedy_match_before_sync": before == trainer_greedy,
        "greedy_match": after_ids == trainer_greedy,
        "greedy_token_agreement": round(agreement, 4),
        "pattern_accuracy_trainer": round(
            statistics.mean(
                follows_pattern(p, c) for p, c in zip(prompts, trainer_greedy, strict=True)
            ),
            4,
        ),
        "pattern_accuracy_vllm": round(
            statistics.mean(follows_pattern(p, c) for p, c in zip(prompts, after_ids, strict=True)),
            4,
        ),
        "max_abs_logprob_diff": round(logprob_diff, 5),
    }
    print(json.dumps(report, indent=2))
    ray.shutdown()
    return 0 if report["greedy_match"] and report["policy_version_reported"] == version else 1


if __name__ == "__main__":
    sys.exit(main())
