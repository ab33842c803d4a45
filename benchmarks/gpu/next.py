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


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / name).read_text())
    return data


def main() -> None:
    update = load("gpu-update-liger.json")
    runs = [r for r in update["runs"] if r["shape"] == "1.5b"]
    liger = [r for r in runs if r["variant"].endswith("-liger")]
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
    figures: dict[str, Any] = {
        "update_mfu_1_5b": best["mfu"],
        "update_mfu_1_5b_run": f"trainer, {best['variant']}, micro-batch {best['micro_batch']}",
        "update_vs_plain_ratio_1_5b": paired["vs_plain"],
        "update_vs_plain_run": f"trainer, {paired['variant']}, micro-batch {paired['micro_batch']}",
        "fused_logprob_max_abs_diff": kernels["logprob_max_abs_diff_liger"],
        "eager_bf16_logprob_max_abs_diff": kernels["logprob_max_abs_diff_eager"],
        "zero3_vs_plain_ratio_1_gpu": zero3["vs_plain"],
        "zero3_note": (
            "measured 2026-12-01, not improved: ZeRO-3's per-layer gathers partition nothing on "
            "one GPU, so the trainer runs ZeRO-2 there (1.02x plain); ZeRO-3 stays for several "
            "ranks and for loading a model partitioned"
        ),
        "model_7b": None,
        "model_7b_note": (
            "not run yet; the arithmetic (BENCHMARKS.md): 20 bytes a parameter of training "
            "state, 152 GB for 7.6 B, exceed the H200's 141 GB; with the optimizer offloaded the "
            "GPU holds 30 GB and the host 122 GB, which the trainer's config does not offer yet"
        ),
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
    }
    figures["goals"] = {
        key: {
            "goal": f"{op} {bound:.4g}",
            "met": figures[key] >= bound if op == ">=" else figures[key] <= bound,
        }
        for key, (op, bound) in goals.items()
    }
    figures["sources"] = {
        "update": update["command"],
        "kernels": kernels["command"],
        "checkpoint": stall["command"],
        "zero3": "gpu-colocated.json (benchmarks/gpu/colocated.py update)",
    }
    (RESULTS / "gpu-next.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures["goals"], indent=2))


if __name__ == "__main__":
    main()
