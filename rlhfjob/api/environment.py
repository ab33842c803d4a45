"""Agentic RL (`spec.environment`): multi-turn rollouts in which the policy calls tools.

A job with an environment samples trajectories instead of single responses: the environment
turns a dataset record into the first messages, reads each of the model's turns, runs the tool
calls it finds in the job's sandbox (never in a trainer's or the driver's process) and answers
with their results, until it ends the episode or a limit does. Only the model's own tokens are
trained on. The trainer's side: `rlhf_trainer.environments`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from rlhfjob.api.algorithm import cel_in
from rlhfjob.api.base import CONTEXT_WINDOW_KEYS, ENV_NAME_PATTERN, HTTP_URL_PATTERN, ApiModel
from rlhfjob.cel import CelRule

BUILTIN_ENVIRONMENTS = ("multiplication", "tool-calling")
"""The environments the trainer has by name (`rlhf_trainer.environments` registers exactly
these; a unit test holds both). Any other is named as `module:function`."""
ENVIRONMENT_NAME_PATTERN = r"^([a-z][-a-z0-9]*|[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)$"
TOOL_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]*$"
SANDBOX_TOKEN_ENV = "RLHF_SANDBOX_TOKEN"
"""The driver's environment variable that holds the sandbox's token, unless `tokenEnv` says
another."""

ToolName = Annotated[str, Field(min_length=1, max_length=128, pattern=TOOL_NAME_PATTERN)]
SandboxUrl = Annotated[str, Field(max_length=2048, pattern=HTTP_URL_PATTERN)]


class SandboxSpec(ApiModel):
    """Where the job's tool calls run: sandbox servers (`python -m rlhf_trainer.sandbox.server`)
    the driver reaches over HTTP with a bearer token. Each call runs there in a fresh, limited
    process; a server that is full or down is skipped for another."""

    urls: list[SandboxUrl] = Field(min_length=1, max_length=64)
    """The servers' base URLs, for example `http://sandbox-0.sandbox.team.svc:8470`."""
    token_env: str = Field(
        default=SANDBOX_TOKEN_ENV, min_length=1, max_length=253, pattern=ENV_NAME_PATTERN
    )
    """The driver's environment variable holding the servers' token (set it from a Secret
    with `spec.pods.env[].valueFrom.secretKeyRef`, or export it for a local run)."""
    max_concurrency: int = Field(default=16, ge=1, le=1024)
    """Tool calls in flight at once, over all the servers."""


class EnvironmentSpec(ApiModel):
    """Multi-turn rollouts: each trajectory alternates the model's turns with the
    environment's answers (tool results), up to the limits below. Generated on-policy (no
    `algorithm.maxStaleness`); the reward sees the first prompt, the model's last turn and,
    in each record's `episode` field, what the environment scored (the reward function
    `rlhf_trainer.environments:environment_reward` passes that score on)."""

    name: str = Field(min_length=1, max_length=256, pattern=ENVIRONMENT_NAME_PATTERN)
    """The environment: one the trainer has (`tool-calling`: the model's tool calls run in the
    sandbox and their results come back as `tool` messages, the episode ends at a turn without
    one; `multiplication`: that, rewarded for the exact product), or a factory in the image
    as `module:function`."""
    tools: list[ToolName] = Field(default_factory=list, max_length=32)
    """The sandbox's tools the model may call (for example `calculator`, `python`); their JSON
    schemas are shown to the model through its chat template."""
    max_turns: int = Field(default=4, ge=1, le=256)
    """Model turns per trajectory; one that still has calls to answer after the last is
    truncated."""
    max_trajectory_tokens: int = Field(default=1024, ge=1, le=1048576)
    """Tokens after the prompt, the model's and the environment's together; a trajectory
    that reaches it is truncated. Each turn is at most `algorithm.maxResponseLength`."""
    tool_timeout_seconds: float = Field(default=10.0, gt=0, le=600)
    """Wall time one tool call may take in the sandbox (the server's own limit caps it)."""
    max_tool_calls_per_turn: int = Field(default=4, ge=1, le=64)
    """Tool calls of one turn that run; the rest are answered with an error."""
    truncated_reward: float | None = Field(default=None, ge=-1e6, le=1e6)
    """The reward of a truncated trajectory (turns, tokens, or a turn cut at its length
    without ending). Unset: scored like any other."""
    sandbox: SandboxSpec | None = None
    """Where the tools run; needed when `tools` names any."""

    cel_rules = (
        CelRule(
            f"self.name.contains(':') || {cel_in('self.name', BUILTIN_ENVIRONMENTS)}",
            "the trainer has no such environment: it has "
            f"{', '.join(BUILTIN_ENVIRONMENTS)} (or name a factory as module:function)",
            ".name",
        ),
        CelRule(
            "!has(self.tools) || size(self.tools) == 0 || has(self.sandbox)",
            "environment.tools run in a sandbox: set environment.sandbox",
            ".sandbox",
        ),
    )


def lengths_fit_the_window(response: str) -> str:
    """CEL: a prompt and `response` tokens (a field's path below self) fit a `randomInit`
    policy's context window, where its config sets one (the first of `CONTEXT_WINDOW_KEYS`
    it has); the driver checks the others."""
    lengths = f"self.algorithm.maxPromptLength + {response}"
    fits = "true"
    for key in reversed(CONTEXT_WINDOW_KEYS):
        window = f"self.model.randomInit.{key}"
        fits = f"(has({window}) ? {lengths} <= {window} : {fits})"
    return f"!has(self.model.randomInit) || {fits}"


def environment_rules(has_tokenizer: str) -> tuple[CelRule, ...]:
    """The job-wide rules of `spec.environment` (on `RLHFJobSpec`)."""
    return (
        CelRule(
            "!has(self.environment) || self.algorithm.maxStaleness == 0",
            "spec.environment generates its trajectories on-policy: algorithm.maxStaleness "
            "(and partialRolloutTokens) cannot be combined with it",
            ".algorithm.maxStaleness",
        ),
        CelRule(
            f"!has(self.environment) || {has_tokenizer}",
            "spec.environment renders messages with a chat template, which needs a tokenizer: "
            "a randomInit policy has none, set model.tokenizer",
            ".model.tokenizer",
        ),
        CelRule(
            "!has(self.environment) || "
            f"({lengths_fit_the_window('self.environment.maxTrajectoryTokens')})",
            "algorithm.maxPromptLength + environment.maxTrajectoryTokens exceed the model's "
            f"context window (model.randomInit.{' or '.join(CONTEXT_WINDOW_KEYS)})",
            ".environment.maxTrajectoryTokens",
        ),
    )
