"""Hostile endpoints against the operator's Ray dashboard client and the trainer's remote-reward
client, each an attempt that must fail (issue 49).

A job's entrypoint runs on its own head and may replace the dashboard the operator asks (one
operator serves every tenant: its crash stops every job's reconcile); a remote reward server is
whatever URL the job names. Each test starts a real aiohttp server in this process (own thread
and event loop, a random port) that answers as an attacker would, and drives the real client
(`rlhf_operator.rayjobs.RayJobClient` over the operator's own session, `RemoteReward`): a gzip
bomb, a body of many MiB, a redirect to another server, an error page holding a secret, an
answer that trickles. The rules both clients keep are `rlhfjob.untrusted`'s.
"""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import pytest

from rlhf_local.hostile import (
    MIB,
    Hostile,
    bomb,
    encoded,
    endless,
    failing,
    inflated_size,
    json_answer,
    redirect,
    trickle,
)
from rlhf_operator import rayjobs
from rlhf_operator.ports import Dashboard, DashboardUnavailableError
from rlhf_operator.rayjobs import RayJobClient, dashboard_session
from rlhf_trainer.rewards.remote import RemoteReward, RemoteRewardRejected, RemoteRewardUnavailable
from rlhfjob.api import RemoteRewardSpec
from rlhfjob.untrusted import (
    DASHBOARD_MAX_BYTES,
    REWARD_ANSWER_MAX_BYTES,
    SNIPPET_CHARS,
    snippet,
)

TOKEN = "f" * 16 + "0123456789abcdef" * 3  # a Ray token's shape: 64 hex digits
FAKE_SECRET = "AKIAIOSFODNN7EXAMPLE"
INFLATED_MIB = {"gzip": 256, "deflate": 64}
"""What the bombs inflate to (the gzip one: half the chart's memory limit for the operator,
512Mi; the deflate one smaller, to build faster: the client reads neither)."""


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    return {encoding: bomb(encoding, mib) for encoding, mib in INFLATED_MIB.items()}


def test_the_bombs_are_real(bombs: dict[str, bytes]) -> None:
    """The control: each bomb is a thousandth of what it inflates to."""
    for encoding, body in bombs.items():
        assert len(body) * 1000 < INFLATED_MIB[encoding] * MIB, encoding
        assert inflated_size(body, encoding) == INFLATED_MIB[encoding] * MIB, encoding


