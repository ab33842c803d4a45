"""Issue 27 on one GPU: the colocated time-sliced loop against a spatially shared one.

    python benchmarks/gpu/async_shared.py --out DIR --warmup 2 --steps 4 \
        --engine-stream side,default --deadline 540    # one GPU: DIR/async-gpu.json
    python benchmarks/gpu/async_shared.py --out DIR --tiny     # CPU smoke test, tiny model

Environment on the GPU machine (as for `benchmarks/gpu/colocated.py`)::

    export PYTHONPATH=$SITE:$PWD:$PWD/operator:$PWD/trainer:$PWD/cli
    export VLLM_USE_FLASHINFER_SAMPLER=0 TORCH_CUDA_ARCH_LIST=9.0 RAY_AUTH_MODE=disabled

One `Trainer` (the product's, as ``colocated.py step`` builds it: GRPO, 64 prompts x 8 samples,
256 prompt + 512 response tokens, the 0.5B Qwen2 shape with random weights, one rank with its
colocated vLLM engine at ``gpuMemoryUtilization`` ``--engine-util``) runs two loops one after
the other, each ``--warmup`` steps and then ``--steps`` measured ones, on the same engine, the
same trainer and the same split of memory, so only the schedule differs:

* ``time_sliced``: today's colocated loop, unchanged (`Trainer.run_step`): the engine wakes for
  generation and sleeps (level 2) while the rank scores and updates; on one GPU (ZeRO-2) the
  trainer's state stays resident and only its cached blocks go back for the KV cache.
* ``shared``: the engine stays awake the whole time, beside the trainer's state, and the
  product's own staleness-1 schedule drives it (`Trainer.run_step` with
  ``algorithm.maxStaleness: 1``): step t+1's batch is generated while step t scores and updates,
  the driver waits for it after the update, and the new weights go in through the same in-place
  ``load_weights`` path (`ColocatedEngine.load`, by `PolicyWorker.update_rollout_engine`) while
  the engine is idle. So the batch trained at step t was sampled by policy version t-1 (the
  step records' ``policy_version_lag`` is 1), and its behaviour log-probs come from the engine
  (the decoupled objective the product uses for stale batches).

The product has no hook for the shared mode (the API refuses ``maxStaleness`` with a colocated
rollout), so this file builds the minimum:

* `enter_shared` (run inside the rank) wakes the engine and leaves the rank's
  `ColocatedEngine` in its training mode, whose hand-over is then a no-op: nothing sleeps or
  offloads any more.
* `SharedRollout` is `ColocatedRollout` whose ``generate`` calls the rank's engine directly
  (`shared_generate`) in the rank's second Ray concurrency group (``CHECKPOINT_WRITES``, a
  thread of its own), so generation runs while the rank's default thread scores and trains.
* The driver's `Trainer` gets ``maxStaleness`` 1 after the API checked the job.

Why a thread in the rank rather than a second process: the colocated engine runs vLLM's engine
core in the rank's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which is what lets
``load_weights`` take the trainer's tensors in place, without a copy or a process group (NCCL
refuses two ranks on one GPU). One process is also one CUDA context: kernels of the generation
thread, issued on a CUDA stream of its own (``--engine-stream side``; ``default`` puts them on
the trainer's stream, where they can only interleave), can run on the SMs beside the update's,
where two processes without MPS would be time-sliced. The price is the GIL, which the engine's
scheduling loop and the trainer's kernel launches share.

Figures: step time (wall from one step's end to the next's), the phases of each loop, and for
the shared loop the generation time, the update, the weight sync, and how much of the
generation overlapped the step's scoring and update; the peak GPU memory of each loop
(sampled in the rank), the engine's bytes and the trainer's peak; ``speedup_shared_gpu`` beside
its ceiling ``speedup_bound`` (the time-sliced phases with generation wholly hidden behind
scoring and the update), and a ``note`` that puts the figures in words. Both loops run at the
same ``--engine-util`` (0.3 by default; ``colocated.py step`` used 0.45): the whole batch's KV
cache (512 x 768 tokens, about 4.8 GB at this shape) fits either way, so time-slicing loses
nothing by it. ``--micro 0`` picks micro-batch 16 on a GPU of more than 100 GB, else 8, so the
update fits beside the awake engine. The JSON is rewritten as it goes, so a failure keeps what
was measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from colocated import Report, job_document, median

STREAMS = ("side", "default")


# --------------------------------------------------------------------------------------------
# Inside the rank (`PolicyWorker`, through ``__ray_call__``)


class MemorySampler:
    """The most GPU memory in use (total minus free), sampled every few milliseconds."""

    def __init__(self, interval: float = 0.01) -> None:
        import torch

        self.on_gpu = torch.cuda.is_available()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        import torch

        while self.on_gpu and not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def memory_state(self: Any) -> dict[str, int]:
    """The GPU's and the caching allocator's view of the rank's memory now."""
    import torch

    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "gpu_used_bytes": total - free,
        "gpu_total_bytes": total,
        "allocator_reserved_bytes": torch.cuda.memory_reserved(),
        "allocator_peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        "allocator_peak_allocated_bytes": torch.cuda.max_memory_allocated(),
    }


