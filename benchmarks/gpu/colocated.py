"""GPU benchmarks of the colocated hybrid engine, each figure beside a ceiling from the same run.

    python benchmarks/gpu/colocated.py update --out DIR    # 3: policy update vs plain PyTorch
    python benchmarks/gpu/colocated.py step   --out DIR    # 1, 2, 4: rollout, weight update, step
    python benchmarks/gpu/colocated.py job    --out DIR    # examples/grpo-1gpu.yaml, then resume
    python benchmarks/gpu/colocated.py summary DIR         # benchmarks/results/gpu-colocated.json

* ``update``: the trainer's own `PolicyWorker.train` on one GPU (each ZeRO stage in its own
  process) against a plain PyTorch mixed-precision step of the same model, batch and loss
  (fp32 master weights, bf16 autocast, fused AdamW, gradient clipping) and a bf16 matmul.
  FLOPs are 6 N T plus causal attention, 6 L s d T.
* ``step``: a `Trainer` with a colocated vLLM engine in the GRPO shape (64 prompts x 8
  samples, 256 prompt + 512 response tokens): end-to-end steps with their phase breakdown,
  then rollout through the product's path against a bare ``vllm.LLM.generate`` of the same
  requests inside the same rank, the weight update against vLLM's own ``load_weights`` of the
  same tensors already on the GPU and a device-to-device copy of the same bytes, and sleep /
  wake at both levels (with a log-prob check that the weights are right afterwards).
* ``job``: the unmodified ``rlhfjob train --config`` on `examples/grpo-1gpu.yaml` with a saved
  Hugging Face directory of the 0.5B shape (random weights) as the policy; stopped with SIGTERM
  after a checkpoint and resumed with ``--resume-from latest``.

``--tiny`` runs the same code on the CPU with a tiny model (a smoke test of this script).
Every subcommand writes its JSON as it goes, so a failure keeps what was measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULT = REPO / "benchmarks" / "results" / "gpu-colocated.json"

SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    },
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}


def model_config(shape: str) -> dict[str, Any]:
    return {
        "model_type": "qwen2",
        "vocab_size": 512 if shape == "tiny" else 151936,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        **SHAPES[shape],
    }


def versions() -> dict[str, Any]:
    found: dict[str, Any] = {"python": platform.python_version()}
    for name in ("torch", "vllm", "deepspeed", "ray", "transformers"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    try:
        import torch

        if torch.cuda.is_available():
            found["gpu"] = torch.cuda.get_device_name(0)
            found["cuda"] = torch.version.cuda
            found["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    except ImportError:
        pass
    return found


class Report:
    """The JSON result, rewritten whenever it changes (partial results survive a failure)."""

    def __init__(self, path: Path, command: str, *, extend: bool = False) -> None:
        """A new report, or (``extend``) the one at `path` with this command added."""
        self.path = path
        self.data: dict[str, Any] = {"command": command, "versions": versions()}
        if extend and path.is_file():
            earlier = json.loads(path.read_text())
            self.data = earlier | {"command": f"{earlier['command']} && {command}"}
        self.save()

    def update(self, **values: Any) -> None:
        self.data.update(values)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str))

    @contextlib.contextmanager
    def section(self, name: str) -> Any:
        """Run a section; its exception is recorded with the traceback and the run goes on."""
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        try:
            yield
        except Exception as error:  # record it and go on with the other sections
            traceback.print_exc()
            self.data.setdefault("errors", {})[name] = f"{error!r}\n{traceback.format_exc()}"
        finally:
            self.data.setdefault("section_seconds", {})[name] = time.perf_counter() - started
            self.save()


def timed(fn: Any, *, sync: bool = True) -> float:
    import torch

    if sync and torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if sync and torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def median(values: list[float]) -> float:
    return float(statistics.median(values))


# --------------------------------------------------------------------------------------------
# Job specs


def job_document(
    shape: str,
    *,
    tiny: bool,
    prompts: int,
    group: int,
    prompt_len: int,
    response_len: int,
    micro: int,
    colocated: bool = True,
    sleep_level: int = 2,
    checkpoint: str = "/tmp/rlhf-bench-checkpoints",
    kl_coef: float = 0.001,
    memory_utilization: float = 0.45,
) -> dict[str, Any]:
    rollout: dict[str, Any] = {"backend": "hf"}
    if colocated:
        rollout = {"placement": "colocated", "backend": "hf" if tiny else "vllm"}
        if not tiny:
            rollout.update(gpuMemoryUtilization=memory_utilization, sleepLevel=sleep_level)
    return {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": f"bench-{shape.replace('.', '')}"},
        "spec": {
            "image": "bench",
            "model": {
                "randomInit": model_config(shape),
                "dtype": "float32" if tiny else "bfloat16",
            },
            "dataset": {"source": "synthetic:even_tokens"},
            "reward": {"type": "function", "function": "rlhf_trainer.data.tasks:even_token_reward"},
            "algorithm": {
                "name": "grpo",
                "groupSize": group,
                "promptsPerStep": prompts,
                "microBatchSize": micro,
                "maxPromptLength": prompt_len,
                "maxResponseLength": response_len,
                "totalSteps": 1000,
                "policyLearningRate": 1e-6,
                "klCoef": kl_coef,
            },
            "roles": {"trainer": {"replicas": 1, "gpus": 0 if tiny else 1}, "rollout": rollout},
            "checkpoint": {"path": checkpoint, "intervalSteps": 1000, "keepLast": 2},
        },
    }


def synthetic_batch(rows: int, prompt_len: int, seq_len: int, vocab: int, seed: int = 0) -> Any:
    import torch

    from rlhf_trainer.algo.batch import build_batch

    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(rows)]
    responses = [
        [rng.randrange(1, vocab) for _ in range(seq_len - prompt_len)] for _ in range(rows)
    ]
    batch = build_batch(prompts, responses)
    generator = torch.Generator().manual_seed(seed)
    return batch.with_fields(
        old_logprobs=torch.full(batch.action_mask.shape, -11.9),
        advantages=torch.randn(rows, generator=generator),
    )


def update_flops(config: dict[str, Any], params: int, tokens: int, seq_len: int) -> float:
    """6 N T plus causal attention (QK and AV, forward and backward): 6 L s d T."""
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    return 6.0 * params * tokens + 6.0 * layers * seq_len * hidden * tokens


# --------------------------------------------------------------------------------------------
# 3. Policy update


def matmul_tflops() -> float:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = [timed(lambda: a @ b) for _ in range(10)]
    return 2 * 8192**3 / median(times) / 1e12


def update_one(args: argparse.Namespace) -> None:
    """One variant of the update benchmark in this process; prints one JSON line."""
    import torch

    from rlhf_trainer import masked
    from rlhf_trainer.algo import formulas as alg
    from rlhf_trainer.modeling import logprobs as lp
    from rlhf_trainer.ranks.actors import PolicyWorker
    from rlhfjob.api import RLHFJob

    tiny = args.tiny
    rows, micro = args.rows, args.micro
    document = job_document(
        args.shape,
        tiny=tiny,
        prompts=rows // 8,
        group=8,
        prompt_len=args.prompt_len,
        response_len=args.seq_len - args.prompt_len,
        micro=micro,
        colocated=False,
        kl_coef=0.0,
    )
    # A "-liger" variant: the same with `model.kernels: liger` (the trainer's builder patches it);
    # a "-fusedlp" one (after it) with `model.fusedLogprobs` (log-probs from the hidden states);
    # a "-compiledlp" one (last) with `model.compiledLogprobs` (the per-token vocabulary math
    # compiled by Inductor, one pass over the logits per direction).
    uncompiled = args.variant.removesuffix("-compiledlp")
    document["spec"]["model"]["compiledLogprobs"] = uncompiled != args.variant
    name = uncompiled.removesuffix("-fusedlp")
    document["spec"]["model"]["fusedLogprobs"] = name != uncompiled
    variant = name.removesuffix("-liger")
    document["spec"]["model"]["kernels"] = "liger" if variant != name else "eager"
    spec = RLHFJob.model_validate(document).spec
    config = model_config(args.shape)
    batch = synthetic_batch(rows, args.prompt_len, args.seq_len, config["vocab_size"])
    tokens = int(batch.attention_mask.sum())
    result: dict[str, Any] = {"shape": args.shape, "variant": args.variant, "rows": rows}
    result.update(micro_batch=micro, seq_len=args.seq_len, tokens_per_step=tokens)
    device = torch.device("cpu" if tiny else "cuda")
    if variant.startswith("plain"):
        from rlhf_trainer.modeling.networks import build_causal_lm

        model = build_causal_lm(spec.model, 0, torch.float32).to(device)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=not tiny)
        params = sum(p.numel() for p in model.parameters())
        temperature = spec.algorithm.temperature
        on_device = batch.to(device)
        total_tokens = on_device.num_action_tokens

        fused = variant == "plain"  # plain-unfused: the loss as the trainer had it before

        def step() -> None:
            for chunk in on_device.micro_batches(micro):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not tiny):
                    logits = model(
                        input_ids=chunk.input_ids, attention_mask=chunk.attention_mask
                    ).logits
                if fused:
                    logprobs, entropies = lp.next_token_logprobs_and_entropy(
                        logits, chunk.input_ids, temperature
                    )
                    masked.masked_mean(entropies.detach(), chunk.action_mask)
                else:
                    logits = logits[:, :-1]
                    logprobs = lp.logprobs_from_logits(logits, chunk.input_ids[:, 1:], temperature)
                    with torch.no_grad():
                        lp.masked_entropy(logits, chunk.action_mask, temperature)
                del logits
                loss = alg.clipped_policy_loss(
                    logprobs,
                    chunk.fields["old_logprobs"],
                    chunk.fields["advantages"],
                    chunk.action_mask,
                    clip_range=0.2,
                ).loss
                (loss * float(chunk.action_mask.sum()) / total_tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    else:
        os.environ["RLHF_ZERO_STAGE"] = variant.removeprefix("zero")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if args.policy_dir:  # a saved checkpoint, loaded as `model.policy: DIR` is
            spec.model = spec.model.model_copy(
                update={"random_init": None, "policy": args.policy_dir}
            )
        worker = PolicyWorker(json.dumps(spec.model_dump(mode="json", by_alias=True)), 0, 1)
        from rlhf_trainer.ranks.actors import free_port

        worker.setup("127.0.0.1", free_port(), 10_000)
        params = sum(
            p.ds_numel if hasattr(p, "ds_numel") else p.numel()
            for p in worker.engine.module.parameters()
        )
        result["build"] = worker.build_report

        def step() -> None:
            worker.train(batch)

    for _ in range(args.warmup):
        step()
    times = [timed(step) for _ in range(args.steps)]
    seconds = median(times)
    flops = update_flops(config, params, tokens, args.seq_len)
    if args.profile and not tiny:
        result["profile"] = profile_step(
            step, args.out / f"profile-update-{args.shape}-{args.variant}-mb{micro}.txt"
        )
    result.update(
        params=params,
        step_seconds=seconds,
        step_seconds_all=times,
        tokens_per_second=tokens / seconds,
        tflops=flops / seconds / 1e12,
        peak_gpu_bytes=torch.cuda.max_memory_reserved() if not tiny else 0,
    )
    print("RESULT " + json.dumps(result), flush=True)


KERNEL_KINDS = {
    "matmul": re.compile(r"gemm|nvjet|cutlass|matmul|sm90_xmma|cublas", re.I),
    "attention": re.compile(r"flash|fmha|attention|sdpa", re.I),
    "optimizer": re.compile(r"adam|multi_tensor|foreach", re.I),
    "nccl": re.compile(r"nccl", re.I),
}


def profile_step(step: Any, path: Path) -> dict[str, Any]:
    """One `step` under torch's profiler: the top kernels by GPU time into `path`, and the GPU
    time by kind of kernel (matmul, attention, optimizer, NCCL, everything else)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kinds: dict[str, float] = {}
    for event in events:
        kind = next((k for k, rx in KERNEL_KINDS.items() if rx.search(event.key)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + event.self_device_time_total / 1e6
    path.write_text(
        prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90
        )
    )
    total = sum(kinds.values())
    return {
        "gpu_seconds_by_kind": kinds,
        "gpu_fraction_by_kind": {k: v / total for k, v in kinds.items()} if total else {},
        "table": path.name,
    }


def save_checkpoint_dir(shape: str, directory: Path) -> Path:
    """A Hugging Face checkpoint of `shape` (random weights, bf16) saved in `directory`."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_trainer.rollout.model_source import causal_lm_config

    if not (directory / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(causal_lm_config(model_config(shape)))
        model.to(torch.bfloat16).save_pretrained(directory)
    return directory


def bench_update(args: argparse.Namespace) -> None:
    report = Report(args.out / "update.json", " ".join(sys.argv))
    if not args.tiny:
        with report.section("matmul"):
            report.update(matmul_bf16_tflops=matmul_tflops())
    runs = []
    for shape, variant, *rest in args.variants:
        micro = int(rest[0]) if rest else args.micro
        with report.section(f"{shape}-{variant}-mb{micro}"):
            command = [
                sys.executable,
                __file__,
                "update-one",
                "--out",
                str(args.out),
                "--shape",
                shape,
                "--variant",
                variant,
                "--rows",
                str(args.rows),
                "--micro",
                str(micro),
                "--seq-len",
                str(args.seq_len),
                "--prompt-len",
                str(args.prompt_len),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
            ] + (["--tiny"] if args.tiny else [])
            if args.profile:
                command.append("--profile")
            if args.from_checkpoint and variant.startswith("zero"):
                directory = save_checkpoint_dir(shape, Path(args.work) / "models" / shape)
                command += ["--policy-dir", str(directory)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=900)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                raise RuntimeError(f"exit {done.returncode}: {(done.stdout + done.stderr)[-3000:]}")
            runs.append(json.loads(lines[-1].removeprefix("RESULT ")))
            report.update(runs=runs)
    peak = report.data.get("matmul_bf16_tflops")
    for run in runs:
        plain = next(
            (
                r
                for r in runs
                if r["shape"] == run["shape"]
                and r["variant"] == "plain"
                and r["micro_batch"] == run["micro_batch"]
            ),
            None,
        )
        if peak:
            run["mfu"] = run["tflops"] / peak
        if plain is not None:
            run["vs_plain"] = run["tokens_per_second"] / plain["tokens_per_second"]
    report.update(runs=runs)


# --------------------------------------------------------------------------------------------
# 1, 2, 4. Rollout, weight update, the whole step (one Trainer, one engine start)


def bare_generate(
    self: Any, prompts: list[list[int]], n: int, max_tokens: int, seeds: list[int] | None
) -> dict[str, Any]:
    """Inside the rank: the same requests straight through ``vllm.LLM.generate``."""
    from vllm import SamplingParams

    self.rollout.for_rollout(self.engine)
    llm = self.rollout.engine._llm
    params = [
        SamplingParams(
            n=n,
            temperature=1.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            seed=None if seeds is None else seeds[i],
        )
        for i in range(len(prompts))
    ]
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(sample.token_ids) for out in outputs for sample in out.outputs)
    return {"seconds": seconds, "tokens": tokens}


def load_ceiling(self: Any, repeats: int, level: int) -> dict[str, Any]:
    """Inside the rank: vLLM's ``load_weights`` of the same tensors already on the GPU, into an
    awake engine and right after a sleep at `level` and a wake of the weights (the state the
    product's update finds), and a device-to-device copy of the same bytes."""
    import torch

    from rlhf_trainer.rollout.sync_plan import iter_module_parameters

    engine = self.rollout.engine
    self.rollout.for_rollout(self.engine)
    version = engine.policy_version()
    tensors = [
        (name, tensor.clone())
        for group, _ in iter_module_parameters(self.engine.module)
        for name, tensor in group
    ]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    awake = [timed(lambda: engine.load_tensors(tensors)) for _ in range(repeats + 1)][1:]
    after_sleep = []
    for _ in range(repeats + 1):
        engine.sleep(level)
        engine.wake_weights()
        after_sleep.append(timed(lambda: engine.load_tensors(tensors)))
        engine.finish_load(version)
        engine.wake()
    engine.finish_load(version)
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    copies = [timed(lambda: target.copy_(source)) for _ in range(repeats + 1)][1:]
    return {
        "bytes": nbytes,
        "load_seconds": awake,
        "load_after_sleep_seconds": after_sleep[1:],
        "copy_seconds": copies,
    }


def load_breakdown(self: Any, repeats: int) -> dict[str, Any]:
    """Inside the rank: where the product's weight update spends its time beyond the
    ceiling: the walk over the modules alone, and the whole update with the garbage
    collector off."""
    walk = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        for _tensors, _transient in iter_parameters(self.engine.module):
            pass
        walk.append(time.perf_counter() - started)
    version = self.rollout.engine.policy_version()
    no_gc = []
    for _ in range(repeats + 1):
        self.rollout.for_training(self.engine)
        gc.collect()
        gc.disable()
        try:
            no_gc.append(self.rollout.load(self.engine.module, version)["seconds"])
        finally:
            gc.enable()
    return {"walk_seconds": walk[1:], "update_without_gc_seconds": no_gc[1:]}


def iter_parameters(module: Any) -> Any:
    from rlhf_trainer.rollout.sync_plan import iter_module_parameters

    return iter_module_parameters(module)


def profile_load(self: Any, path: str) -> dict[str, Any]:
    """Inside the rank: the product's weight update after a sleep, under torch's profiler (the
    top operations by CPU and by GPU time into `path`)."""
    from torch.profiler import ProfilerActivity, profile

    self.rollout.for_training(self.engine)  # asleep, as after an update
    version = self.rollout.engine.policy_version()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        self.rollout.load(self.engine.module, version)
    table = prof.key_averages()
    Path(path).write_text(
        table.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=90)
        + "\n\n"
        + table.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=90)
    )
    return {"table": Path(path).name}


