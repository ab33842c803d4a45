"""The sandbox server against what a tool call may try: real servers, real calls.

Each attack test names what it tries and what stops it (`attack` marks, as in
`tests/security/`). Where a layer needs what this machine may not give (network namespaces,
dropping to another uid: root), the test asks the server's /healthz what it set up and says so
when it skips.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf_trainer.sandbox.client import SandboxAuthError, SandboxClient
from rlhfjob.contract.sandbox import SandboxHealth, ToolCall, ToolResult

from .conftest import GENEROUS, TIGHT, Sandbox, start_sandbox


@pytest.fixture(scope="module")
def client(sandbox: Sandbox) -> Iterator[SandboxClient]:
    with SandboxClient([sandbox.url], sandbox.token, retries=0) as made:
        yield made


@pytest.fixture(scope="module")
def tight_client(tight: Sandbox) -> Iterator[SandboxClient]:
    with SandboxClient([tight.url], tight.token, retries=0) as made:
        yield made


def python(client: SandboxClient, code: str, **extra: float | str) -> ToolResult:
    return client.call(ToolCall(tool="python", arguments={"code": code}, **extra))


def require(sandbox: Sandbox, layer: str) -> None:
    if not sandbox.isolated(layer):
        pytest.skip(f"calls here have no {layer} isolation (the server is not root?)")


def gone(sandbox: Sandbox, seconds: float = 5.0) -> bool:
    """Whether the server's call users have no process left (polled: the kernel reaps a PID
    namespace's processes as its init goes, a few milliseconds after the call's end)."""
    deadline = time.monotonic() + seconds
    while sandbox.processes():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- the protocol -------------------------------------------------------------------------


def test_health_says_what_isolates_a_call(sandbox: Sandbox) -> None:
    health = SandboxHealth.model_validate(sandbox.health())
    assert health.tools == ["calculator", "python"] and health.slots == GENEROUS.slots
    if health.isolation.uid:  # root: everything this machine allows
        assert health.isolation.model_dump() == dict.fromkeys(health.isolation.model_dump(), True)


@pytest.mark.attack("anyone who reaches a sandbox pod runs code in it", "the job's bearer token")
def test_a_call_without_the_token_is_refused(sandbox: Sandbox) -> None:
    body = ToolCall(tool="calculator", arguments={"expression": "1"}).model_dump_json().encode()
    assert sandbox.post(body)[0] == 401
    assert sandbox.post(body, token="0" * 64)[0] == 401
    assert sandbox.post(body, token=sandbox.token + "x")[0] == 401
    with SandboxClient([sandbox.url], "wrong") as wrong, pytest.raises(SandboxAuthError):
        wrong.call(ToolCall(tool="calculator", arguments={"expression": "1"}))
    assert sandbox.post(body, token=sandbox.token)[0] == 200
    assert sandbox.token not in sandbox.log.read_text()


def test_bodies_that_are_not_calls_are_refused(sandbox: Sandbox) -> None:
    assert sandbox.post(b"{not json", token=sandbox.token)[0] == 400
    assert sandbox.post(b'{"tool": "python", "extra": 1}', token=sandbox.token)[0] == 400
    status, answer = sandbox.post(b'{"tool": "rm"}', token=sandbox.token)
    assert (status, answer["tools"]) == (404, ["calculator", "python"])
    huge = json.dumps({"tool": "python", "arguments": {"code": "#" * (1 << 20)}}).encode()
    assert sandbox.post(huge, token=sandbox.token)[0] == 413


def test_calculator_and_python(client: SandboxClient) -> None:
    result = client.call(ToolCall(tool="calculator", arguments={"expression": "2 ** 10 + 7 // 2"}))
    assert (result.outcome, result.output) == ("ok", "1027")
    result = python(client, "import math\nprint(math.factorial(10))", call_id="c-1")
    assert (result.outcome, result.output, result.call_id) == ("ok", "3628800\n", "c-1")
    assert 0 < result.seconds < GENEROUS.wall_seconds


def test_failures_are_results_with_the_exceptions_last_line(client: SandboxClient) -> None:
    result = python(client, "print('before')\n1 / 0")
    assert (result.outcome, result.output) == ("error", "before\n")
    assert result.error == "ZeroDivisionError: division by zero"
    assert python(client, "def (").error.startswith("SyntaxError")
    result = client.call(ToolCall(tool="calculator", arguments={"expression": "9 ** 9 ** 9"}))
    assert result.outcome == "error" and "exponent" in result.error
    wrong = client.call(ToolCall(tool="python", arguments={"source": "print(1)"}))
    assert wrong.outcome == "error" and wrong.error.startswith("invalid arguments")
    unknown = client.call(ToolCall(tool="shell", arguments={}))
    assert unknown.outcome == "error" and "unknown tool 'shell'" in unknown.error


# -- what a call cannot reach --------------------------------------------------------------


@pytest.mark.attack(
    "a tool call reads the sandbox's token (to call other pods' sandboxes as the job)",
    "an empty environment, no inherited descriptor, another uid, the token file hidden",
)
def test_a_call_finds_no_token(sandbox: Sandbox, client: SandboxClient) -> None:
    if not (sandbox.isolated("mounts") or sandbox.isolated("uid")):
        pytest.skip("calls here run as the server's user with its files: nothing hides the token")
    code = f"""
