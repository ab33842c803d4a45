"""A job's environment at start-up: its factory, its tools' schemas and sandbox, its prompts.

Everything here runs before any actor starts, so a mistake (an environment the image lacks, a
tool the sandbox does not have, no token for the sandbox, records the environment cannot start
from) fails the job at once naming the field (`ValueError`, made non-retryable by the caller).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

from rlhf_trainer.data.prompts import SYNTHETIC_PREFIX, PromptItem, read_records
from rlhf_trainer.environments.base import (
    ENVIRONMENTS,
    Environment,
    EnvironmentContext,
    EnvironmentFactory,
    NoTools,
    ToolBox,
    ToolRunner,
)
from rlhf_trainer.environments.chat import ChatFormat
from rlhf_trainer.environments.episodes import EpisodeRunner, Limits
from rlhf_trainer.rewards.functions import Decode
from rlhf_trainer.rollout.base import Completion, truncate_completions
from rlhfjob.api import EnvironmentSpec, RLHFJobSpec
from rlhfjob.contract.sandbox import ToolCall, ToolResult

TRANSPORT_MARGIN_S = 5.0
"""Beyond the tool's own time limit, how long the client waits for the sandbox's answer."""


def environment_factory(name: str) -> EnvironmentFactory:
    """A built-in environment by name, or a factory named as ``module:function``."""
    if ":" not in name:
        return ENVIRONMENTS[name]
    module_name, _, attribute = name.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"spec.environment.name: cannot load {name!r}: {error}") from error
    if not callable(target):
        raise ValueError(f"spec.environment.name: {name!r} is not callable")
    return target


def tool_schemas(names: list[str]) -> list[dict[str, Any]]:
    """The JSON schemas of the sandbox's tools `names`; ValueError naming the field."""
    if not names:
        return []
    from rlhf_trainer.sandbox.tools import schemas

    try:
        return list(schemas(names))
    except (KeyError, ValueError) as error:
        raise ValueError(f"spec.environment.tools: {error}") from error


class SandboxRunner:
    """The production `ToolRunner`: the job's sandbox servers, through their client."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        return list(self.client.call_many(calls))

    def figures(self) -> dict[str, float]:
        """The client's figures since the last time asked (`env_sandbox_*` in the step log):
        calls, retries, calls no server answered, latency percentiles as the caller saw them."""
        stats = self.client.stats(reset=True)
        keys = ("calls", "retries", "unavailable", "latency_p50", "latency_p99", "latency_max")
        return {f"env_sandbox_{key}": float(stats[key]) for key in keys if key in stats}


def sandbox_runner(spec: EnvironmentSpec, environ: dict[str, str] | None = None) -> ToolRunner:
    """A runner over `spec.sandbox` (none without tools); ValueError without its token."""
    if not spec.tools:
        return NoTools()
    sandbox = spec.sandbox
    assert sandbox is not None  # the API requires one with tools
    token = (os.environ if environ is None else environ).get(sandbox.token_env, "")
    if not token:
        raise ValueError(
            f"spec.environment.sandbox.tokenEnv: the driver's environment has no "
            f"{sandbox.token_env} (the sandbox's token)"
        )
    from rlhf_trainer.sandbox.client import SandboxClient

    client = SandboxClient(
        sandbox.urls,
        token,
        timeout_s=spec.tool_timeout_seconds + TRANSPORT_MARGIN_S,
        max_concurrency=sandbox.max_concurrency,
    )
    return SandboxRunner(client)


@dataclass
class EnvironmentRuntime:
    """One job's environment, ready to start trajectories and render their prompts."""

    spec: EnvironmentSpec
    factory: EnvironmentFactory
    schemas: list[dict[str, Any]]
    runner: ToolRunner
    chat: ChatFormat
    prompt_field: str = "prompt"

    def new(self) -> tuple[Environment, ToolBox]:
        """A trajectory's environment and its tools."""
        spec = self.spec
        tools = ToolBox(
            self.runner, spec.tools, spec.tool_timeout_seconds, spec.max_tool_calls_per_turn
        )
        context = EnvironmentContext(spec, tools, self.schemas, self.prompt_field)
        return self.factory(context), tools

    def item(self, record: dict[str, Any], where: str) -> PromptItem:
        """A record as a prompt: the environment's first messages rendered, the whole record
        kept (the environment starts each trajectory from it)."""
        try:
            messages = self.new()[0].reset(dict(record))
            return PromptItem(self.chat.prompt(messages), dict(record))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{where}: spec.environment cannot start from it: {error}") from error

    def load(self, source: str, prompt_field: str, **_: Any) -> list[PromptItem]:
        """The records of `source` as prompts (the signature of `data.prompts.load_prompts`)."""
        if source.startswith(SYNTHETIC_PREFIX):
            raise ValueError(
                f"{source}: spec.environment starts from dataset records (JSON lines or "
                "Parquet), not a synthetic task"
            )
        items = [self.item(record, where) for where, record in read_records(source, prompt_field)]
        if not items:
            raise ValueError(f"{source} holds no records")
        return items

    def episodes(
        self, spec: RLHFJobSpec, stop_token_ids: tuple[int, ...], decode: Decode | None
    ) -> EpisodeRunner:
        """The scheduler that samples this environment's trajectories for `spec`'s job."""
        stop_strings = spec.algorithm.stop_strings

        def cut(completion: Completion) -> Completion:
            assert decode is not None  # start-up refuses stop strings without a tokenizer
            return truncate_completions([completion], decode, stop_strings)[0]

        return EpisodeRunner(
            self.new,
            self.chat,
            Limits(self.spec.max_turns, self.spec.max_trajectory_tokens),
            stop_token_ids,
            cut if stop_strings else None,
            stop_strings,
            sandbox_figures=getattr(self.runner, "figures", None),
        )


def load_environment(spec: RLHFJobSpec, tokenizer: Any | None) -> EnvironmentRuntime:
    """`spec.environment` ready to run; ValueError naming the field if it cannot be."""
    environment = spec.environment
    assert environment is not None
    if tokenizer is None:
        raise ValueError(
            "spec.model.tokenizer: spec.environment renders chat messages, which needs a "
            "tokenizer (set model.tokenizer, or use a policy directory with one)"
        )
    factory = environment_factory(environment.name)
    schemas = tool_schemas(environment.tools)
    return EnvironmentRuntime(
        environment,
        factory,
        schemas,
        sandbox_runner(environment),
        ChatFormat(tokenizer, schemas),
        spec.dataset.prompt_field,
    )