def sleep_cycle(self: Any, level: int) -> dict[str, Any]:
    """Inside the rank: sleep and wake the engine at `level`; reload the weights after level 2."""
    import torch

    rollout, engine = self.rollout, self.rollout.engine
    rollout.for_rollout(self.engine)
    torch.cuda.synchronize()
    free_awake, _ = torch.cuda.mem_get_info()
    sleep = timed(lambda: engine.sleep(level))
    free_asleep, _ = torch.cuda.mem_get_info()
    wake = timed(engine.wake)
    reload = None
    if level == 2:  # the weights were dropped: the trainer's go back in
        reload = rollout.load(self.engine.module, engine.policy_version())["seconds"]
    return {
        "level": level,
        "sleep_seconds": sleep,
        "wake_seconds": wake,
        "reload_seconds": reload,
        "freed_bytes": free_asleep - free_awake,
    }


def bench_step(args: argparse.Namespace) -> None:
    import threading

    import ray
    import torch

    from rlhf_trainer.algo.batch import build_batch
    from rlhf_trainer.data.prompts import PromptItem
    from rlhf_trainer.rollout.base import SamplingParams
    from rlhf_trainer.run.loop import Trainer, load_inputs
    from rlhfjob.api import RLHFJob

    report = Report(args.out / "step.json", " ".join(sys.argv))
    tiny = args.tiny
    prompts_n, group = (4, 4) if tiny else (64, 8)
    prompt_len, response_len = (8, 8) if tiny else (256, 512)
    document = job_document(
        "tiny" if tiny else "0.5b",
        tiny=tiny,
        prompts=prompts_n,
        group=group,
        prompt_len=prompt_len,
        response_len=response_len,
        micro=args.micro,
        sleep_level=args.sleep_level,
        checkpoint="/tmp/rlhf-bench-step",  # not under OUT: the checkpoints are GBs
    )
    job = RLHFJob.model_validate(document)
    report.update(shape=document["spec"]["model"]["randomInit"], job=document["spec"])
    vocab = job.spec.model.random_init["vocab_size"]  # type: ignore[index]
    rng = random.Random(0)

    def random_prompts(count: int) -> list[list[int]]:
        return [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(count)]

    inputs = load_inputs(job.spec, check_model=False)
    inputs.prompts = [PromptItem(p) for p in random_prompts(4096)]
    resources = {"rlhf-role-trainer": 1.0}
    ray.init(num_cpus=os.cpu_count(), resources=resources, include_dashboard=False)
    started = time.perf_counter()
    trainer = Trainer(job, inputs, threading.Event(), detached=False)
    report.update(startup_seconds=time.perf_counter() - started)
    rank = trainer.policy.actors[0]
    report.update(build=ray.get(rank.__ray_call__.remote(lambda self: self.build_report)))
    try:
        if "e2e" in args.sections:
            with report.section("e2e"):
                trainer.sync_weights()
                steps = []
                for _ in range(args.steps):
                    record = trainer.record(trainer.run_step())
                    phases = record["phase_seconds"]
                    record["overhead_seconds"] = record["step_seconds"] - sum(phases.values())
                    steps.append(
                        {
                            k: record[k]
                            for k in (
                                "step",
                                "step_seconds",
                                "phase_seconds",
                                "overhead_seconds",
                                "reward_mean",
                            )
                        }
                    )
                    print(steps[-1], flush=True)
                    report.update(steps=steps)
                checkpoint = timed(trainer.save_checkpoint, sync=False)
                timed_steps = steps[1:] or steps  # the first step warms up
                step_seconds = median([s["step_seconds"] for s in timed_steps])
                overhead = median([s["overhead_seconds"] for s in timed_steps])
                phases = {
                    name: median([s["phase_seconds"].get(name, 0.0) for s in timed_steps])
                    for name in timed_steps[-1]["phase_seconds"]
                }
                report.update(
                    step_seconds=step_seconds,
                    phase_seconds=phases,
                    checkpoint_seconds=checkpoint,
                    overhead_seconds=overhead,
                    step_overhead_fraction=overhead / step_seconds,
                    colocation=trainer.policy.call("colocation_report")[0],
                )

        n_prompts = prompts_n
        sampling = SamplingParams(
            n=group, temperature=1.0, max_tokens=response_len, seed=7, logprobs=False
        )
        if "rollout" in args.sections:
            with report.section("rollout"):

                def bare_run(seeds: list[int] | None) -> dict[str, Any]:
                    """The same number of new prompts straight through vLLM in the rank."""
                    requests = random_prompts(n_prompts)
                    return ray.get(
                        rank.__ray_call__.remote(
                            bare_generate, requests, group, response_len, seeds
                        )
                    )

                product, with_logprobs, bare, bare_seeded = [], [], [], []
                for _ in range(args.repeats + 1):
                    prompts = random_prompts(n_prompts)
                    started = time.perf_counter()
                    completions = trainer.fleet.generate(prompts, sampling)
                    seconds = time.perf_counter() - started
                    tokens = sum(len(c.token_ids) for row in completions for c in row)
                    product.append({"seconds": seconds, "tokens": tokens})
                    if not tiny:
                        bare.append(bare_run(None))
                        bare_seeded.append(
                            bare_run([rng.randrange(2**31) for _ in range(n_prompts)])
                        )
                product, bare, bare_seeded = product[1:], bare[1:], bare_seeded[1:]

                # The engine seeds once per call: the same call twice samples the same tokens,
                # another seed other tokens (what resume equivalence rests on).
                def sampled(seed: int) -> list[list[int]]:
                    rows = trainer.fleet.generate(prompts, replace(sampling, seed=seed))
                    return [c.token_ids for row in rows for c in row]

                first = sampled(7)
                report.update(
                    rollout_reproducible=first == sampled(7),
                    rollout_other_seed_differs=first != sampled(8),
                )
                for _ in range(2):
                    prompts = random_prompts(n_prompts)
                    started = time.perf_counter()
                    scored = trainer.fleet.generate(
                        prompts, SamplingParams(**{**sampling.__dict__, "logprobs": True})
                    )
                    with_logprobs.append(
                        {
                            "seconds": time.perf_counter() - started,
                            "tokens": sum(len(c.token_ids) for row in scored for c in row),
                        }
                    )

                def rate(runs: list[dict[str, Any]]) -> float | None:
                    return median([r["tokens"] / r["seconds"] for r in runs]) if runs else None

                # The trainer's recompute of the same log-probs (what the loop does instead).
                flat_prompts = [p for p in prompts for _ in range(group)]
                flat = [c.token_ids for row in scored for c in row]
                batch = build_batch(flat_prompts, flat)
                batch_ref = ray.put(batch)
                recompute = [
                    timed(lambda: trainer.policy.call("logprobs", batch_ref), sync=False)
                    for _ in range(3)
                ][1:]
                trainer_logprobs = trainer.policy.unshard(
                    trainer.policy.submit("logprobs", batch_ref)
                )
                engine_logprobs = torch.zeros_like(trainer_logprobs)
                for row, (prompt, completion) in enumerate(
                    zip(flat_prompts, [c for r in scored for c in r], strict=True)
                ):
                    start = len(prompt) - 1
                    engine_logprobs[row, start : start + len(completion.logprobs)] = torch.tensor(
                        completion.logprobs
                    )
                mask = batch.action_mask.bool()
                diff = (trainer_logprobs - engine_logprobs).abs()[mask]
                report.update(
                    rollout={
                        "product_tokens_per_second": rate(product),
                        "product_with_engine_logprobs_tokens_per_second": rate(with_logprobs),
                        "bare_tokens_per_second": rate(bare),
                        "bare_seeded_tokens_per_second": rate(bare_seeded),
                        "trainer_logprob_recompute_seconds": median(recompute),
                        "engine_logprob_extra_seconds": median(
                            [r["seconds"] for r in with_logprobs]
                        )
                        - median([r["seconds"] for r in product]),
                        "engine_vs_trainer_logprob_abs_diff_mean": float(diff.mean()),
                        "engine_vs_trainer_logprob_abs_diff_max": float(diff.max()),
                        "runs": {
                            "product": product,
                            "bare": bare,
                            "bare_seeded": bare_seeded,
                            "with_logprobs": with_logprobs,
                        },
                    }
                )
                r = report.data["rollout"]
                if r["bare_tokens_per_second"]:
                    report.update(
                        rollout_ratio=r["product_tokens_per_second"] / r["bare_tokens_per_second"],
                        rollout_ratio_seeded=r["product_tokens_per_second"]
                        / r["bare_seeded_tokens_per_second"],
                    )

        with report.section("weight_update"):
            version = trainer.version
            prompts = random_prompts(n_prompts)
            batch_ref = ray.put(
                build_batch(
                    [p for p in prompts for _ in range(group)],
                    [[1] * response_len for _ in range(n_prompts * group)],
                )
            )
            driver, rank_side, awake = [], [], []
            for _ in range(args.repeats + 2):
                trainer.policy.call("logprobs", batch_ref)  # the engine sleeps, as after an update
                started = time.perf_counter()
                results = trainer.policy.call("update_rollout_engine", version)
                driver.append(time.perf_counter() - started)
                rank_side.append(results[0]["seconds"])
                # Again at once: the engine's weights are awake now (no fresh memory to fill).
                awake.append(trainer.policy.call("update_rollout_engine", version)[0]["seconds"])
            driver, rank_side, awake = driver[1:], rank_side[1:], awake[1:]
            update = {
                "driver_seconds": driver,
                "rank_seconds": rank_side,
                "rank_awake_seconds": awake,
                "bytes": results[0]["bytes"],
                "sleep_level": args.sleep_level,
            }
            if not tiny:
                ceiling = ray.get(
                    rank.__ray_call__.remote(load_ceiling, args.repeats, args.sleep_level)
                )
                update["ceiling_load_seconds"] = ceiling["load_seconds"]
                update["ceiling_load_after_sleep_seconds"] = ceiling["load_after_sleep_seconds"]
                update["copy_seconds"] = ceiling["copy_seconds"]
                update["breakdown"] = ray.get(
                    rank.__ray_call__.remote(load_breakdown, args.repeats)
                )
                update["profile"] = ray.get(
                    rank.__ray_call__.remote(
                        profile_load, str(args.out / "profile-weight-update.txt")
                    )
                )
                report.update(
                    # Like for like: both loads right after a sleep and a wake of the weights.
                    weight_update_ratio=median(rank_side)
                    / median(ceiling["load_after_sleep_seconds"]),
                    weight_update_ratio_awake=median(awake) / median(ceiling["load_seconds"]),
                    weight_update_vs_copy=median(rank_side) / median(ceiling["copy_seconds"]),
                )
            report.update(weight_update=update)

        if not tiny:
            with report.section("sleep"):
                cycles = [
                    ray.get(rank.__ray_call__.remote(sleep_cycle, level)) for level in (1, 2, 1, 2)
                ]
                report.update(sleep=cycles)
                # The weights must be right after the level-2 cycle: the engine's log-probs
                # of its own samples against the trainer's recompute.
                # A whole step's rows: the ranks shard by the step's plan.
                prompts = random_prompts(n_prompts)
                scored = trainer.fleet.generate(
                    prompts,
                    SamplingParams(n=group, temperature=1.0, max_tokens=64, seed=3, logprobs=True),
                )
                samples = [sample for row in scored for sample in row]
                prompts = [p for p in prompts for _ in range(group)]
                batch = build_batch(prompts, [sample.token_ids for sample in samples])
                mine = trainer.policy.unshard(trainer.policy.submit("logprobs", ray.put(batch)))
                theirs = torch.zeros_like(mine)
                for row, (prompt, sample) in enumerate(zip(prompts, samples, strict=True)):
                    theirs[row, len(prompt) - 1 : len(prompt) - 1 + len(sample.logprobs)] = (
                        torch.tensor(sample.logprobs)
                    )
                diff = (mine - theirs).abs()[batch.action_mask.bool()]
                report.update(after_sleep_logprob_abs_diff_mean=float(diff.mean()))
        report.update(colocation_final=trainer.policy.call("colocation_report")[0])
    finally:
        trainer.shutdown()
        ray.shutdown()


