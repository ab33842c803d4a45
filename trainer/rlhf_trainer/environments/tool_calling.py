"""`tool-calling`: the model calls the job's tools until it answers.

Each turn's ``<tool_call>`` blocks (`toolcalls`) run in the sandbox, all of a turn's calls at
once, and their results come back as ``role: tool`` messages in the calls' order; a malformed
call gets an error message instead. A turn without a call is the answer: the episode ends, and
the job's reward scores that last turn (this environment gives no reward of its own).
"""

from __future__ import annotations

from typing import Any

from rlhf_trainer.environments.base import (
    ENVIRONMENTS,
    EnvironmentContext,
    EnvStep,
    Message,
    Turn,
    record_messages,
)
from rlhf_trainer.environments.toolcalls import parse_tool_calls, result_text, tool_message
from rlhfjob.contract.sandbox import ToolResult


@ENVIRONMENTS.register("tool-calling")
class ToolCallingEnvironment:
    """Runs the model's tool calls and answers with their results (see the module docstring)."""

    def __init__(self, context: EnvironmentContext) -> None:
        self.context = context
        self.tools = context.tools
        self.record: dict[str, Any] = {}

    def reset(self, record: dict[str, Any]) -> list[Message]:
        self.record = record
        return record_messages(record, self.context.prompt_field)

    def answer(self, turn: Turn) -> EnvStep:
        """The last turn, which calls no tool: the episode's end (a subclass scores it)."""
        del turn
        return EnvStep(None)

    def step(self, turn: Turn) -> EnvStep:
        parsed = parse_tool_calls(turn.text)
        if not parsed:
            return self.answer(turn)
        valid = [(i, call) for i, call in enumerate(parsed) if call.error is None]
        results = self.tools.run([call.to_call(f"{turn.index}-{i}") for i, call in valid])
        by_position: dict[int, ToolResult] = {
            i: result for (i, _), result in zip(valid, results, strict=True)
        }
        messages = []
        for i, call in enumerate(parsed):
            result = by_position.get(i)
            text = result_text(result) if result is not None else f"Error: {call.error}"
            messages.append(tool_message(call.name or "unknown", text))
        errors = sum(1 for call in parsed if call.error is not None)
        return EnvStep(messages, info={"malformed_calls": errors} if errors else {})