@contextmanager
def peak_memory() -> Iterator[list[int]]:
    """The peak of Python allocations while the block runs, in bytes (`[peak]` once done)."""
    found: list[int] = []
    tracemalloc.start()
    try:
        yield found
    finally:
        found.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def a_secret_page() -> bytes:
    """An error page of 2 MiB that quotes a cloud key and the caller's token, with a terminal
    escape sequence and non-ASCII for good measure."""
    line = (
        f"Traceback: AWS_ACCESS_KEY_ID={FAKE_SECRET} Authorization: Bearer {TOKEN} \x1b[2J \u2603\n"
    )
    return (line * (2 * MIB // len(line))).encode()


def assert_short_and_clean(text: str, *secrets: str) -> None:
    assert len(text) <= 400, len(text)
    assert all(" " <= c <= "~" for c in text), text
    for secret in secrets:
        assert secret not in text, text


# -- the operator's dashboard client --------------------------------------------------------------


def ask(url: str, call: str = "status") -> str:
    """One call of the operator's client to the dashboard at `url`; the error it raised (the
    text the status, the Events and the log would carry)."""

    async def go() -> None:
        async with dashboard_session() as session:
            client = RayJobClient(session)
            dashboard = Dashboard(url, TOKEN)
            if call == "status":
                await client.status(dashboard, "job-1")
            elif call == "submit":
                await client.submit(dashboard, "job-1", "rlhfjob train", env={}, metadata={})
            else:
                await client.stop(dashboard, "job-1")

    with pytest.raises(DashboardUnavailableError) as raised:
        asyncio.run(go())
    return str(raised.value)


def test_a_well_behaved_dashboard_is_read_and_gets_the_token() -> None:
    """The control: the same client and session read a real answer."""
    answer = {"status": "RUNNING", "message": "running", "driver_exit_code": None}
    with Hostile(json_answer(answer)) as head:

        async def go() -> Any:
            async with dashboard_session() as session:
                return await RayJobClient(session).status(Dashboard(head.url, TOKEN), "job-1")

        view = asyncio.run(go())
    assert view is not None and view.status == "RUNNING"
    (_, path, headers), *_ = head.requests
    assert path == "/api/jobs/job-1" and headers["Authorization"] == f"Bearer {TOKEN}"
    assert headers["Accept-Encoding"] == "identity"


def test_the_client_refuses_a_session_that_decompresses() -> None:
    async def go() -> None:
        async with aiohttp.ClientSession() as session:
            RayJobClient(session)

    with pytest.raises(ValueError, match="does not decompress"):
        asyncio.run(go())


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
@pytest.mark.attack(
    "a job's head answers the operator with a compression bomb (a few hundred KiB that inflate "
    f"to {INFLATED_MIB['gzip']} MiB) to crash the cluster-wide operator by memory",
    "the dashboard client never decompresses (auto_decompress off) and refuses an encoded "
    "answer unread (rlhf_operator.rayjobs, rlhfjob.untrusted)",
)
def test_a_compression_bomb_is_never_inflated(encoding: str, bombs: dict[str, bytes]) -> None:
    with Hostile(encoded(bombs[encoding], encoding)) as head, peak_memory() as peak:
        error = ask(head.url)
    assert "encoded" in error and "not accepted" in error
    assert peak[0] < 8 * MIB, f"{peak[0] / MIB:.0f} MiB"
    assert_short_and_clean(error, TOKEN)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.attack(
    "a job's head answers the operator with a body of a GiB to crash it by memory",
    f"the dashboard client reads at most {DASHBOARD_MAX_BYTES // MIB} MiB of an answer and "
    "refuses a longer one (rlhf_operator.rayjobs, rlhfjob.untrusted)",
)
def test_a_huge_answer_is_read_only_up_to_the_bound(declared: bool) -> None:
    with Hostile(endless(declared=declared)) as head, peak_memory() as peak:
        error = ask(head.url)
    assert f"longer than {DASHBOARD_MAX_BYTES} bytes" in error
    assert peak[0] < 8 * MIB, f"{peak[0] / MIB:.0f} MiB"
    assert head.sent < 64 * MIB  # the client hung up long before the end


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("call", ["status", "submit", "stop"])
@pytest.mark.attack(
    "a job's head redirects the operator to another address (the operator pod as an SSRF "
    "proxy, the token sent on, the answer landing in the job's status)",
    "the dashboard client follows no redirect: a 3xx is a failure "
    "(rlhf_operator.rayjobs, allow_redirects off)",
)
def test_a_redirect_is_never_followed(status: int, call: str) -> None:
    with (
        Hostile(json_answer({"status": "SUCCEEDED"})) as elsewhere,
        Hostile(redirect(status, elsewhere.url)) as head,
    ):
        error = ask(head.url, call)
    assert elsewhere.requests == []  # nothing reached it, so neither did the token
    assert f"HTTP {status}: a redirect, which is not followed" in error
    assert_short_and_clean(error, TOKEN, elsewhere.url)


@pytest.mark.parametrize(("status", "call"), [(500, "status"), (400, "submit"), (418, "stop")])
@pytest.mark.attack(
    "a job's head answers an error whose 2 MiB body holds a secret, to have it copied into "
    "the job's status, its Events and the operator's log",
    "an error quotes only a snippet of the answer: printable ASCII, at most "
    f"{SNIPPET_CHARS} characters, credentials and the token masked (rlhfjob.untrusted.snippet)",
)
def test_an_error_page_is_quoted_only_as_a_short_clean_snippet(status: int, call: str) -> None:
    with Hostile(failing(status, a_secret_page())) as head:
        error = ask(head.url, call)
    assert f"HTTP {status}: Traceback: AWS_ACCESS_KEY_ID=" in error
    assert_short_and_clean(error, TOKEN, FAKE_SECRET)


@pytest.mark.attack(
    "a job's head answers a byte at a time, to hold the operator's reconciles",
    "every dashboard call has a total timeout, the whole answer's reading included "
    "(rlhf_operator.rayjobs.REQUEST_TIMEOUT)",
)
def test_an_answer_that_trickles_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rayjobs, "REQUEST_TIMEOUT", aiohttp.ClientTimeout(total=0.5))
    with Hostile(trickle()) as head:
        started = time.monotonic()
        error = ask(head.url)
    assert time.monotonic() - started < 5
    assert "no answer within 0.5s" in error


@pytest.mark.parametrize(
    "answer",
    [
        {"status": {"nested": True}},
        {"status": "RUNNING", "message": ["not", "text"]},
        {"status": "FAILED", "driver_exit_code": "3"},
        {"status": "FAILED", "end_time": "yesterday"},
        {"status": "FAILED", "end_time": 1e300},
    ],
    ids=["status", "message", "exit-code", "end-time", "end-time-overflow"],
)
@pytest.mark.attack(
    "a job's head answers fields of the wrong type to make the operator's reconcile raise",
    "the answer's fields are checked; a wrong one is a dashboard error, not an exception "
    "(rlhf_operator.parsers.ray_job_view)",
)
def test_a_malformed_answer_is_a_dashboard_error(answer: dict[str, Any]) -> None:
    with Hostile(json_answer(answer)) as head:
        error = ask(head.url)
    assert "malformed answer for job job-1" in error


def test_deeply_nested_json_is_a_dashboard_error() -> None:
    body = b"[" * 200_000 + b"]" * 200_000
    with Hostile(failing(200, body)) as head:
        error = ask(head.url)
    assert "unexpected answer for job job-1: 200" in error


# -- the trainer's remote-reward client -----------------------------------------------------------


def score(url: str, timeout: float = 5.0) -> Exception:
    """One call of a remote reward at `url` (no retries); the error it raised."""
    spec = RemoteRewardSpec(url=f"{url}/score", timeout_seconds=timeout, max_retries=0)
    reward = RemoteReward.from_spec(spec, lambda ids: " ".join(map(str, ids)))
    with pytest.raises((RemoteRewardRejected, RemoteRewardUnavailable)) as raised:
        reward([[1, 2]], [[3]])
    return raised.value


def test_a_well_behaved_reward_server_is_read() -> None:
    """The control: the same client reads a real answer."""
    with Hostile(json_answer({"rewards": [0.5]})) as server:
        spec = RemoteRewardSpec(url=f"{server.url}/score", max_retries=0)
        assert RemoteReward.from_spec(spec, str)([[1]], [[2]]) == [0.5]
    assert server.requests[0][2]["Accept-Encoding"] == "identity"


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
@pytest.mark.attack(
    "a remote reward server answers the trainer with a compression bomb",
    "the remote-reward client decompresses nothing and refuses an encoded answer unread "
    "(rlhf_trainer.rewards.remote, rlhfjob.untrusted)",
)
def test_a_reward_bomb_is_never_inflated(encoding: str, bombs: dict[str, bytes]) -> None:
    with Hostile(encoded(bombs[encoding], encoding)) as server, peak_memory() as peak:
        error = score(server.url)
    assert isinstance(error, RemoteRewardRejected) and "encoded" in str(error)
    assert peak[0] < 8 * MIB, f"{peak[0] / MIB:.0f} MiB"


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.attack(
    "a remote reward server answers the trainer with a body of a GiB",
    f"the remote-reward client reads at most {REWARD_ANSWER_MAX_BYTES // MIB} MiB of an answer "
    "and refuses a longer one (rlhf_trainer.rewards.remote, rlhfjob.untrusted)",
)
def test_a_huge_reward_answer_is_read_only_up_to_the_bound(declared: bool) -> None:
    with Hostile(endless(declared=declared)) as hostile, peak_memory() as peak:
        error = score(hostile.url)
    assert isinstance(error, RemoteRewardRejected)
    assert f"longer than {REWARD_ANSWER_MAX_BYTES} bytes" in str(error)
    assert peak[0] < REWARD_ANSWER_MAX_BYTES + 8 * MIB, f"{peak[0] / MIB:.0f} MiB"
    assert hostile.sent < 128 * MIB


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.attack(
    "a remote reward server redirects the trainer elsewhere (the prompts and responses sent "
    "on to another address)",
    "the remote-reward client has no redirect handler: a 3xx is refused "
    "(rlhf_trainer.rewards.remote)",
)
def test_a_reward_redirect_is_never_followed(status: int) -> None:
    with (
        Hostile(json_answer({"rewards": [1.0]})) as elsewhere,
        Hostile(redirect(status, elsewhere.url)) as server,
    ):
        error = score(server.url)
    assert elsewhere.requests == []
    assert isinstance(error, RemoteRewardRejected)
    assert f"HTTP {status}: a redirect, which is not followed" in str(error)


@pytest.mark.parametrize("status", [400, 503])
@pytest.mark.attack(
    "a remote reward server answers an error whose 2 MiB body holds a secret, to have it "
    "copied into the job's status, Events and logs",
    "an error quotes only a snippet of the server's message (rlhfjob.untrusted.snippet)",
)
def test_a_reward_error_page_is_quoted_only_as_a_snippet(status: int) -> None:
    with Hostile(failing(status, a_secret_page())) as server:
        error = score(server.url)
    expected = RemoteRewardRejected if status == 400 else RemoteRewardUnavailable
    assert isinstance(error, expected)
    assert f"HTTP {status}: Traceback: AWS_ACCESS_KEY_ID=<redacted>" in str(error)
    assert_short_and_clean(str(error), TOKEN, FAKE_SECRET)


@pytest.mark.attack(
    "a remote reward server answers a byte at a time, each read just inside the socket timeout",
    "the whole answer must arrive within timeoutSeconds (rlhf_trainer.rewards.remote)",
)
def test_a_reward_answer_that_trickles_times_out() -> None:
    with Hostile(trickle()) as server:
        started = time.monotonic()
        error = score(server.url, timeout=0.5)
    assert time.monotonic() - started < 5
    assert isinstance(error, RemoteRewardUnavailable) and "timed out" in str(error)


# -- the snippet ----------------------------------------------------------------------------------


def test_the_snippet_masks_secrets_and_keeps_plain_words() -> None:
    assert snippet("job x failed: exit code 3") == "job x failed: exit code 3"
    assert snippet(b"") == "(empty)"
    assert snippet("a\x00b\r\nc\x1b[0m  d") == "a b c [0m d"
    text = (
        f"url https://user:pw@example.com/x token={TOKEN} Bearer abc.def "
        f'"password": "hunter2" {FAKE_SECRET} eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig '
        "sk-abcdefghijklmnopqrstuvwx aB3dE5gH7jK9mN1pQ3sT5vW7yZ9bC1dE3"
    )
    masked = snippet(text, secrets=["pw"], limit=1000)
    for secret in (TOKEN, "hunter2", "abc.def", FAKE_SECRET, "eyJhbGci", "sk-abc", "aB3dE5"):
        assert secret not in masked, (secret, masked)
    assert "example.com" in masked and "password" in masked
    long = snippet("y" * 10_000)
    assert len(long) == SNIPPET_CHARS and long.endswith("...")
    assert json.loads(json.dumps(masked)) == masked
