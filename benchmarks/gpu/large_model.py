"""A 7B-class model trained colocated on one H200 by the unmodified `rlhfjob train`.

    python benchmarks/gpu/large_model.py save --work DIR --out OUT   # the model, CPU Adam built
    python benchmarks/gpu/large_model.py job  --work DIR --out OUT   # examples/grpo-7b-1gpu.yaml

* ``save``: a Hugging Face directory of the Qwen2.5-7B shape (28 layers, hidden 3584, MLP
  18944, 28 heads, 4 KV heads, untied embeddings; ``--vocab``, Qwen's 152,064 by default) with
  random bf16 weights, drawn on the GPU; then DeepSpeed's CPU Adam extension is built (JIT, as
  a job's first start would), so the job's timings do not include the compiler. The arithmetic
  of the state goes into the report: GPU and host bytes a parameter, with and without offload.
* ``job``: `examples/grpo-7b-1gpu.yaml` as it is (the optimizer in host memory, activation
  checkpointing, Liger's kernels, vLLM asleep at level 2 during the update), pointed at that
  directory, for ``--steps`` steps or ``--deadline`` seconds, whichever comes first. GPU memory
  (``nvidia-smi``) and host memory (``/proc/meminfo``) are sampled every second. The job is
  then killed rather than stopped: its checkpoint (16 bytes a parameter of optimizer state
  plus the weights) would not fit the GPU machine's disk, and no checkpoint is asked of it.

Each writes ``OUT/large-model.json`` as it goes (a failure keeps what was measured); ``--tiny``
runs the same path on a small model (a smoke test of this script on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from colocated import Report

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo-7b-1gpu.yaml"

QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
TINY = {**QWEN25_7B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip

GPU_BYTES_OFFLOADED = 2 + 2
"""A parameter's GPU bytes with the optimizer offloaded: bf16 weight and bf16 gradient."""
HOST_BYTES_OFFLOADED = 4 + 4 + 4 + 4
"""Its host bytes: fp32 master weight, AdamW's two fp32 moments, the fp32 gradient."""
BYTES_WHOLE = GPU_BYTES_OFFLOADED + HOST_BYTES_OFFLOADED
"""All of it on the GPU (the fp32 gradient being the one DeepSpeed's bf16 optimizer
accumulates in)."""


def model_dir(work: Path) -> Path:
    return work / "models" / "qwen2.5-7b"


