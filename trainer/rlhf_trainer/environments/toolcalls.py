"""Tool calls in the model's own format, and their results as messages.

The format is the one Qwen2/Qwen2.5 (and SmolLM2 with tools, Hermes-style models) are trained
on: each call a JSON object in its own tags, as many as the turn makes::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "1234 * 56"}}
    </tool_call>

``arguments`` may also be a JSON string of the object, or named ``parameters``. A block that
is not such an object, or a ``<tool_call>`` left open at the end of the turn, is a malformed
call: the environment answers it with an error message, so the model learns the format rather
than being silently ignored. Results go back as ``role: tool`` messages, one per call in order;
the chat template renders them (Qwen2.5: ``<tool_response>`` blocks in a user turn).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from rlhfjob.contract.sandbox import ToolCall, ToolResult

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

FALLBACK_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
"""How the tools are shown to a model whose chat template takes none (`chat.ChatFormat`): the
system prompt Qwen2.5's template writes for them, so the format is the one parsed here."""


@dataclass(frozen=True)
class ParsedCall:
    """One ``<tool_call>`` block: a call, or why it is none."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def to_call(self, call_id: str) -> ToolCall:
        return ToolCall(tool=self.name, arguments=self.arguments, call_id=call_id)


def _parse_block(body: str) -> ParsedCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return ParsedCall(error=f"the tool call is not JSON: {error.msg}")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return ParsedCall(error='a tool call is {"name": ..., "arguments": {...}}')
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ParsedCall(value["name"], error="the arguments are not a JSON object")
    if not isinstance(arguments, dict):
        return ParsedCall(value["name"], error="the arguments are not a JSON object")
    return ParsedCall(value["name"], arguments)


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """The calls of a turn in the order it makes them (none: the turn calls no tool)."""
    calls = [_parse_block(match.group(1).strip()) for match in _BLOCK.finditer(text)]
    tail = text[text.rfind(CLOSE) + len(CLOSE) :] if CLOSE in text else text
    if OPEN in tail:
        calls.append(ParsedCall(error=f"the tool call is not closed with {CLOSE}"))
    return calls


def result_text(result: ToolResult) -> str:
    """What the model reads of a result: the output, or how the call failed."""
    if result.ok:
        return result.output
    reason = result.error or result.outcome
    detail = f"\n{result.output}" if result.output else ""
    return f"Error ({result.outcome}): {reason}{detail}"


def tool_message(name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "name": name, "content": content}


def tools_system_prompt(schemas: list[dict[str, Any]]) -> str:
    return FALLBACK_TOOLS_PROMPT.format(tools="\n".join(json.dumps(s) for s in schemas))