# --------------------------------------------------------------------------------------------
# The GPU job: the unmodified `rlhfjob train --config`, stopped and resumed


def bench_job(args: argparse.Namespace) -> None:
    import yaml

    # Two calls when one would outlive a time limit: `--part first`, then `--part resumed`.
    report = Report(args.out / "job.json", " ".join(sys.argv), extend=args.part == "resumed")
    work = Path(args.work)
    document = yaml.safe_load((REPO / "examples" / "grpo-1gpu.yaml").read_text())
    spec = document["spec"]
    spec["checkpoint"] = {"path": str(work / "checkpoints"), "intervalSteps": 10, "keepLast": 10}
    model_dir = work / "models" / "qwen2-0.5b"
    if args.tiny:
        spec["roles"] = {
            "trainer": {"replicas": 1},
            "rollout": {"placement": "colocated", "backend": "hf"},
        }
        spec["model"]["dtype"] = "float32"
        spec["algorithm"].update(totalSteps=6, promptsPerStep=8, microBatchSize=16)
        spec["checkpoint"]["intervalSteps"] = 2
        model_dir = work / "models" / "tiny"
    spec["model"]["policy"] = str(model_dir)
    job_path = work / "grpo-1gpu.yaml"
    if args.total_steps:
        spec["algorithm"]["totalSteps"] = args.total_steps
    total = spec["algorithm"]["totalSteps"]
    stop_after = spec["checkpoint"]["intervalSteps"] * (2 if not args.tiny else 1)
    run_dir = work / "checkpoints" / "default" / document["metadata"]["name"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

    def save_model() -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from rlhf_trainer.rollout.model_source import causal_lm_config

        config = causal_lm_config(model_config("tiny" if args.tiny else "0.5b"))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32 if args.tiny else torch.bfloat16
        )
        model.save_pretrained(model_dir)
        del model
        report.update(model_dir_bytes=sum(p.stat().st_size for p in model_dir.iterdir()))
        job_path.write_text(yaml.safe_dump(document))

    def run(extra: list[str], log: Path, stop_at: int | None) -> dict[str, Any]:
        started = time.perf_counter()
        with log.open("w") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "rlhfjob_cli", "train", "--config", str(job_path), *extra],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=work,
            )
            stopped = False
            while process.poll() is None:
                if (
                    stop_at is not None
                    and not stopped
                    and (run_dir / f"step-{stop_at:08d}").is_dir()
                ):
                    process.send_signal(signal.SIGTERM)  # finish the step, checkpoint, exit 4
                    stopped = True
                time.sleep(0.5)
        text = log.read_text()
        final = [ln for ln in text.splitlines() if ln.startswith("RLHFJOB_FINAL_STATUS")]
        ready = [ln for ln in text.splitlines() if "actors ready in" in ln or "built its" in ln]
        return {
            "exit": process.returncode,
            "seconds": time.perf_counter() - started,
            "final_status": final[-1] if final else None,
            "startup": ready[-1] if ready else None,
            "log_tail": text[-3000:],
        }

    if args.part in ("all", "first"):
        with report.section("save_model"):
            save_model()
        with report.section("first"):
            report.update(first=run([], args.out / "job-first.log", stop_after))
    if args.part == "first":
        return
    with report.section("resumed"):
        report.update(resumed=run(["--resume-from", "latest"], args.out / "job-resumed.log", None))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = {}
    for record in records:
        last[record["step"]] = record  # a step may be logged twice around the stop
    steps = [last[s] for s in sorted(last)]
    rewards = [s["reward_mean"] for s in steps]
    first_log = (args.out / "job-first.log").read_text()
    stopped_at = max(int(m.group(1)) for m in STEP_LINE.finditer(first_log))
    saves = [s["phase_seconds"]["checkpoint"] for s in steps if "checkpoint" in s["phase_seconds"]]
    report.update(
        steps=[
            {
                k: s.get(k)
                for k in ("step", "attempt", "reward_mean", "step_seconds", "phase_seconds")
            }
            for s in steps
        ],
        total_steps=total,
        reward_first_steps=sum(rewards[:5]) / len(rewards[:5]),
        reward_last_steps=sum(rewards[-5:]) / len(rewards[-5:]),
        # The checkpoint the resumed run loaded: the reward goes on from where it stopped.
        reward_before_stop=last[stopped_at]["reward_mean"],
        reward_after_resume=last.get(stopped_at + 1, {}).get("reward_mean"),
        checkpoint_save_seconds=saves,
        resumed_from=[
            ln
            for ln in (args.out / "job-resumed.log").read_text().splitlines()
            if "resuming from" in ln
        ][:1],
    )
    for name in ("metrics.jsonl", "reward_curve.png"):
        if (run_dir / name).is_file():
            (args.out / f"job-{name}").write_bytes((run_dir / name).read_bytes())


