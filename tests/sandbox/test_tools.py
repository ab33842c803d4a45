"""The tools' registry as the trainer sees it (cheap to import, valid schemas) and the
calculator's arithmetic (a pure function: tested here in-process; it runs only in the sandbox's
child in production)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import jsonschema
import pytest

from rlhf_trainer.registry import UnknownNameError
from rlhf_trainer.sandbox.server import parse_args
from rlhf_trainer.sandbox.tools import MAX_INT_BITS, TOOLS, CalculatorError, calculator, schemas
from rlhfjob.contract.sandbox import SandboxLimits

HEAVY = [
    "torch",
    "pydantic",
    "aiohttp",
    "jsonschema",
    "prometheus_client",
    "rlhfjob.api",
    "rlhf_trainer.sandbox.worker",
    "rlhf_trainer.sandbox.jail",
    "ctypes",
]


def test_importing_the_tools_is_cheap_and_runs_nothing() -> None:
    probe = (
        "import sys, time\n"
        "started = time.perf_counter()\n"
        "from rlhf_trainer.sandbox.tools import schemas\n"
        "made = schemas()\n"
        "print(time.perf_counter() - started)\n"
        f"print([name for name in {HEAVY!r} if name in sys.modules])\n"
    )
    lines = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True
    ).stdout.splitlines()
    assert lines[1] == "[]", "importing the tools loaded the server's or the trainer's modules"
    assert float(lines[0]) < 0.5  # an import of a few standard modules, on a busy machine


def test_schemas_are_the_chat_templates_tools_format() -> None:
    started = time.perf_counter()
    every = schemas()
    assert time.perf_counter() - started < 0.05
    assert [tool["function"]["name"] for tool in every] == ["calculator", "python"]
    for tool in every:
        assert set(tool) == {"type", "function"} and tool["type"] == "function"
        assert set(tool["function"]) == {"name", "description", "parameters"}
        assert tool["function"]["description"]
        jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
        assert tool["function"]["parameters"]["type"] == "object"
        json.dumps(tool)  # plain JSON, as a request body carries it
    assert schemas(["python"]) == [every[1]]
    every[1]["function"]["parameters"]["properties"].clear()  # a copy: the registry keeps its own
    assert TOOLS["python"].parameters["properties"]
    with pytest.raises(UnknownNameError):
        schemas(["shell"])


def test_a_tool_call_is_checked_against_its_schema() -> None:
    validator = jsonschema.Draft202012Validator(TOOLS["python"].parameters)
    assert validator.is_valid({"code": "print(1)"})
    assert not validator.is_valid({})
    assert not validator.is_valid({"code": "x", "shell": True})
    assert not validator.is_valid({"code": 3})


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 100", str(2**100)),
        ("2 ** -1", "0.5"),
        ("1.5e3 - -2", "1502.0"),
        ("  +3 ", "3"),
    ],
)
def test_the_calculator_does_arithmetic(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("__import__('os')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1j", "only numbers"),
        ("2 ** 100000", "exponent"),
        ("9 ** 9 ** 9", "exponent"),
        (f"(2 ** {MAX_INT_BITS}) * (2 ** {MAX_INT_BITS})", "bits"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an expression"),
        ("1" * 1001, "longer than"),
    ],
)
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(
    expression: str, problem: str
) -> None:
    with pytest.raises(CalculatorError, match=problem):
        calculator(expression)


def test_limits_travel_as_the_servers_flags() -> None:
    limits = SandboxLimits(wall_seconds=2.5, memory_bytes=128 << 20, slots=3, queue_seconds=0)
    args = parse_args([*limits.to_args(), "--token-file", "token"])
    assert SandboxLimits(**{name: getattr(args, name) for name in SandboxLimits.model_fields}) == (
        limits
    )