import os
print(sorted(os.environ))
for path in [{str(sandbox.token_file)!r}, "/proc/1/environ", "/proc/1/cmdline"]:
    try:
        print(path, open(path, "rb").read())
    except OSError as error:
        print(path, type(error).__name__)
for fd in sorted(os.listdir("/proc/self/fd")):
    try:
        print(fd, os.readlink("/proc/self/fd/" + fd))
    except OSError:
        pass
for pid in filter(str.isdigit, os.listdir("/proc")):
    for name in ("environ", "cmdline"):
        try:
            print(pid, name, open(f"/proc/{{pid}}/{{name}}", "rb").read())
        except OSError as error:
            print(pid, name, type(error).__name__)
"""
    result = python(client, code)
    assert result.outcome == "ok", result
    assert sandbox.token not in result.output
    assert result.output.splitlines()[0] == "['HOME', 'LANG', 'PATH', 'TMPDIR']"
    descriptors = [line.split(" ", 1)[1] for line in result.output.splitlines()
                   if line.split(" ")[0].isdigit() and len(line.split(" ")) == 2]  # fmt: skip
    assert all(d.startswith(("pipe:", "/dev/null", "/proc/")) for d in descriptors), descriptors


@pytest.mark.attack(
    "a tool call connects out (exfiltration, the cluster's services, the pod's own ports)",
    "a network namespace of its own per call with no interface up",
)
def test_a_call_reaches_no_address_not_even_loopback(
    sandbox: Sandbox, client: SandboxClient
) -> None:
    require(sandbox, "network")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = f"""
import socket
for address in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
    try:
        socket.create_connection(address, timeout=2)
        print("connected", address)
    except OSError as error:
        print("refused", address, error.errno)
"""
        result = python(client, code)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert "connected" not in result.output and result.output.count("refused") == 2, result


@pytest.mark.attack(
    "a tool call writes outside its directory (the pod's files, what the next call reads)",
    "another uid, a read-only file system, private /tmp and working directory per call",
)
def test_a_call_writes_only_its_own_fresh_directory(
    sandbox: Sandbox, client: SandboxClient, tmp_path: Path
) -> None:
    require(sandbox, "mounts")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # writable by anyone: still not the call's
    marker = f"sandbox-{secrets.token_hex(4)}"
    code = f"""
import os
print(os.listdir("."))
open("mine.txt", "w").write("x")
open("/tmp/{marker}", "w").write("x")
for path in ["/etc/{marker}", {str(shared / marker)!r}, os.path.expanduser("~/../{marker}")]:
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as error:
        print("refused", path, error.errno)