def start_sampling(self: Any) -> dict[str, int]:
    """Start sampling the GPU's memory and reset the allocator's peak."""
    import torch

    self._bench_sampler = MemorySampler()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    return memory_state(self)


def stop_sampling(self: Any) -> dict[str, int]:
    """Stop sampling: the GPU's peak and the allocator's since `start_sampling`."""
    state = memory_state(self)
    state["gpu_peak_bytes"] = self._bench_sampler.stop()
    return state


def rank_facts(self: Any) -> dict[str, Any]:
    """The model's parameter count, the ZeRO stage and the engine's KV cache as vLLM sized it."""
    facts: dict[str, Any] = {
        "params": sum(
            p.ds_numel if hasattr(p, "ds_numel") else p.numel()  # ZeRO-3 (CPU) partitions
            for p in self.engine.module.parameters()
        ),
        "zero_stage": int(self.engine.zero_optimization_stage()),
        "build": self.build_report,
    }
    llm = getattr(self.rollout.engine, "_llm", None)
    with contextlib.suppress(Exception):  # private vLLM attributes: best effort
        cache = llm.llm_engine.vllm_config.cache_config  # type: ignore[union-attr]
        facts["engine_kv_cache_blocks"] = cache.num_gpu_blocks
        facts["engine_kv_cache_block_tokens"] = cache.block_size
    return facts


def enter_shared(self: Any, stream: str) -> dict[str, Any]:
    """Wake the engine for good, beside the trainer's state (the rank stays in its training
    mode, so no hand-over happens any more), and choose the generation thread's CUDA stream."""
    import torch

    from rlhf_trainer.rollout.vllm_engine import VLLMEngine

    rollout = self.rollout
    rollout.for_training(self.engine)  # the trainer's state home, the engine asleep
    before = memory_state(self)
    if isinstance(rollout.engine, VLLMEngine):
        rollout.engine.wake()  # weights (already loaded by the last sync) and KV cache
    after = memory_state(self)
    self._bench_stream = (
        torch.cuda.Stream() if torch.cuda.is_available() and stream == "side" else None
    )
    self._bench_generations = []
    woken = before.get("gpu_used_bytes", 0)
    return {
        "before_wake": before,
        "after_wake": after,
        "kv_cache_bytes": after.get("gpu_used_bytes", 0) - woken,
        "wake_in_allocator_bytes": after.get("allocator_reserved_bytes", 0)
        - before.get("allocator_reserved_bytes", 0),
    }


def shared_generate(self: Any, prompts: list[list[int]], sampling: Any) -> Any:
    """Generate with the rank's awake engine, in the calling (non-default) Ray thread, on the
    stream `enter_shared` chose; returns the completions and the call's wall-clock interval."""
    import torch

    started, clock = time.time(), time.perf_counter()
    stream = self._bench_stream
    context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with context:
        completions = self.rollout.engine.generate(prompts, sampling)
        if stream is not None:
            stream.synchronize()
    timing = {"start": started, "end": time.time(), "seconds": time.perf_counter() - clock}
    self._bench_generations.append(timing)
    return completions, timing


def colocation_report(self: Any) -> dict[str, Any]:
    rollout = self.rollout
    return {"seconds": dict(rollout.seconds), "peak_memory_bytes": dict(rollout.peak_memory)}


# --------------------------------------------------------------------------------------------
# The driver's side


