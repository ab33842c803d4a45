"""Agentic RL (`spec.environment`, issue 51): environments, their tools and multi-turn rollouts.

* `base`: the interface a researcher implements (`reset`, `step`), `ENVIRONMENTS` by name, and
  `ToolBox`, the only way to the job's tools (run in its sandbox, never in this process).
* `tool_calling`, `multiplication`: the built-in environments.
* `toolcalls`, `chat`: tool calls in the model's own format; messages to tokens with the
  tokenizer's chat template.
* `episodes`: the scheduler that samples trajectories on the engines and masks the
  environment's tokens out of training.
* `loading`: the environment at start-up.

`environment_reward` is the reward function that passes an environment's own reward on
(`reward.function: rlhf_trainer.environments:environment_reward`); `tool_use_reward` is a format
reward to add to it (`reward.type: combined`) while a model learns to call its tools at all.
"""

from __future__ import annotations

from typing import Any

from rlhf_trainer.environments import multiplication, tool_calling
from rlhf_trainer.environments.base import ENVIRONMENTS, EnvStep, ToolBox, ToolRunner, Turn
from rlhf_trainer.environments.episodes import EPISODE_KEY

__all__ = [
    "ENVIRONMENTS",
    "EPISODE_KEY",
    "EnvStep",
    "ToolBox",
    "ToolRunner",
    "Turn",
    "environment_reward",
    "multiplication",
    "tool_calling",
    "tool_use_reward",
]


def environment_reward(
    prompts: list[list[int]], responses: list[list[int]], metadata: list[dict[str, Any]]
) -> list[float]:
    """Each trajectory's reward as its environment scored it (the sum of its steps' rewards;
    0 where it gave none, or for a row that is no trajectory)."""
    del prompts, responses
    rewards = []
    for record in metadata:
        reward = (record.get(EPISODE_KEY) or {}).get("reward")
        rewards.append(float(reward) if reward is not None else 0.0)
    return rewards


def tool_use_reward(
    prompts: list[list[int]], responses: list[list[int]], metadata: list[dict[str, Any]]
) -> list[float]:
    """1 for a trajectory with a tool call that ran (outcome ok), 0.5 for one whose calls all
    failed or were malformed, 0 for one without a call: a dense signal for a model that calls
    no tool yet, to add with a small weight to the task's reward."""
    del prompts, responses
    rewards = []
    for record in metadata:
        episode = record.get(EPISODE_KEY) or {}
        outcomes = episode.get("tool_outcomes") or {}
        ran = any(key.endswith("/ok") and count for key, count in outcomes.items())
        tried = episode.get("tool_calls", 0) or (episode.get("info") or {}).get("malformed_calls")
        rewards.append(1.0 if ran else 0.5 if tried else 0.0)
    return rewards
