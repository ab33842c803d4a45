"""Reading the trainer's JSON-lines step log back, and drawing its reward curve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EVALUATION_KIND = "evaluation"
"""`kind` of an evaluation's line in the step log (`rlhf_trainer.run.metrics`)."""


def read_step_log(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """One record per step, in step order: the steps' (`kind` None) or the evaluations'
    (`kind="evaluation"`). A resumed run rewrites steps: the later line wins."""
    by_step: dict[int, dict[str, Any]] = {}
    if not path.is_file():
        return []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            if record.get("kind") == kind:
                by_step[int(record["step"])] = record
    return [by_step[step] for step in sorted(by_step)]


def plot_reward_curve(
    records: list[dict[str, Any]],
    path: Path,
    title: str = "",
    evaluations: list[dict[str, Any]] | None = None,
) -> Path:
    """Mean reward per step (with a +-std band) as a PNG, and the held-out evaluations' greedy
    score as points on it; matplotlib's Agg backend, no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [record["step"] for record in records]
    means = [record["reward_mean"] for record in records]
    stds = [record.get("reward_std") or 0.0 for record in records]
    figure, axes = plt.subplots(figsize=(6, 3.5), dpi=100)
    axes.plot(steps, means, label="reward mean")
    axes.fill_between(
        steps,
        [m - s for m, s in zip(means, stds, strict=True)],
        [m + s for m, s in zip(means, stds, strict=True)],
        alpha=0.2,
        label="± std",
    )
    held_out = [e for e in evaluations or [] if e.get("score") is not None]
    if held_out:
        axes.plot(
            [e["step"] for e in held_out],
            [e["score"] for e in held_out],
            "o--",
            label="held-out score (greedy)",
        )
    axes.set_xlabel("step")
    axes.set_ylabel("reward")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
