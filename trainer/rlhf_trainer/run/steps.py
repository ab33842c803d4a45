"""What a step reports: `StepResult` and its progress line (`rlhf_trainer.run.reporting`
publishes it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf_trainer.algo.experience import SampledStep


@dataclass
class StepResult:
    step: int
    reward_mean: float
    reward_std: float
    kl: float | None
    policy: dict[str, float]
    critic: dict[str, float]
    version_lag: int
    reward_components: dict[str, float] = field(default_factory=dict)
    """Each part's mean score before weighting (one entry for a single-source reward)."""
    sampling: dict[str, float] = field(default_factory=dict)
    """What dynamic sampling did (rollouts generated, groups dropped and refilled) and the
    environment's figures (turns, tool calls, truncations)."""
    staleness: dict[int, int] = field(default_factory=dict)
    """How many samples lagged the policy by how many updates (`{0: n}` on-policy)."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """Some of its prompts, responses and rewards, for the trackers' table (when due)."""


def step_result(
    step: int,
    trained_version: int,
    sampled: SampledStep,
    kl: float | None,
    policy: dict[str, float],
    critic: dict[str, float],
) -> StepResult:
    """What step `step` reports, having updated the policy of version `trained_version`."""
    reported = sampled.task_rewards  # the reward function's, of every sampled response
    lags = [trained_version - version for version in sampled.rollout.policy_versions]
    return StepResult(
        step=step,
        reward_mean=float(reported.mean()),
        reward_std=float(reported.std()) if len(reported) > 1 else 0.0,
        kl=kl,
        policy=policy,
        critic=critic,
        version_lag=max(lags),  # 0: fully on-policy
        reward_components=sampled.reward_components,
        sampling=sampled.report,
        staleness={lag: lags.count(lag) for lag in sorted(set(lags))},
    )


def progress_line(record: dict[str, Any], total_steps: int) -> str:
    """One line per step: step/total, reward, KL, losses, step seconds and its slowest phases."""
    width = len(str(total_steps))
    parts = [
        f"step {record['step']:>{width}}/{total_steps}",
        f"reward {record['reward_mean']:.3f} ±{record['reward_std']:.3f}",
    ]
    components = record.get("reward_components") or {}
    if len(components) > 1:  # what each part of a combined reward scored
        parts[-1] += " (" + ", ".join(f"{n} {v:.3f}" for n, v in components.items()) + ")"
    if record.get("kl") is not None:
        parts.append(f"kl {record['kl']:.4f}")
    if record.get("policy_loss") is not None:
        parts.append(f"loss {record['policy_loss']:+.4f}")
    if record.get("value_loss") is not None:
        parts.append(f"value loss {record['value_loss']:.4f}")
    if record.get("dropped_groups"):  # dynamic sampling
        parts.append(
            f"{record['dropped_groups']} groups dropped in {record['generation_batches']} rollouts"
        )
    if record.get("env_turns_mean") is not None:  # multi-turn trajectories
        parts.append(
            f"turns {record['env_turns_mean']:.2f}, tool calls {record['env_tool_calls']:.0f}"
            f", truncated {record['env_truncated']:.0f}"
        )
    slowest = sorted(record.get("phase_seconds", {}).items(), key=lambda item: -item[1])[:3]
    breakdown = ", ".join(f"{name} {seconds:.2f}" for name, seconds in slowest)
    parts.append(f"{record['step_seconds']:.2f} s ({breakdown})")
    return " | ".join(parts)