"""
    first = python(client, code)
    assert first.outcome == "ok" and first.output.startswith("[]\n"), first
    assert "wrote" not in first.output and first.output.count("refused") == 3, first
    assert list(shared.iterdir()) == [] and not (Path("/tmp") / marker).exists()
    second = python(client, f"import os\nprint(os.listdir('.'), os.path.exists('/tmp/{marker}'))")
    assert second.output == "[] False\n"


# -- limits --------------------------------------------------------------------------------


@pytest.mark.attack("a tool call never ends", "the server's wall clock: the call's group killed")
def test_an_endless_loop_times_out_at_the_wall_limit(client: SandboxClient) -> None:
    result = python(client, "while True:\n    pass", timeout_s=1)
    assert (result.outcome, result.error) == ("timeout", "wall time limit (1 s)")
    assert result.seconds < GENEROUS.wall_seconds - 1  # not the server's own wall


def test_cpu_time_runs_out_before_the_wall(tight_client: SandboxClient) -> None:
    result = python(tight_client, "while True:\n    pass")
    assert result.outcome == "timeout" and result.error in (
        "CPU time limit (1 s)",
        "wall time limit (20 s)",  # a machine so busy that 20 s of wall gave under 1 s of CPU
    ), result


@pytest.mark.attack("a tool call takes the pod's memory", "RLIMIT_AS of the call's process")
def test_a_memory_bomb_is_killed(tight_client: SandboxClient) -> None:
    result = python(tight_client, "x = bytearray(4 << 30)")
    assert (result.outcome, result.error) == ("killed", "memory limit (128 MiB)")
    result = python(tight_client, "blocks = []\nwhile True:\n    blocks.append(b'x' * (8 << 20))")
    assert result.outcome == "killed", result


@pytest.mark.attack(
    "a tool call forks without end (the pod's process table)",
    "RLIMIT_NPROC of a uid per slot, and the call's PID namespace ended with it",
)
def test_a_fork_bomb_is_contained(tight: Sandbox, tight_client: SandboxClient) -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = python(tight_client, code, timeout_s=1.5)
    assert result.outcome != "ok"
    assert tight.health()["status"] == "ok"
    assert gone(tight), f"left behind: {tight.processes()}"
    assert python(tight_client, "print('after')").output == "after\n"


@pytest.mark.attack("a tool call floods its output", "the server's output cap: the call killed")
def test_output_past_the_limit_is_cut_and_the_call_stopped(tight_client: SandboxClient) -> None:
    result = python(tight_client, "while True:\n    print('y' * 1000)")
    assert result.outcome == "output_limit" and len(result.output) == TIGHT.max_output_bytes
    assert result.seconds < TIGHT.wall_seconds / 2  # stopped at the cap, not at the wall


def test_metrics_count_calls_by_tool_and_outcome(sandbox: Sandbox, client: SandboxClient) -> None:
    client.call(ToolCall(tool="calculator", arguments={"expression": "1 + 1"}))
    python(client, "while True:\n    pass", timeout_s=0.5)
    text = sandbox.metrics()
    assert 'rlhf_sandbox_calls_total{outcome="ok",tool="calculator"}' in text
    assert 'rlhf_sandbox_timeouts_total{tool="python"}' in text
    assert 'rlhf_sandbox_rejected_total{reason="unauthorized"}' in text
    assert "rlhf_sandbox_in_flight 0.0" in text
    assert 'rlhf_sandbox_call_seconds_bucket{le="0.5",tool="calculator"}' in text


def test_without_namespaces_the_server_says_the_network_is_the_pods(tmp_path: Path) -> None:
    bare = start_sandbox(tmp_path, GENEROUS, "--isolation", "none")
    try:
        assert bare.health()["isolation"]["network"] is False
        assert 'rlhf_sandbox_isolation{layer="network"} 0.0' in bare.metrics()
        assert "NetworkPolicy" in bare.log.read_text()
        with SandboxClient([bare.url], bare.token) as client:
            assert python(client, "print(3)").output == "3\n"
            if bare.isolated("uid"):  # root: each call's user is swept after it
                escape = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)"
                assert python(client, escape + "\nprint('left')").output == "left\n"
                assert gone(bare), f"left behind: {bare.processes()}"
    finally:
        bare.stop()
