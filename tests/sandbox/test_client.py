"""The trainer's sandbox client against real servers: concurrency, order, retries on another
pod, a pod lost mid-call, a full server, and what raises versus what becomes a result."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf_trainer.sandbox.client import SandboxClient, SandboxRequestError
from rlhfjob.contract.sandbox import ToolCall

from .conftest import GENEROUS, Sandbox, free_port, start_sandbox


def code(source: str, **extra: float | str) -> ToolCall:
    return ToolCall(tool="python", arguments={"code": source}, **extra)


def wait_for(condition: object, seconds: float = 10.0) -> None:
    """Poll until `condition()` holds (a server's state seen through /healthz)."""
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)


@pytest.fixture
def spare(tmp_path: Path, sandbox: Sandbox) -> Iterator[Sandbox]:
    """A server of its own (the same job: `sandbox`'s token), for a test that kills it."""
    server = start_sandbox(tmp_path, GENEROUS, token=sandbox.token)
    yield server
    server.stop()


def test_call_many_keeps_the_order_and_runs_calls_at_once(sandbox: Sandbox) -> None:
    calls = [code(f"import time\ntime.sleep(1)\nprint({i})", call_id=f"c{i}") for i in range(4)]
    with SandboxClient([sandbox.url], sandbox.token, max_concurrency=4) as client:
        started = time.monotonic()
        results = client.call_many(calls)
        elapsed = time.monotonic() - started
        stats = client.stats()
    assert [(r.call_id, r.output) for r in results] == [(f"c{i}", f"{i}\n") for i in range(4)]
    assert elapsed < 3, "the calls ran one after another (4 s)"
    assert stats["calls"] == 4 and stats["outcome_ok"] == 4
    assert 1 <= stats["latency_p50"] <= stats["latency_p99"] == stats["latency_max"]


def test_a_call_to_a_pod_that_is_down_goes_to_the_next(sandbox: Sandbox) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with SandboxClient([dead, sandbox.url], sandbox.token) as client:
        result = client.call(code("print('here')"))  # the first call starts at the first URL
        assert result.output == "here\n"
        assert client.stats()["retries"] == 1
        later = client.call_many([code(f"print({i})") for i in range(4)])
        assert [r.output for r in later] == [f"{i}\n" for i in range(4)]
        assert client.stats()["retries"] == 1, "the calls after kept trying the lost pod first"


@pytest.mark.attack(
    "a sandbox pod is lost with calls in flight (the job fails with it)",
    "the client retries those calls on another pod",
)
def test_a_pod_lost_mid_call_costs_the_call_a_retry_not_the_job(
    sandbox: Sandbox, spare: Sandbox
) -> None:
    results = []
    with SandboxClient([spare.url, sandbox.url], sandbox.token) as client:
        call = code("import time\ntime.sleep(1)\nprint('done')")
        caller = threading.Thread(target=lambda: results.append(client.call(call)))
        caller.start()
        wait_for(lambda: spare.health()["in_flight"] == 1)
        spare.stop()  # SIGKILL: the pod is gone, and its call's processes with it
        caller.join(timeout=30)
        assert client.stats()["retries"] == 1
    assert [(r.outcome, r.output) for r in results] == [("ok", "done\n")]
    deadline = time.monotonic() + 5
    while spare.processes():
        assert time.monotonic() < deadline, f"the lost pod's call lives on: {spare.processes()}"
        time.sleep(0.02)


def test_every_pod_down_is_an_error_result_not_an_exception() -> None:
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    with SandboxClient(urls, "token", retries=3) as client:
        result = client.call(code("print(1)", call_id="x"))
        stats = client.stats(reset=True)
    assert (result.outcome, result.call_id) == ("error", "x")
    assert result.error.startswith("sandbox unavailable: ") and "ConnectionRefused" in result.error
    assert (stats["retries"], stats["unavailable"]) == (3, 1)


def test_a_full_server_answers_503_and_the_client_tries_the_next(
    tight: Sandbox, sandbox: Sandbox
) -> None:
    with SandboxClient([tight.url, sandbox.url], tight.token, retries=1) as client:
        hold = code("import time\ntime.sleep(60)", timeout_s=3)  # the one slot, for 3 s
        busy = threading.Thread(target=client.call, args=(hold,))  # the first URL's turn
        busy.start()
        try:
            wait_for(lambda: tight.health()["in_flight"] == 1)
            body = code("print(1)").model_dump_json().encode()
            assert tight.post(body, token=tight.token)[0] == 503
            client.call(code("print(0)"))  # the second URL's turn
            moved = client.call(code("print(1)"))  # the first URL's: full, so the second
            assert (moved.outcome, moved.output) == ("ok", "1\n")
            assert client.stats()["retries"] == 1
        finally:
            busy.join(timeout=30)
    assert 'rlhf_sandbox_rejected_total{reason="full"} 2.0' in tight.metrics()


def test_a_wrong_url_raises_rather_than_failing_every_call(sandbox: Sandbox) -> None:
    client = SandboxClient([sandbox.url + "/nowhere"], sandbox.token)
    with pytest.raises(SandboxRequestError, match="HTTP 404"):
        client.call(code("print(1)"))
    with pytest.raises(ValueError, match="credentials"):
        SandboxClient(["http://user:pw@127.0.0.1:1"], "token")


def test_a_call_larger_than_the_server_reads_is_an_error_result(sandbox: Sandbox) -> None:
    with SandboxClient([sandbox.url], sandbox.token) as client:
        result = client.call(code("#" * (1 << 20)))
    assert result.outcome == "error" and "bytes" in result.error