# --------------------------------------------------------------------------------------------
# Summary


STEP_LINE = re.compile(r"step\s+(\d+)/(\d+) \| reward ([\d.]+) ±([\d.]+).*\| ([\d.]+) s \(")


def steps_from_logs(*logs: Path) -> list[dict[str, Any]]:
    """The driver's progress lines, one record per step (a later attempt's line wins): for a
    run cut short before it wrote its JSON."""
    by_step: dict[int, dict[str, Any]] = {}
    for attempt, log in enumerate(logs):
        for match in STEP_LINE.finditer(log.read_text() if log.is_file() else ""):
            step = int(match[1])
            by_step[step] = {
                "step": step,
                "attempt": attempt,
                "reward_mean": float(match[3]),
                "reward_std": float(match[4]),
                "step_seconds": float(match[5]),
            }
    return [by_step[step] for step in sorted(by_step)]


def summary(directory: Path) -> None:
    """Merge update.json, step.json and job.json into gpu-colocated.json with the top-level keys."""
    job_json = directory / "job.json"
    if job_json.is_file() and "steps" not in json.loads(job_json.read_text()):
        job = json.loads(job_json.read_text())
        steps = steps_from_logs(directory / "job-first.log", directory / "job-resumed.log")
        rewards = [s["reward_mean"] for s in steps]
        resumed = (directory / "job-resumed.log").read_text().splitlines()
        job.update(
            steps=steps,
            steps_source="the driver's progress lines (the run outlived the call's time limit "
            "after its last step, before the benchmark wrote them)",
            reward_first_steps=sum(rewards[:5]) / 5,
            reward_last_steps=sum(rewards[-5:]) / 5,
            resumed_from=[line for line in resumed if "resuming from" in line][:1],
        )
        job_json.write_text(json.dumps(job, indent=2))
        from rlhf_trainer.run.curves import plot_reward_curve

        plot_reward_curve(steps, directory / "job-reward-curve.png", "grpo-1gpu on one H200")
    parts = {
        name: json.loads((directory / f"{name}.json").read_text())
        for name in ("update", "step", "step-weight-update", "step-rollout", "job")
        if (directory / f"{name}.json").is_file()
    }
    result: dict[str, Any] = {"benchmarks": parts}
    update = parts.get("update", {})
    best = [
        r
        for r in update.get("runs", [])
        if r["shape"] == "1.5b" and r["variant"].startswith("zero")
    ]
    if best:
        top = max(best, key=lambda r: r["tokens_per_second"])
        result.update(
            update_best_variant_1_5b=f"{top['variant']} micro-batch {top['micro_batch']}",
            update_mfu_1_5b=top.get("mfu"),
            update_vs_plain_ratio_1_5b=top.get("vs_plain"),
        )
    # A focused re-run of the weight update (after a fix) overrides the full run's figures.
    step = parts.get("step", {}) | {
        k: v for k, v in parts.get("step-weight-update", {}).items() if k.startswith("weight")
    }
    for key in (
        "rollout_ratio",
        "rollout_ratio_seeded",
        "weight_update_ratio",
        "weight_update_ratio_awake",
        "weight_update_vs_copy",
        "step_overhead_fraction",
    ):
        if key in step:
            result[key] = step[key]
    job = parts.get("job", {})
    for key in ("reward_first_steps", "reward_last_steps"):
        if key in job:
            result[key] = job[key]
    ordered = {k: result[k] for k in sorted(result) if k != "benchmarks"} | {"benchmarks": parts}
    RESULT.write_text(json.dumps(ordered, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in ordered.items() if k != "benchmarks"}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("update", "update-one", "step", "job"):
        p = sub.add_parser(name)
        p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/gpu")))
        p.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny model")
        p.add_argument("--steps", type=int, default=4)
        p.add_argument("--warmup", type=int, default=2)
        p.add_argument("--micro", type=int, default=8)
        p.add_argument("--rows", type=int, default=64)
        p.add_argument("--seq-len", type=int, default=1024)
        p.add_argument("--prompt-len", type=int, default=256)
        p.add_argument("--shape", default="1.5b")
        p.add_argument("--variant", default="plain")
        p.add_argument(
            "--variants", default="1.5b:plain,1.5b:zero2,1.5b:zero3,0.5b:plain,0.5b:zero2"
        )
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--profile", action="store_true", help="torch profiler tables into --out")
        p.add_argument(
            "--sections",
            default="e2e,rollout",
            help="step: optional sections (weight update and sleep always run)",
        )
        p.add_argument("--policy-dir", default="", help="update-one: load this checkpoint")
        p.add_argument(
            "--from-checkpoint",
            action="store_true",
            help="update: the ZeRO variants load a saved checkpoint (partitioned under ZeRO-3)",
        )
        p.add_argument("--sleep-level", type=int, default=2)
        p.add_argument(
            "--part",
            choices=("all", "first", "resumed"),
            default="all",
            help="job: the stopped first run, the resumed run (same --work), or both",
        )
        p.add_argument("--work", default="/tmp/rlhf-gpu-job")
        p.add_argument("--total-steps", type=int, default=0, help="job: 0 = the example's")
    p = sub.add_parser("summary")
    p.add_argument("directory", type=Path)
    args = parser.parse_args()
    if args.command == "summary":
        summary(args.directory)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if hasattr(args, "variants"):
        args.variants = [tuple(item.split(":")) for item in args.variants.split(",")]
    {"update": bench_update, "update-one": update_one, "step": bench_step, "job": bench_job}[
        args.command
    ](args)
    gc.collect()


if __name__ == "__main__":
    main()
