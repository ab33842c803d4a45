"""Multi-turn rollouts: trajectories that advance on their own, through the engines' one
`generate(prompts, sampling)` call.

The scheduler keeps each trajectory's state (its tokens, which of them are the model's, its
turns and rewards) and loops:

* **generate**: every trajectory that is ready (its first turn, or its environment's answer
  is back) goes into the next engine call, in trajectory order, each with its own seed for
  that turn (`seeds.turn_seed`, the engines' `prompt_seeds`) and at most the tokens it has
  left. The fleet or the colocated ranks split the call over every engine, as for one turn.
* **step**: each new turn goes to its environment's `step` on a worker thread: parsing, and
  its tool calls in the sandbox. These run concurrently with each other and with the next
  engine call.
* as soon as the engine call returns, every step that finished meanwhile makes its trajectory
  ready; with none ready, the loop waits for the first step to finish.

So a trajectory never waits for another's tools: its next turn goes out with the first engine
call after its own results are back (at most it waits for the call in flight). What is not
concurrent: one engine call at a time (each over every engine), and a trajectory's own turns.

Masking: the model's tokens are 1 in the trajectory's mask, the environment's (its messages and
the chat template's markers around them) 0, so `build_batch` trains only the former and their
log-probs are the only ones any loss reads. Limits end a trajectory as truncated: `maxTurns`
(the environment still answered the last turn), `maxTrajectoryTokens` (a turn, or the answer
to it, reaches it), or a turn cut at `maxResponseLength` without ending (no stop token).
Seeds depend on the call's seed, the trajectory and the turn only, so a step regenerated after
a restart samples the same trajectories whatever the tools' timing, up to how the engine's
kernels round a batch of another shape (the HF engine: exact; vLLM is not batch-invariant).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.data.prompts import PromptItem
from rlhf_trainer.environments.base import Environment, EnvStep, Message, ToolBox, Turn
from rlhf_trainer.rollout.base import Completion, SamplingParams
from rlhf_trainer.seeds import turn_seed

Generate = Callable[[list[list[int]], SamplingParams], list[list[Completion]]]

DONE = "done"
"""The environment ended the episode."""
TRUNCATED_TURNS, TRUNCATED_TOKENS, TRUNCATED_TURN_LENGTH = "turns", "tokens", "turn_length"
STOPS = (DONE, TRUNCATED_TURNS, TRUNCATED_TOKENS, TRUNCATED_TURN_LENGTH)
EPISODE_KEY = "episode"
"""The record field a trajectory's summary is added under (the reward functions see it)."""


class Format(Protocol):
    """Messages to tokens and turns to text (`chat.ChatFormat`)."""

    def continuation(self, messages: list[Message], stop_token: int | None) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Limits:
    max_turns: int
    max_trajectory_tokens: int


@dataclass
class Trajectory:
    """One trajectory's state while it is sampled."""

    index: int
    item: PromptItem
    env: Environment
    tools: ToolBox
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    rewards: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """What the trajectory did, for its reward and the step's figures (plain values)."""
        stats = self.tools.stats
        return {
            "reward": sum(self.rewards) if self.rewards else None,
            "truncated": self.stop != DONE,
            "stop": self.stop,
            "turns": self.turns,
            "tool_calls": stats.calls,
            "tool_errors": stats.errors,
            "tool_timeouts": stats.timeouts,
            "tool_outcomes": {
                f"{tool}/{outcome}": n for (tool, outcome), n in stats.by_tool.items()
            },
            "tool_sandbox_seconds": stats.sandbox_seconds,
            "tool_round_trips": list(stats.latencies),
            "model_tokens": sum(self.mask),
            "info": dict(self.info),
        }


