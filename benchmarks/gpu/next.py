"""Issue 25's figures in one file, `benchmarks/results/gpu-next.json`, from the GPU results
they were measured in (each beside its own ceiling), with each goal and whether it is met.

    python benchmarks/gpu/next.py      # reads and writes benchmarks/results/

Nothing here is measured: rerun the benchmark a figure names, then this.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
LARGE_MODEL_KEYS = (
    "model_7b_step_seconds",
    "model_7b_update_tokens_per_s",
    "model_7b_peak_gpu_gb",
    "model_7b_peak_host_gb",
    "model_7b_reward_first_steps",
    "model_7b_reward_last_steps",
)
"""The 7B-class job's figures, as `large_model.py job` names them."""


UPDATE_RESULTS = (
    "gpu-update-liger.json",
    "gpu-update-fusedlp.json",
    "gpu-update-compiledlp-field.json",
    "gpu-update-compiled.json",
)
"""The calls of `colocated.py update` with Liger's kernels, oldest first."""


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / name).read_text())
    return data


def describe(run: dict[str, Any]) -> str:
    return f"trainer, {run['variant']}, micro-batch {run['micro_batch']} ({run['file']})"


def main() -> None:
    # Every run of the trainer's update with Liger's kernels (each file's MFU and vs-plain
    # against the ceiling and the plain step of its own call), its file beside it.
    updates = {name: load(name) for name in UPDATE_RESULTS}
    liger = [
        {**run, "file": name}
        for name, update in updates.items()
        for run in update["runs"]
        if run["shape"] == "1.5b" and "-liger" in run["variant"]
    ]
    best = max(liger, key=lambda r: r["mfu"])
    paired = max((r for r in liger if r.get("vs_plain")), key=lambda r: r["vs_plain"])
    kernels = load("gpu-kernels-check.json")
    colocated = load("gpu-colocated.json")
    zero3 = next(
        r
        for r in colocated["benchmarks"]["update"]["runs"]
        if r["shape"] == "1.5b" and r["variant"] == "zero3"
    )
    stall = load("gpu-checkpoint-stall.json")
    large = load("gpu-large-model.json")
    figures: dict[str, Any] = {
        "update_mfu_1_5b": best["mfu"],
        "update_mfu_1_5b_run": describe(best),
        "update_vs_plain_ratio_1_5b": paired["vs_plain"],
        "update_vs_plain_run": describe(paired),
        "fused_logprob_max_abs_diff": kernels["logprob_max_abs_diff_liger"],
        "eager_bf16_logprob_max_abs_diff": kernels["logprob_max_abs_diff_eager"],
        "zero3_vs_plain_ratio_1_gpu": zero3["vs_plain"],
        "zero3_note": (
            "measured 2026-12-01, not improved: ZeRO-3's per-layer gathers partition nothing on "
            "one GPU, so the trainer runs ZeRO-2 there (1.02x plain); ZeRO-3 stays for several "
            "ranks and for loading a model partitioned"
        ),
        **{key: large[key] for key in LARGE_MODEL_KEYS},
        "model_7b_params": large["params"],
        "model_7b_shape": (
            "Qwen2.5-7B's decoder (28 layers, hidden 3584, MLP 18944, 28 heads, 4 KV heads) with "
            f"a {large['shape']['vocab_size']:,}-token vocabulary; Qwen's own 152,064 makes "
            "7.6 B parameters, whose 122 GB of offloaded optimizer state leave this 135 GB "
            "host too little for the processes beside it (BENCHMARKS.md)"
        ),
        "largest_shape_trained": {
            "params": large["params"],
            **{k: large["shape"][k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
            "arithmetic": (
                "offloaded optimizer state is 16 bytes a parameter in host memory: 7.6 B x 16 = "
                "122 GB for Qwen's 152,064-token vocabulary, with the trainer's and vLLM's "
                "processes beside it over this 135 GB host; 6.75 B x 16 = 108 GB fits"
            ),
        },
        "checkpoint_blocking_seconds_0_5b": stall["checkpoint_blocking_seconds_0_5b"],
        "stall_fraction": stall["stall_fraction"],
        "checkpoint_stall_percent": stall["checkpoint_stall_percent"],
    }
    goals = {
        "update_mfu_1_5b": (">=", 0.55),
        "update_vs_plain_ratio_1_5b": (">=", 1.2),
        "fused_logprob_max_abs_diff": ("<=", kernels["logprob_max_abs_diff_eager"]),
        "zero3_vs_plain_ratio_1_gpu": (">=", 0.9),
        "checkpoint_blocking_seconds_0_5b": ("<=", 1.0),
        "stall_fraction": ("<=", 0.10),
        "checkpoint_stall_percent": ("<=", 1.0),
        "model_7b_reward_last_steps": (">", large["model_7b_reward_first_steps"]),
    }
    figures["goals"] = {
        key: {
            "goal": f"{op} {bound:.4g}",
            "met": {">=": figures[key] >= bound, ">": figures[key] > bound}.get(
                op, figures[key] <= bound
            ),
        }
        for key, (op, bound) in goals.items()
    }
    figures["sources"] = {
        **{f"update ({name})": update["command"] for name, update in updates.items()},
        "kernels": kernels["command"],
        "checkpoint": stall["command"],
        "zero3": "gpu-colocated.json (benchmarks/gpu/colocated.py update)",
        "model_7b": large["command"],
    }
    (RESULTS / "gpu-next.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures["goals"], indent=2))


if __name__ == "__main__":
    main()
