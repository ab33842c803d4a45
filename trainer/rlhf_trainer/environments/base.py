"""The environment interface (`spec.environment.name`), declared once, and the tools it reaches.

An environment is what a researcher writes to train a model on a multi-turn task::

    class Guess:
        def __init__(self, context: EnvironmentContext) -> None:
            self.tools = context.tools

        def reset(self, record):                       # a dataset record -> first messages
            self.answer = record["answer"]
            return record["prompt"]

        def step(self, turn: Turn) -> EnvStep:         # the model's turn -> the answer to it
            if "?" in turn.text:
                return EnvStep([{"role": "user", "content": "No questions."}])
            return EnvStep(None, reward=float(turn.text.strip() == self.answer))

    # in the job: environment: {name: my_package.envs:Guess}

One instance plays one trajectory. `reset` must depend on the record alone: it is called once
at start-up to render the prompt and again when a trajectory starts. `step` returns the
messages to append (None ends the episode) and, optionally, a reward (the rewards of a
trajectory add up; `environment_reward` hands the sum to the job's reward). `step` runs on a
worker thread, concurrently with other trajectories' steps and with generation; it may block
on its tools, which run only in the job's sandbox (`ToolBox`, through a `ToolRunner`), never in
this process.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlhf_trainer.registry import Registry
from rlhfjob.api import EnvironmentSpec
from rlhfjob.contract.sandbox import ToolCall, ToolResult

Message = dict[str, Any]
"""A chat message: ``{"role": ..., "content": ...}`` (roles: system, user, assistant, tool)."""


@dataclass(frozen=True)
class Turn:
    """One turn of the model, as the environment reads it."""

    text: str
    """The turn decoded, special tokens left out."""
    token_ids: list[int]
    ended: bool
    """Whether the model ended its turn (a stop token or stop string); False: it was cut at
    `algorithm.maxResponseLength` with no stop tokens to end it (token-id tasks)."""
    index: int
    """0 for the first turn."""


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to a turn."""

    messages: list[Message] | None
    """What to append before the model's next turn (tool results, a user's reply); None ends
    the episode."""
    reward: float | None = None
    """This turn's reward, if the environment scores it (a final reward on the last step)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything to keep with the trajectory (in its record's `episode.info`)."""


class Environment(Protocol):
    def reset(self, record: dict[str, Any]) -> list[Message]: ...

    def step(self, turn: Turn) -> EnvStep: ...


class ToolRunner(Protocol):
    """Runs tool calls somewhere else: the job's sandbox (`rlhf_trainer.sandbox.client`). It
    never raises for a failed call or transport: the result says how it ended."""

    def run(self, calls: list[ToolCall]) -> list[ToolResult]: ...


class NoTools:
    """The runner of an environment without tools: every call is an error."""

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        error = "this job has no tools (spec.environment.tools)"
        return [ToolResult(call_id=c.call_id, outcome="error", error=error) for c in calls]


@dataclass
class ToolStats:
    """What one trajectory's tool calls did."""

    calls: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    by_tool: Counter[tuple[str, str]] = field(default_factory=Counter)
    """Calls by (tool, outcome)."""
    sandbox_seconds: float = 0.0
    """Time the calls ran inside the sandbox (its own measure)."""
    latencies: list[float] = field(default_factory=list)
    """Each batch of calls' round trip as this process waited for it."""

    @property
    def errors(self) -> int:
        return self.calls - self.outcomes["ok"] - self.outcomes["timeout"]

    @property
    def timeouts(self) -> int:
        return self.outcomes["timeout"]


class ToolBox:
    """One trajectory's way to the job's tools: only `allowed` ones, each call under the
    job's time limit, at most `max_calls` a turn; counted in `stats`."""

    def __init__(
        self,
        runner: ToolRunner,
        allowed: Sequence[str],
        timeout_s: float,
        max_calls: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.runner = runner
        self.allowed = frozenset(allowed)
        self.timeout_s = timeout_s
        self.max_calls = max_calls
        self.clock = clock
        self.stats = ToolStats()
        self._lock = threading.Lock()

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Each call's result, in order; calls over `max_calls` and tools not allowed are
        answered with an error without reaching the sandbox."""
        results: list[ToolResult | None] = [None] * len(calls)
        sent: list[tuple[int, ToolCall]] = []
        for index, call in enumerate(calls):
            call_id = call.call_id or str(index)
            if index >= self.max_calls:
                problem = f"at most {self.max_calls} tool calls a turn"
            elif call.tool not in self.allowed:
                problem = f"unknown tool {call.tool!r}; the tools are {sorted(self.allowed)}"
            else:
                limited = call.model_copy(update={"timeout_s": self.timeout_s, "call_id": call_id})
                sent.append((index, limited))
                continue
            results[index] = ToolResult(call_id=call_id, outcome="error", error=problem)
        if sent:
            started = self.clock()
            answered = self.runner.run([call for _, call in sent])
            latency = self.clock() - started
            if len(answered) != len(sent):
                raise RuntimeError(f"the tool runner answered {len(answered)} of {len(sent)}")
            for (index, _), result in zip(sent, answered, strict=True):
                results[index] = result
            with self._lock:
                self.stats.latencies.append(latency)
        done = [result for result in results if result is not None]
        self._count(calls, done)
        return done

    def _count(self, calls: Sequence[ToolCall], results: list[ToolResult]) -> None:
        with self._lock:
            for call, result in zip(calls, results, strict=True):
                self.stats.calls += 1
                self.stats.outcomes[result.outcome] += 1
                self.stats.by_tool[(call.tool, result.outcome)] += 1
                self.stats.sandbox_seconds += result.seconds


@dataclass(frozen=True)
class EnvironmentContext:
    """What an environment is built with, one per trajectory."""

    spec: EnvironmentSpec
    tools: ToolBox
    schemas: list[dict[str, Any]]
    """The JSON schemas of `spec.tools` (OpenAI / Hugging Face function format)."""
    prompt_field: str = "prompt"
    """The record field that holds the first messages (`dataset.promptField`)."""


EnvironmentFactory = Callable[[EnvironmentContext], Environment]
"""Builds one trajectory's environment (a class taking the context qualifies)."""

ENVIRONMENTS: Registry[EnvironmentFactory] = Registry("spec.environment.name")
"""The built-in environments by name (`rlhfjob.api.BUILTIN_ENVIRONMENTS`)."""


def record_messages(record: dict[str, Any], prompt_field: str) -> list[Message]:
    """A record's first messages: its `prompt_field` as chat messages, or text as one user
    message. ValueError otherwise."""
    value = record.get(prompt_field)
    if isinstance(value, str) and value:
        return [{"role": "user", "content": value}]
    if (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
    ):
        return [dict(message) for message in value]
    raise ValueError(f"the record's {prompt_field!r} is neither chat messages nor text")