class EpisodeRunner:
    """Samples trajectories of one environment on the run's engines (module docstring)."""

    def __init__(
        self,
        make: Callable[[], tuple[Environment, ToolBox]],
        format: Format,
        limits: Limits,
        stop_token_ids: Sequence[int] = (),
        cut: Callable[[Completion], Completion] | None = None,
        stop_strings: Sequence[str] = (),
        threads: int = 32,
        sandbox_figures: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self.make = make
        self.format = format
        self.limits = limits
        self.stop_token_ids = frozenset(stop_token_ids)
        self.cut = cut
        self.stop_strings = tuple(stop_strings)
        self.threads = threads
        self.sandbox_figures = sandbox_figures
        """The tool runner's own figures since last asked (the sandbox client's), if any."""
        self.calls: list[list[int]] = []
        """The trajectories of each engine call of the last `run`, in order."""

    def run(
        self, generate: Generate, items: Sequence[PromptItem], sampling: SamplingParams
    ) -> Rollout:
        """`sampling.n` trajectories per item, each item's contiguous (GRPO's groups)."""
        trajectories = []
        for position, item in enumerate(items):
            for sample in range(sampling.n):
                env, tools = self.make()
                env.reset(dict(item.metadata))
                trajectories.append(Trajectory(position * sampling.n + sample, item, env, tools))
        self.calls = []
        ready: list[Trajectory] = list(trajectories)
        stepping: dict[Future[EnvStep], tuple[Trajectory, Turn, int | None]] = {}
        with ThreadPoolExecutor(min(self.threads, len(trajectories)) or 1, "environment") as pool:
            while ready or stepping:
                for trajectory, turn, stop_token in self._generate(generate, ready, sampling):
                    future = pool.submit(trajectory.env.step, turn)
                    stepping[future] = (trajectory, turn, stop_token)
                ready = []
                if stepping:
                    finished, _ = wait(list(stepping), return_when=FIRST_COMPLETED)
                    for future in finished:
                        trajectory, _, stop = stepping.pop(future)
                        if self._answer(trajectory, future.result(), stop):
                            ready.append(trajectory)
        return rollout_of(trajectories)

    def _generate(
        self, generate: Generate, ready: list[Trajectory], sampling: SamplingParams
    ) -> list[tuple[Trajectory, Turn, int | None]]:
        """The next turn of every ready trajectory: one engine call per turn length they may
        still have (one call, unless some are near `maxTrajectoryTokens`)."""
        by_length: dict[int, list[Trajectory]] = {}
        for trajectory in sorted(ready, key=lambda t: t.index):
            room = self.limits.max_trajectory_tokens - len(trajectory.response)
            by_length.setdefault(min(sampling.max_tokens, room), []).append(trajectory)
        turns = []
        for max_tokens, group in sorted(by_length.items(), reverse=True):
            self.calls.append([t.index for t in group])
            seeds = (
                tuple(turn_seed(sampling.seed, t.index, t.turns) for t in group)
                if sampling.seed is not None
                else ()
            )
            call = dataclasses.replace(sampling, n=1, max_tokens=max_tokens, prompt_seeds=seeds)
            completions = generate([[*t.item.prompt, *t.response] for t in group], call)
            for trajectory, samples in zip(group, completions, strict=True):
                taken = self._take(trajectory, samples[0], max_tokens < sampling.max_tokens)
                if taken is not None:
                    turns.append((trajectory, *taken))
        return turns

    def _take(
        self, trajectory: Trajectory, completion: Completion, budget_cut: bool
    ) -> tuple[Turn, int | None] | None:
        """Add a turn to the trajectory; the turn for its environment, or None when a limit
        ends the trajectory here."""
        if self.cut is not None:
            completion = self.cut(completion)
        tokens = list(completion.token_ids)
        trajectory.response += tokens
        trajectory.mask += [1] * len(tokens)
        trajectory.versions.append(completion.policy_version)
        trajectory.turns += 1
        stop_token = tokens[-1] if tokens and tokens[-1] in self.stop_token_ids else None
        text = self.format.decode(tokens)
        ended = stop_token is not None or any(stop in text for stop in self.stop_strings)
        if not self.stop_token_ids and not self.stop_strings:
            ended = True  # nothing ends a turn but its length
        if not ended and budget_cut:
            trajectory.stop = TRUNCATED_TOKENS
            return None
        if not ended:
            trajectory.stop = TRUNCATED_TURN_LENGTH
            return None
        return Turn(text, tokens, ended, trajectory.turns - 1), stop_token

    def _answer(self, trajectory: Trajectory, step: EnvStep, stop_token: int | None) -> bool:
        """Apply the environment's answer; whether the trajectory goes on."""
        if step.reward is not None:
            trajectory.rewards.append(float(step.reward))
        for key, value in step.info.items():
            known = trajectory.info.get(key)
            summable = isinstance(value, int | float) and isinstance(known, int | float)
            trajectory.info[key] = known + value if summable else value
        if step.messages is None:
            trajectory.stop = DONE
            return False
        if trajectory.turns >= self.limits.max_turns:
            trajectory.stop = TRUNCATED_TURNS
            return False
        added = self.format.continuation(step.messages, stop_token)
        if len(trajectory.response) + len(added) >= self.limits.max_trajectory_tokens:
            trajectory.stop = TRUNCATED_TOKENS  # no room left for the model to answer
            return False
        trajectory.response += added
        trajectory.mask += [0] * len(added)
        return True


def rollout_of(trajectories: Sequence[Trajectory]) -> Rollout:
    """The trajectories as rollout rows: the first prompt, everything after it as the response
    with its mask, and the record with the trajectory's summary (`EPISODE_KEY`)."""
    return Rollout(
        prompts=[list(t.item.prompt) for t in trajectories],
        responses=[t.response for t in trajectories],
        metadata=[dict(t.item.metadata) | {EPISODE_KEY: t.summary()} for t in trajectories],
        policy_versions=[min(t.versions) for t in trajectories],
        action_masks=[t.mask for t in trajectories],
    )


def figures(metadata: Sequence[dict[str, Any]]) -> dict[str, float]:
    """A batch's environment figures for the step log (`env_*`), from its trajectories'
    summaries."""
    episodes = [record[EPISODE_KEY] for record in metadata if EPISODE_KEY in record]
    if not episodes:
        return {}
    count = len(episodes)
    stops = Counter(e["stop"] for e in episodes)
    trips = [seconds for e in episodes for seconds in e["tool_round_trips"]]
    calls = sum(e["tool_calls"] for e in episodes)
    result = {
        "env_turns_mean": sum(e["turns"] for e in episodes) / count,
        "env_turns_max": max(e["turns"] for e in episodes),
        "env_tool_calls": calls,
        "env_tool_calls_mean": calls / count,
        "env_tool_errors": sum(e["tool_errors"] for e in episodes),
        "env_tool_timeouts": sum(e["tool_timeouts"] for e in episodes),
        "env_truncated": count - stops[DONE],
        "env_tool_round_trip_seconds_mean": sum(trips) / len(trips) if trips else 0.0,
        "env_tool_sandbox_seconds_mean": (
            sum(e["tool_sandbox_seconds"] for e in episodes) / calls if calls else 0.0
        ),
    }
    for stop in STOPS[1:]:
        result[f"env_truncated_{stop}"] = stops[stop]
    return result