def shared_rollout(policy: Any) -> Any:
    """A `ColocatedRollout` whose generation runs beside the rank's default thread."""
    from rlhf_trainer.elastic import plan_chunks
    from rlhf_trainer.ranks.actors import CHECKPOINT_WRITES
    from rlhf_trainer.rollout.colocated import ColocatedRollout

    class SharedRollout(ColocatedRollout):
        def __init__(self) -> None:
            super().__init__(policy)
            self.calls: list[dict[str, float]] = []

        def generate(self, prompts: list[list[int]], sampling: Any) -> Any:
            import ray

            started = time.time()
            chunks = plan_chunks(len(prompts), self.desired)
            refs = [
                self.policy.actors[chunk.index]
                .__ray_call__.options(concurrency_group=CHECKPOINT_WRITES)
                .remote(
                    shared_generate,
                    prompts[chunk.start : chunk.stop],
                    replace(sampling, seed=chunk.seed(sampling.seed)),
                )
                for chunk in chunks
            ]
            results = ray.get(refs, timeout=self.generate_timeout_s)
            ranks = [timing for _, timing in results]
            self.calls.append(
                {
                    "start": started,
                    "end": time.time(),
                    "rank_start": min(t["start"] for t in ranks),
                    "rank_end": max(t["end"] for t in ranks),
                }
            )
            return [row for completions, _ in results for row in completions]

    return SharedRollout()


def timed_trainer_class() -> Any:
    """`Trainer` whose phases also leave their wall-clock intervals and threads behind."""
    from rlhf_trainer.run.loop import Trainer

    class TimedTrainer(Trainer):
        intervals: list[dict[str, Any]]

        @contextlib.contextmanager
        def phase(self, name: str) -> Iterator[None]:
            started = time.time()
            try:
                with super().phase(name):
                    yield
            finally:
                self.intervals.append(
                    {
                        "phase": name,
                        "start": started,
                        "end": time.time(),
                        "thread": threading.current_thread().name,
                    }
                )

    return TimedTrainer


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def run_steps(
    trainer: Any, count: int, report: Report, key: str, extra: Any = None
) -> list[dict[str, Any]]:
    """`count` steps of the trainer's own loop; each record with its wall-clock window."""
    steps: list[dict[str, Any]] = []
    last_end = time.time()
    for _ in range(count):
        start = time.time()
        result = trainer.run_step()
        record = trainer.record(result)
        end = time.time()
        step = {
            "step": record["step"],
            "wall_s": end - last_end,  # from the last step's end to this one's
            "step_seconds": record["step_seconds"],
            "phase_seconds": record["phase_seconds"],
            "policy_version_lag": record["policy_version_lag"],
            "staleness": {str(lag): n for lag, n in result.staleness.items()},
            "trained_policy_version": trainer.version - 1,
            "reward_mean": record["reward_mean"],
            "kl": record["kl"],
            "window": [start, end],
        }
        for name in ("policy_behaviour_kl", "policy_behaviour_weight", "policy_grad_norm"):
            if name in record:
                step[name] = record[name]
        if extra is not None:
            step.update(extra(step))
        last_end = end
        steps.append(step)
        print(json.dumps({key: {k: v for k, v in step.items() if k != "window"}}), flush=True)
        report.update(**{f"{key}_steps": steps})
    return steps


def summarise_time_sliced(steps: list[dict[str, Any]]) -> dict[str, Any]:
    phases = {
        name: median([s["phase_seconds"].get(name, 0.0) for s in steps])
        for name in steps[-1]["phase_seconds"]
    }
    return {
        "step_s": median([s["wall_s"] for s in steps]),
        "step_s_all": [s["wall_s"] for s in steps],
        "phases": phases,
    }


def shared_step_figures(trainer: Any, rollout: Any, step: dict[str, Any]) -> dict[str, Any]:
    """One shared step from the intervals: the generation of the next batch that ran inside
    the step's window, the main thread's phases, and their overlap."""
    start, end = step["window"]
    main = [
        i
        for i in trainer.intervals
        if start <= i["start"] <= end and not i["thread"].startswith("rollout-ahead")
    ]
    ahead = [i for i in trainer.intervals if start <= i["start"] <= end and i not in main]
    calls = [c for c in rollout.calls if start <= c["start"] <= end]

    def total(name: str, intervals: list[dict[str, Any]]) -> float:
        return sum(i["end"] - i["start"] for i in intervals if i["phase"] == name)

    scoring = [i for i in main if i["phase"] in ("reference", "advantage", "update")]
    busy = (min(i["start"] for i in scoring), max(i["end"] for i in scoring)) if scoring else None
    updates = [(i["start"], i["end"]) for i in main if i["phase"] == "update"]
    figures: dict[str, Any] = {
        "update_s": total("update", main),
        "reference_s": total("reference", main),
        "advantage_s": total("advantage", main),
        "sync_s": total("sync", main),
        "generate_wait_s": total("generate", main),  # the main thread waiting for the batch
        "reward_s": total("reward", ahead) + total("reward", main),
    }
    if calls:
        generation = (calls[0]["start"], calls[-1]["end"])
        seconds = sum(c["end"] - c["start"] for c in calls)
        figures.update(
            generate_s=seconds,
            generate_rank_s=sum(c["rank_end"] - c["rank_start"] for c in calls),
            overlap_s=overlap(generation, busy) if busy else 0.0,
            overlap_update_s=sum(overlap(generation, u) for u in updates),
        )
        figures["overlap_fraction"] = figures["overlap_s"] / seconds if seconds else 0.0
        figures["overlap_update_fraction"] = (
            figures["overlap_update_s"] / seconds if seconds else 0.0
        )
    else:  # the first shared step generates its own batch, in line
        figures.update(generate_s=total("generate", main), overlap_s=0.0, overlap_fraction=0.0)
    return figures