def save(args: argparse.Namespace, report: Report) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_trainer.rollout.model_source import causal_lm_config

    shape = {**(TINY if args.tiny else QWEN25_7B), "vocab_size": args.vocab}
    with report.section("save"):
        started = time.perf_counter()
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(causal_lm_config(shape), dtype=torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(model_dir(Path(args.work)))
        del model
        torch.cuda.empty_cache()
        report.update(
            shape=shape,
            params=params,
            save_seconds=time.perf_counter() - started,
            state_gb={
                "whole_on_gpu": params * BYTES_WHOLE / 1e9,
                "gpu_offloaded": params * GPU_BYTES_OFFLOADED / 1e9,
                "host_offloaded": params * HOST_BYTES_OFFLOADED / 1e9,
                "gpu_total": torch.cuda.get_device_properties(0).total_memory / 1e9,
                "host_total": _meminfo()["MemTotal"] / 1e9,
                "host_available_before": _meminfo()["MemAvailable"] / 1e9,
            },
        )
    with report.section("cpu_adam_build"):
        from deepspeed.ops.op_builder import CPUAdamBuilder

        started = time.perf_counter()
        CPUAdamBuilder().load()
        report.update(cpu_adam_build_seconds=time.perf_counter() - started)


def _meminfo() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return fields


class Sampler(threading.Thread):
    """GPU and host memory in use, every second, while the job runs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float, float]] = []  # seconds, GPU GB, host GB
        self.stopped = threading.Event()
        self.started_at = time.perf_counter()

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            gpu = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, check=False,
            ).stdout.split()  # fmt: skip
            info = _meminfo()
            self.samples.append(
                (
                    time.perf_counter() - self.started_at,
                    float(gpu[0]) * 2**20 / 1e9 if gpu else float("nan"),
                    (info["MemTotal"] - info["MemAvailable"]) / 1e9,
                )
            )


def job(args: argparse.Namespace, report: Report) -> None:
    work = Path(args.work)
    document = yaml.safe_load(EXAMPLE.read_text())
    spec = document["spec"]
    spec["model"]["policy"] = str(model_dir(work))
    spec["checkpoint"] = {"path": str(work / "checkpoints"), "intervalSteps": 1_000_000}
    job_path = work / "grpo-7b-1gpu.yaml"
    job_path.write_text(yaml.safe_dump(document))
    run_dir = work / "checkpoints" / "default" / document["metadata"]["name"]
    metrics = run_dir / "metrics.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env["RAY_memory_monitor_refresh_ms"] = "0"  # Ray would kill the rank near full host memory
    log = Path(args.out) / "large-model-job.log"
    sampler = Sampler()
    sampler.start()
    started = time.perf_counter()
    with report.section("job"), log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "rlhfjob_cli", "train", "--config", str(job_path)],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True,
        )  # fmt: skip
        first_step_at = None
        while process.poll() is None and time.perf_counter() - started < args.deadline:
            done = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
            if done and first_step_at is None:
                first_step_at = time.perf_counter() - started
            if done >= args.steps:
                break
            time.sleep(1.0)
        exit_code = process.poll()
        if exit_code is None:
            os.killpg(process.pid, signal.SIGKILL)  # see the module docstring
            process.wait()
        sampler.stopped.set()
        report.update(
            job_seconds=time.perf_counter() - started,
            first_step_after_seconds=first_step_at,
            exit_before_stop=exit_code,
            log_tail=log.read_text()[-4000:],
        )
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    steps = [json.loads(line) for line in lines]
    rows = spec["algorithm"]["promptsPerStep"] * spec["algorithm"]["groupSize"]
    from rlhf_trainer.data.tasks import get_task

    prompt_tokens = rows * get_task(spec["dataset"]["source"].split(":", 1)[1]).prompt_length
    rewards = [s["reward_mean"] for s in steps]
    later = steps[1:] or steps  # the first step includes vLLM's and the optimizer's warm-up
    window = max(1, min(3, len(rewards) // 2))
    kept = ("step", "reward_mean", "step_seconds", "phase_seconds", "generated_tokens")
    update_rates = [
        (s["generated_tokens"] + prompt_tokens) / s["phase_seconds"]["update"] for s in later
    ]
    report.update(
        spec=spec,
        steps=[{k: s.get(k) for k in kept} for s in steps],
        model_7b_step_seconds=statistics.median(s["step_seconds"] for s in later)
        if steps
        else None,
        model_7b_update_tokens_per_s=statistics.median(update_rates) if steps else None,
        model_7b_peak_gpu_gb=max((g for _, g, _ in sampler.samples), default=None),
        model_7b_peak_host_gb=max((h for _, _, h in sampler.samples), default=None),
        model_7b_reward_first_steps=statistics.mean(rewards[:window]) if rewards else None,
        model_7b_reward_last_steps=statistics.mean(rewards[-window:]) if rewards else None,
        memory_samples=[[round(t, 1), round(g, 2), round(h, 2)] for t, g, h in sampler.samples],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("save", "job"))
    parser.add_argument("--work", default="/tmp/rlhf-7b")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/large-model"))
    parser.add_argument("--vocab", type=int, default=152064, help="save: the vocabulary size")
    parser.add_argument("--steps", type=int, default=12, help="job: steps to train")
    parser.add_argument("--deadline", type=float, default=480, help="job: seconds at most")
    parser.add_argument("--tiny", action="store_true", help="save: a small model (smoke test)")
    args = parser.parse_args()
    report = Report(
        Path(args.out) / "large-model.json", " ".join(sys.argv), extend=args.part == "job"
    )
    (save if args.part == "save" else job)(args, report)


if __name__ == "__main__":
    main()
