"""The tools a sandbox call may run: each a Python function with its JSON schema.

The schemas are in the OpenAI / Hugging Face "tools" format (``{"type": "function", "function":
{"name", "description", "parameters"}}``), what ``tokenizer.apply_chat_template(tools=...)``
and OpenAI-compatible servers take; `schemas` gives them to the trainer. The functions run only
in the sandbox's child process (`rlhf_trainer.sandbox.worker`), never where this module is
imported: importing it defines and registers, nothing more (the trainer imports it for the
schemas, and it stays cheap: standard library only).

A tool returns the text the model reads (or None when what it printed is the result) and raises
to fail: the worker turns the exception's last line into the result's ``error``.
"""

from __future__ import annotations

import ast
import builtins
import copy
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from rlhf_trainer.registry import Registry

ToolFunction = Callable[..., "str | None"]
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Tool:
    """A registered tool: what the model is told (name, description, parameters) and what runs."""

    name: str
    description: str
    parameters: dict[str, Any]
    """The arguments' JSON schema (an object schema); the server checks every call against it."""
    function: ToolFunction

    def schema(self) -> dict[str, Any]:
        """This tool in the OpenAI / Hugging Face "tools" format (a copy: callers may edit it)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(self.parameters),
            },
        }


TOOLS: Registry[Tool] = Registry("sandbox tool")
"""Every tool a sandbox server offers, by name."""


def tool(name: str, description: str, parameters: dict[str, Any]) -> Callable[[F], F]:
    """Decorator: register the function as the tool `name` with its arguments' JSON schema."""

    def add(function: F) -> F:
        TOOLS.register(name)(Tool(name, description, parameters, function))
        return function

    return add


def schemas(names: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """The "tools" list for a chat template or an OpenAI-style request: the named tools (every
    registered one when None), in the order given. An unknown name raises `UnknownNameError`."""
    chosen = list(TOOLS) if names is None else list(names)
    return [TOOLS[name].schema() for name in chosen]


def _object_schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


# ---------------------------------------------------------------------------------------------
# python


@tool(
    "python",
    "Run Python 3 code in a fresh, isolated process and return what it prints (standard output "
    "and standard error). Nothing persists between calls, there is no network, and time, memory "
    "and output are limited. Use print() to see a value.",
    _object_schema(
        {"code": {"type": "string", "description": "The Python source to run."}}, ["code"]
    ),
)
def python(code: str) -> None:
    """Run `code` as a fresh ``__main__``; what it prints is the result (the worker's standard
    output is the call's output), an uncaught exception the failure."""
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(code, "<code>", "exec"), namespace)


# ---------------------------------------------------------------------------------------------
# calculator

MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 10_000
"""The largest integer a calculation may make (about 3000 digits): a bound on the time and
memory of ``**`` and ``*`` before they run, not after."""
MAX_EXPONENT = 10_000


class CalculatorError(ValueError):
    """The expression is outside what the calculator evaluates."""


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


def _checked(op: ast.operator, left: int | float, right: int | float) -> None:
    """Refuse an operation whose result would be too large to compute quickly."""
    exact = isinstance(left, int) and isinstance(right, int)
    if isinstance(op, ast.Pow):
        if abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"the exponent is larger than {MAX_EXPONENT}")
        bits = int(left).bit_length() * int(right) if exact and right > 0 else 0
    elif isinstance(op, ast.Mult):
        bits = int(left).bit_length() + int(right).bit_length() if exact else 0
    else:
        return
    if bits > MAX_INT_BITS:
        raise CalculatorError(f"the result would have more than {MAX_INT_BITS} bits")


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        _checked(node.op, left, right)
        value = _BINARY[type(node.op)](left, right)
        if not isinstance(value, int | float):  # (-8) ** 0.5 is complex
            raise CalculatorError("the result is not a real number")
        return value
    raise CalculatorError(f"{type(node).__name__} is not allowed (numbers, + - * / // % ** ( ))")


@tool(
    "calculator",
    "Evaluate an arithmetic expression exactly as Python would: integers and decimals, "
    "+ - * / // % ** and parentheses (no names or functions). Returns the value.",
    _object_schema(
        {
            "expression": {
                "type": "string",
                "maxLength": MAX_EXPRESSION_CHARS,
                "description": "For example (2 + 3) * 4 ** 2 / 7",
            }
        },
        ["expression"],
    ),
)
def calculator(expression: str) -> str:
    """The expression's value (integers exact, ``/`` a float), or `CalculatorError` naming what
    is not arithmetic; it still runs in the sandbox's child, like any tool."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"not an expression: {error.msg}") from None
    return str(_evaluate(tree))