def summarise_shared(steps: list[dict[str, Any]]) -> dict[str, Any]:
    keys = (
        "update_s",
        "reference_s",
        "advantage_s",
        "sync_s",
        "generate_s",
        "generate_rank_s",
        "generate_wait_s",
        "reward_s",
        "overlap_s",
        "overlap_fraction",
        "overlap_update_s",
        "overlap_update_fraction",
    )
    summary: dict[str, Any] = {
        "step_s": median([s["wall_s"] for s in steps]),
        "step_s_all": [s["wall_s"] for s in steps],
    }
    for key in keys:
        values = [s[key] for s in steps if key in s]
        if values:
            summary[key] = median(values)
    summary["staleness"] = max(s["policy_version_lag"] for s in steps)
    summary["batch_policy_versions"] = [
        {
            "step": s["step"],
            "trained_policy_version": s["trained_policy_version"],
            "generated_by_policy_version": s["trained_policy_version"] - s["policy_version_lag"],
        }
        for s in steps
    ]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/async")))
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny model")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="measured steps of each loop")
    parser.add_argument("--engine-util", type=float, default=0.3, help="gpuMemoryUtilization")
    parser.add_argument("--micro", type=int, default=0, help="0: 16 above 100 GB, else 8")
    parser.add_argument(
        "--engine-stream",
        default="side",
        help="comma-separated shared variants: side (own CUDA stream), default (the trainer's)",
    )
    parser.add_argument(
        "--deadline", type=float, default=0.0, help="seconds: skip a variant that would not fit"
    )
    args = parser.parse_args()
    began = time.perf_counter()
    streams = [s for s in args.engine_stream.split(",") if s]
    if any(s not in STREAMS for s in streams):
        parser.error(f"--engine-stream: each of {STREAMS}")
    args.out.mkdir(parents=True, exist_ok=True)
    bench(args, streams, began)


