"""The local demo: a tiny GRPO job under the operator that survives an injected failure.

    rlhfjob demo [--keep-cluster] [--out runs/demo]

1. start the local control plane (built on first use) and the operator with the chart's RBAC;
2. apply `examples/grpo-tiny-cpu.yaml`: KubeRay and the stand-in Ray bring up its cluster and
   the operator submits the real trainer (2 ZeRO-3 ranks, 2 rollout engines);
3. once a checkpoint exists, kill the trainer's driver process (SIGKILL, as an OOM kill would);
4. the operator notices the failed Ray job and resubmits it with `--resume-from latest`;
5. the job succeeds; the reward curve is written as a PNG next to a summary JSON.

A live status line shows phase, step, the latest reward and tokens/s, restarts and the last
checkpoint throughout.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from rlhf_local import cluster
from rlhf_local.faults import driver_pid
from rlhf_local.jobs import ray_token
from rlhf_local.paths import REPO_ROOT
from rlhf_local.session import operator_session
from rlhfjob import api
from rlhfjob.contract.kuberay import RAY_CLUSTERS, RAY_GROUP, RAY_VERSION

EXAMPLE = REPO_ROOT / "examples" / "grpo-tiny-cpu.yaml"
TIMEOUT = 1800.0


def _say(message: str) -> None:
    print(f"\r\033[K[demo] {message}", file=sys.stderr, flush=True)


def _status_line(job: dict[str, Any]) -> str:
    status = job.get("status") or {}
    checkpoint = (status.get("lastCheckpoint") or {}).get("step", "-")
    progress = status.get("progress") or {}
    reward, tokens = progress.get("rewardMean"), progress.get("tokensPerSecond")
    return (
        f"phase={status.get('phase', '-'):<12} step={status.get('currentStep', '-')}"
        f"/{status.get('totalSteps', '-')} "
        f"reward={'-' if reward is None else f'{reward:.3f}'} "
        f"tokens/s={'-' if tokens is None else f'{tokens:.0f}'} "
        f"restarts={status.get('restartCount', 0)} "
        f"checkpoint={checkpoint}  {status.get('message', '')[:60]}"
    )


def _plot(curve: list[tuple[int, float]], restarts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    steps, rewards = zip(*curve, strict=True) if curve else ((), ())
    axes.plot(steps, rewards, marker=".", label="mean reward")
    for step in restarts:
        axes.axvline(step, color="tab:red", linestyle="--", label="resumed after failure")
    axes.set_xlabel("training step")
    axes.set_ylabel("mean reward (max 1.0)")
    axes.set_ylim(0, 1.05)
    axes.set_title("GRPO on the local cluster: reward per step")
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _reward_curve(log_path: Path) -> list[tuple[int, float]]:
    """Step → mean reward from the trainer's JSON-lines log; a resumed step's later line wins."""
    by_step: dict[int, float] = {}
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "step" in record and "reward_mean" in record:
                by_step[int(record["step"])] = float(record["reward_mean"])
    return sorted(by_step.items())


def run(out: Path, keep_cluster: bool = False) -> int:
    out.mkdir(parents=True, exist_ok=True)
    manifest = yaml.safe_load(EXAMPLE.read_text())
    checkpoints = out / "checkpoints"
    manifest["spec"]["checkpoint"]["path"] = str(checkpoints.resolve())
    name = manifest["metadata"]["name"]
    injected_at: int | None = None
    job: dict[str, Any] = {}
    with operator_session(
        "demo", operator_log=out / "operator.log", keep_namespace=True, say=_say
    ) as session:
        lc, namespace = session.lc, session.namespace
        manifest["metadata"]["namespace"] = namespace
        lc.custom.create_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.PLURAL, manifest
        )
        _say(f"applied {EXAMPLE.name} as {namespace}/{name}")
        started = time.monotonic()
        while time.monotonic() - started < TIMEOUT:
            job = lc.custom.get_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.PLURAL, name
            )  # type: ignore[assignment]
            status = job.get("status") or {}
            print(f"\r\033[K{_status_line(job)}", end="", file=sys.stderr, flush=True)
            if status.get("phase") in ("Succeeded", "Failed"):
                break
            checkpoint = (status.get("lastCheckpoint") or {}).get("step")
            if injected_at is None and checkpoint and status.get("phase") == "Running":
                cluster_body = lc.custom.get_namespaced_custom_object(
                    RAY_GROUP, RAY_VERSION, namespace, RAY_CLUSTERS, name
                )
                token = ray_token(lc, namespace, cluster_body)  # type: ignore[arg-type]
                pid = driver_pid(status["dashboardUrl"], status["submissionId"], token)
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    injected_at = int(status.get("currentStep") or checkpoint)
                    _say(f"injected a failure: killed the trainer driver (pid {pid}) at step "
                         f"{injected_at}; last checkpoint at step {checkpoint}")  # fmt: skip
            time.sleep(1)
        print(file=sys.stderr)

    status = job.get("status") or {}
    log_path = checkpoints / namespace / name / "metrics.jsonl"
    curve = _reward_curve(log_path)
    resumed = [r.get("resumedFromStep") or 0 for r in status.get("restartHistory", [])]
    _plot(curve, resumed, out / "reward-curve.png")
    summary = {
        "job": f"{namespace}/{name}",
        "phase": status.get("phase"),
        "restarts": status.get("restartHistory", []),
        "failure_injected_at_step": injected_at,
        "final_reward": curve[-1][1] if curve else None,
        "reward_curve": curve,
        "seconds": round(time.monotonic() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _say(f"{status.get('phase')}: {status.get('message')}")
    _say(f"reward curve: {out / 'reward-curve.png'}; summary: {out / 'summary.json'}")
    if not keep_cluster and not session.cluster_was_running:
        cluster.down()
    ok = status.get("phase") == "Succeeded" and injected_at is not None and resumed
    return 0 if ok else 1