def bench(args: argparse.Namespace, streams: list[str], began: float) -> None:
    import ray
    import torch

    from rlhf_trainer.data.prompts import PromptItem
    from rlhf_trainer.run.ahead import BatchAhead
    from rlhf_trainer.run.loop import load_inputs
    from rlhf_trainer.run.sampling import Sampler
    from rlhfjob.api import RLHFJob

    tiny = args.tiny
    report = Report(args.out / "async-gpu.json", "python " + " ".join(sys.argv))
    versions = report.data.pop("versions")
    report.data = {
        "benchmark": "async-gpu",
        "command": report.data["command"],
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "gpu": versions.get("gpu", "none (CPU smoke test)"),
            "gpu_memory_bytes": versions.get("gpu_memory_bytes"),
            "cpu_cores": os.cpu_count(),
        },
        "versions": versions,
    }
    micro = args.micro or (
        16 if torch.cuda.is_available() and versions.get("gpu_memory_bytes", 0) > 100e9 else 8
    )
    prompts_n, group = (4, 4) if tiny else (64, 8)
    prompt_len, response_len = (8, 8) if tiny else (256, 512)
    shape = "tiny" if tiny else "0.5b"
    document = job_document(
        shape,
        tiny=tiny,
        prompts=prompts_n,
        group=group,
        prompt_len=prompt_len,
        response_len=response_len,
        micro=4 if tiny else micro,
        sleep_level=2,
        checkpoint="/tmp/rlhf-bench-async",
        memory_utilization=args.engine_util,
    )
    job = RLHFJob.model_validate(document)
    config = document["spec"]["model"]["randomInit"]
    report.update(
        model={"shape": shape, "config": config},
        batch={
            "prompts": prompts_n,
            "samples_per_prompt": group,
            "prompt_tokens": prompt_len,
            "response_tokens": response_len,
            "micro_batch": document["spec"]["algorithm"]["microBatchSize"],
            "algorithm": "grpo",
        },
        job=document["spec"],
        warmup_steps=args.warmup,
        measured_steps=args.steps,
    )
    vocab = config["vocab_size"]
    rng = random.Random(0)
    inputs = load_inputs(job.spec, check_model=False)
    inputs.prompts = [
        PromptItem([rng.randrange(1, vocab) for _ in range(prompt_len)]) for _ in range(4096)
    ]
    ray.init(
        num_cpus=os.cpu_count(),
        resources={"rlhf-role-trainer": 1.0},
        include_dashboard=False,
    )
    started = time.perf_counter()
    trainer = timed_trainer_class()(job, inputs, threading.Event(), detached=False)
    trainer.intervals = []
    report.update(startup_s=time.perf_counter() - started)
    rank = trainer.policy.actors[0]

    def on_rank(fn: Any, *fn_args: Any) -> Any:
        return ray.get(rank.__ray_call__.remote(fn, *fn_args))

    try:
        facts = on_rank(rank_facts)
        report.data["model"]["params"] = facts.pop("params")
        report.update(rank=facts)

        with report.section("time_sliced"):
            trainer.sync_weights()
            run_steps(trainer, args.warmup, report, "time_sliced_warmup")
            on_rank(start_sampling)
            steps = run_steps(trainer, args.steps, report, "time_sliced")
            memory = on_rank(stop_sampling)
            colocation = on_rank(colocation_report)
            summary = summarise_time_sliced(steps)
            summary.update(
                peak_gpu_bytes=memory.get("gpu_peak_bytes"),
                memory=memory,
                colocation=colocation,
                engine_gpu_memory_utilization=args.engine_util,
                sleep_level=2,
            )
            report.update(time_sliced=summary)
        time_sliced_s = time.perf_counter() - started

        # The shared loop: the same trainer and engine, the engine awake for good.
        algorithm = trainer.algorithm.model_copy(update={"max_staleness": 1})
        trainer.algorithm = algorithm
        rollout = shared_rollout(trainer.policy)
        trainer.fleet = rollout
        position = trainer.sampler.data.position
        trainer.sampler = Sampler(
            trainer.spec.model_copy(update={"algorithm": algorithm}),
            trainer.inputs,
            rollout,
            trainer.metrics,
            trainer.phase,
            trainer.actors.reward_models,
        )
        trainer.sampler.rewind(position)
        trainer.ahead = BatchAhead(
            trainer.sampler, trainer.total_steps, trainer.sync_weights, trainer.log
        )
        shared_runs: dict[str, Any] = {}
        first_wake: dict[str, Any] | None = None
        for stream in streams:
            elapsed = time.perf_counter() - began
            per_loop = time_sliced_s - report.data["startup_s"]
            if args.deadline and shared_runs and elapsed + per_loop > args.deadline:
                report.update(skipped=f"shared-{stream}: {elapsed:.0f} s gone of {args.deadline}")
                continue
            with report.section(f"shared_{stream}"):
                trainer.checkpoints.wait()
                trainer.ahead.next = None  # the first step samples its own batch
                woken = on_rank(enter_shared, stream)
                first_wake = first_wake or woken  # a later variant finds the engine awake
                synced = trainer.fleet.sync(trainer.version)
                report.data["rank"]["weights_bytes"] = synced.bytes
                trainer.intervals.clear()
                rollout.calls.clear()

                def figures(step: dict[str, Any]) -> dict[str, Any]:
                    return shared_step_figures(trainer, rollout, step)

                run_steps(trainer, args.warmup, report, f"shared_{stream}_warmup", figures)
                on_rank(start_sampling)
                steps = run_steps(trainer, args.steps, report, f"shared_{stream}", figures)
                memory = on_rank(stop_sampling)
                summary = summarise_shared(steps)
                total = memory.get("gpu_total_bytes", 0)
                in_allocator = max(first_wake["wake_in_allocator_bytes"], 0)
                summary.update(
                    engine_stream=stream,
                    engine_gpu_memory_utilization=args.engine_util,
                    engine_budget_bytes=int(args.engine_util * total),
                    engine_kv_cache_bytes=first_wake["kv_cache_bytes"],
                    engine_weights_bytes=synced.bytes,
                    peak_gpu_bytes=memory.get("gpu_peak_bytes"),
                    # The rank's caching allocator: the trainer, plus the engine's activations
                    # (its weights and KV cache live in vLLM's own pool when counted apart).
                    trainer_peak_gpu_bytes=memory.get("allocator_peak_reserved_bytes", 0)
                    - in_allocator,
                    memory=memory,
                    wake=woken,
                )
                shared_runs[stream] = summary
                report.update(shared_runs=shared_runs)
                finish(report, shared_runs, streams)
    finally:
        trainer.shutdown()
        ray.shutdown()
    print(json.dumps(report.data, indent=2, default=str), flush=True)


def finish(report: Report, shared_runs: dict[str, Any], streams: list[str]) -> None:
    """The top-level figures: the first shared variant that ran is `shared`."""
    time_sliced = report.data.get("time_sliced")
    primary = next((shared_runs[s] for s in streams if s in shared_runs), None)
    if not time_sliced or primary is None:
        return
    engine_bytes = primary["engine_kv_cache_bytes"] + (primary["engine_weights_bytes"] or 0)
    shared = {
        "step_s": primary["step_s"],
        "update_s": primary.get("update_s"),
        "reference_s": primary.get("reference_s"),
        "generate_s": primary.get("generate_s"),
        "generate_wait_s": primary.get("generate_wait_s"),
        "sync_s": primary.get("sync_s"),
        "overlap_fraction": primary.get("overlap_fraction"),
        "overlap_update_fraction": primary.get("overlap_update_fraction"),
        "engine_gpu_memory_utilization": primary["engine_gpu_memory_utilization"],
        "engine_gpu_bytes": engine_bytes,
        "engine_budget_bytes": primary["engine_budget_bytes"],
        "trainer_peak_gpu_bytes": primary["trainer_peak_gpu_bytes"],
        "peak_gpu_bytes": primary["peak_gpu_bytes"],
        "staleness": primary["staleness"],
        "engine_stream": primary["engine_stream"],
    }
    # The ceiling: the time-sliced phases with generation perfectly hidden behind scoring and
    # the update (each at its time-sliced speed), plus the weight sync.
    phases = time_sliced["phases"]
    scoring = sum(phases.get(name, 0.0) for name in ("reference", "advantage", "update"))
    ideal = max(phases.get("generate", 0.0) + phases.get("reward", 0.0), scoring)
    ideal += phases.get("sync", 0.0)
    speedup = time_sliced["step_s"] / primary["step_s"]
    report.update(
        speedup_shared_gpu=speedup,
        speedup_bound=time_sliced["step_s"] / ideal if ideal else None,
        shared=shared,
        speedups_by_stream={
            s: time_sliced["step_s"] / run["step_s"] for s, run in shared_runs.items()
        },
    )
    report.update(note=measured_note(time_sliced, primary, speedup, report.data["speedup_bound"]))


def measured_note(
    time_sliced: dict[str, Any], shared: dict[str, Any], speedup: float, bound: float | None
) -> str:
    """What the figures say, in words (written by the run; the reasons are for a reader)."""
    phases = time_sliced["phases"]

    def slower(mine: float | None, alone: float) -> str:
        return f"{mine / alone:.2f}x its time-sliced {alone:.2f} s" if mine and alone else "n/a"

    verdict = "wins" if speedup > 1.02 else "loses" if speedup < 0.98 else "breaks even"
    return (
        f"The spatially shared loop {verdict}: {shared['step_s']:.2f} s a step against "
        f"{time_sliced['step_s']:.2f} s time-sliced (speedup {speedup:.2f}; the ceiling with "
        f"generation fully hidden at its time-sliced speed is {bound or 0:.2f}). "
        f"Generating the next batch took {shared.get('generate_s', 0):.2f} s "
        f"({slower(shared.get('generate_s'), phases.get('generate', 0.0))}, with engine "
        f"log-probs, which staleness needs), {100 * shared.get('overlap_fraction', 0):.0f} % of "
        f"it beside scoring and the update; the update took {shared.get('update_s', 0):.2f} s "
        f"({slower(shared.get('update_s'), phases.get('update', 0.0))}), scoring "
        f"{shared.get('reference_s', 0):.2f} s "
        f"({slower(shared.get('reference_s'), phases.get('reference', 0.0))}); the step waited "
        f"{shared.get('generate_wait_s', 0):.2f} s for the batch after the update, and the "
        f"weight sync took {shared.get('sync_s', 0):.3f} s."
    )


if __name__ == "__main__":
    main()
