"""The trainer's side of the sandbox: tool calls sent to the job's sandbox pods.

    client = SandboxClient(["http://10.0.0.7:8470", "http://10.0.0.8:8470"], token)
    results = client.call_many([ToolCall(tool="python", arguments={"code": "print(2 + 2)"})])

A call is an HTTP request to one pod (`rlhfjob.contract.sandbox`); calls are spread over the
pods (each starts at the next one in turn), and one that meets a refused or broken connection, a
timeout, a 503 (that pod is full) or a 5xx is sent again to the next pod, up to ``retries``
times, and the pod is skipped by later calls for `COOLDOWN_S` while another is up: a lost pod
costs the calls it had in flight, retried elsewhere, not the job. A call that still fails
becomes a `ToolResult` with outcome ``error`` and ``sandbox unavailable: ...``: a transport
failure never raises into the rollout. What does raise is a caller's mistake the same request
would make again: a wrong token (`SandboxAuthError`, 401/403) or a body the server refuses
(`SandboxRequestError`, 400 or a 404 that is not an unknown tool). An unknown tool (the model
named one it was not offered) or a call over `MAX_REQUEST_BYTES` is an ``error`` result, since
the model made it.

The pods are outside the trainer's trust (`rlhfjob.untrusted`): no redirect is followed (none
is asked: `http.client` has no such machinery), nothing is decompressed (an encoded answer is
refused), at most `MAX_RESULT_BYTES` of an answer and `ERROR_BODY_MAX_BYTES` of an error are
read, the whole answer must arrive within ``timeout_s``, and what a pod says reaches an error
only as a snippet without the token. No proxy is used: the pods are the job's own.

Thread-safe: any number of threads may call; at most ``max_concurrency`` requests are in flight
at once. `stats` gives calls, retries, failures and latency percentiles for the trainer's
metrics. ``timeout_s`` covers a call's wait for a slot too: give it more than the servers'
``queue_seconds`` plus ``wall_seconds``, or a full pod's calls time out here and run twice.
"""

from __future__ import annotations

import http.client
import itertools
import json
import math
import threading
import time
import urllib.parse
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

from pydantic import ValidationError

from rlhfjob.contract.sandbox import (
    CALL_PATH,
    MAX_REQUEST_BYTES,
    MAX_RESULT_BYTES,
    ToolCall,
    ToolResult,
)
from rlhfjob.untrusted import (
    ERROR_BODY_MAX_BYTES,
    encoding_problem,
    redirect_problem,
    snippet,
    too_long_declared,
)

LATENCY_WINDOW = 65536
"""Calls whose latency `stats` summarises (the latest)."""
MAX_BACKOFF_SECONDS = 2.0
"""The longest wait before a retry: 503s and lost pods are retried on another pod at once; the
wait applies once every pod has been tried."""
READ_CHUNK = 64 << 10
CONNECT_TIMEOUT_S = 5.0
"""A pod that does not accept a connection within this is lost (in-cluster, a connection takes
milliseconds): the call moves on without waiting out the whole ``timeout_s``."""
COOLDOWN_S = 5.0
"""How long a pod that failed a call is skipped by the calls after it (while another is up), so
a lost pod costs the calls in flight on it, not a failed first attempt of every call after."""


class SandboxError(Exception):
    """A sandbox request that no retry can fix: the caller's mistake."""


class SandboxRequestError(SandboxError):
    """The server refused the request itself (400, or a 404 of a wrong URL)."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"sandbox {url}: HTTP {status}: {message}")
        self.url = url
        self.status = status


class SandboxAuthError(SandboxRequestError):
    """The server refused the token (401 or 403): the client was given the wrong one."""


class _TransientError(Exception):
    """One attempt failed in a way another pod (or a later try) may not."""


@dataclass(frozen=True)
class _Endpoint:
    base: str
    host: str
    port: int | None
    https: bool


def _endpoint(url: str) -> _Endpoint:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"a sandbox URL is http(s)://host[:port], not {snippet(url)!r}")
    if parts.username is not None or parts.query or parts.fragment:
        raise ValueError(f"a sandbox URL has no credentials, query or fragment: {snippet(url)!r}")
    base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
    return _Endpoint(base, parts.hostname, parts.port, parts.scheme == "https")


class SandboxClient:
    """Tool calls to a job's sandbox pods; see the module docstring."""

    def __init__(
        self,
        urls: Sequence[str],
        token: str,
        *,
        timeout_s: float = 30,
        retries: int = 2,
        max_concurrency: int = 16,
    ) -> None:
        if not urls:
            raise ValueError("a sandbox client needs at least one URL")
        if not token:
            raise ValueError("a sandbox client needs the job's sandbox token")
        if timeout_s <= 0 or retries < 0 or max_concurrency < 1:
            raise ValueError("timeout_s > 0, retries >= 0 and max_concurrency >= 1, please")
        self._endpoints = [_endpoint(url) for url in urls]
        self._token = token
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_concurrency = max_concurrency
        self._turn = itertools.count()
        self._down_until = [0.0] * len(self._endpoints)
        self._gate = threading.BoundedSemaphore(max_concurrency)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._reset_stats()

    # -- the API ---------------------------------------------------------------------------

    def call(self, call: ToolCall) -> ToolResult:
        """One call's result; a transport failure is an ``error`` result, never an exception."""
        body = call.model_dump_json().encode()
        if len(body) > MAX_REQUEST_BYTES:
            return self._done(call, _failed(call, f"the call is over {MAX_REQUEST_BYTES} bytes"))
        started = time.monotonic()
        first = next(self._turn)
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                with self._lock:
                    self._retries += 1
                laps = attempt - len(self._endpoints)
                if laps >= 0:  # every pod tried: give them a moment
                    time.sleep(min(0.1 * 2**laps, MAX_BACKOFF_SECONDS))
            index = self._pick(first + attempt)
            endpoint = self._endpoints[index]
            try:
                with self._gate:
                    result = self._attempt(endpoint, body, call)
            except _TransientError as error:
                problem = f"{endpoint.base}: {error}"
                with self._lock:
                    self._down_until[index] = time.monotonic() + COOLDOWN_S
                continue
            return self._done(call, result, time.monotonic() - started)
        with self._lock:
            self._unavailable += 1
        failed = _failed(call, f"sandbox unavailable: {problem}")
        return self._done(call, failed, time.monotonic() - started)

    def call_many(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Every call's result, in the order given, ``max_concurrency`` at a time. A
        `SandboxError` of any call is raised once the others are done (it would repeat)."""
        if not calls:
            return []
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, "sandbox-call")
            pool = self._pool
        futures = [pool.submit(self.call, call) for call in calls]
        wait(futures)
        return [future.result() for future in futures]

    def stats(self, *, reset: bool = False) -> dict[str, float]:
        """Since the start (or the last reset): ``calls``, ``retries`` (attempts after a
        call's first), ``unavailable`` (calls no pod answered), ``outcome_<name>`` counts, and
        the wall time of a call as the caller saw it, retries included: ``latency_p50``,
        ``latency_p99``, ``latency_mean``, ``latency_max`` (seconds, over the latest
        `LATENCY_WINDOW` calls)."""
        with self._lock:
            latencies = sorted(self._latencies)
            stats: dict[str, float] = {
                "calls": self._calls,
                "retries": self._retries,
                "unavailable": self._unavailable,
                **{f"outcome_{name}": count for name, count in self._outcomes.items()},
                "latency_p50": _percentile(latencies, 0.50),
                "latency_p99": _percentile(latencies, 0.99),
                "latency_mean": sum(latencies) / len(latencies) if latencies else 0.0,
                "latency_max": latencies[-1] if latencies else 0.0,
            }
            if reset:
                self._reset_stats()
        return stats

    def close(self) -> None:
        """Stop the pool `call_many` uses (calls already running finish)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- one attempt -----------------------------------------------------------------------

    def _pick(self, turn: int) -> int:
        """The pod for this attempt: the turn's, or the next one not cooling down after a
        failure (the turn's when every pod is)."""
        now = time.monotonic()
        count = len(self._endpoints)
        with self._lock:
            for step in range(count):
                index = (turn + step) % count
                if self._down_until[index] <= now:
                    return index
        return turn % count

    def _attempt(self, endpoint: _Endpoint, body: bytes, call: ToolCall) -> ToolResult:
        """One POST to one pod: its result, or `_TransientError`, or a `SandboxError`."""
        deadline = time.monotonic() + self.timeout_s
        kind = http.client.HTTPSConnection if endpoint.https else http.client.HTTPConnection
        connection = kind(
            endpoint.host, port=endpoint.port, timeout=min(CONNECT_TIMEOUT_S, self.timeout_s)
        )
        try:
            connection.connect()
            assert connection.sock is not None
            connection.sock.settimeout(self.timeout_s)
            connection.request(
                "POST",
                urllib.parse.urlsplit(endpoint.base).path + CALL_PATH,
                body=body,
                headers={
                    "Authorization": f"Bearer {self._token}",
                    "Content-Type": "application/json",
                    "Accept": "application/json",
                    "Accept-Encoding": "identity",
                },
            )
            response = connection.getresponse()
            return self._answer(endpoint, response, deadline, call)
        except TimeoutError:
            raise _TransientError(f"timed out after {self.timeout_s:g} s") from None
        except (OSError, http.client.HTTPException) as error:
            raise _TransientError(f"connection failed: {type(error).__name__}: {error}") from None
        finally:
            connection.close()

    def _answer(
        self,
        endpoint: _Endpoint,
        response: http.client.HTTPResponse,
        deadline: float,
        call: ToolCall,
    ) -> ToolResult:
        status = response.status
        if problem := redirect_problem(status) or encoding_problem(
            response.getheader("Content-Encoding")
        ):
            raise _TransientError(problem)
        if status == 200:
            if too_long_declared(response.getheader("Content-Length"), MAX_RESULT_BYTES):
                raise _TransientError(f"the answer is over {MAX_RESULT_BYTES} bytes")
            payload = _read(response, MAX_RESULT_BYTES, deadline, self.timeout_s)
            try:
                return ToolResult.model_validate_json(payload)
            except ValidationError:
                raise _TransientError("the answer is not a ToolResult") from None
        head = _read(response, ERROR_BODY_MAX_BYTES, deadline, self.timeout_s, whole=False)
        message = snippet(head, secrets=[self._token])
        if status in (401, 403):
            raise SandboxAuthError(endpoint.base, status, message)
        if status == 404 and _lists_tools(head):
            return _failed(call, f"unknown tool {call.tool!r} ({message})")
        if status == 413:
            return _failed(call, f"the call is over what the sandbox reads ({message})")
        if status >= 500 or status == 429:
            raise _TransientError(f"HTTP {status}: {message}")
        raise SandboxRequestError(endpoint.base, status, message)

    # -- bookkeeping -----------------------------------------------------------------------

    def _done(self, call: ToolCall, result: ToolResult, seconds: float = 0.0) -> ToolResult:
        if not result.call_id and call.call_id:
            result = result.model_copy(update={"call_id": call.call_id})
        with self._lock:
            self._calls += 1
            self._outcomes[result.outcome] += 1
            self._latencies.append(seconds)
        return result

    def _reset_stats(self) -> None:
        self._calls = self._retries = self._unavailable = 0
        self._outcomes: Counter[str] = Counter()
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)


def _failed(call: ToolCall, error: str) -> ToolResult:
    return ToolResult(call_id=call.call_id, outcome="error", error=snippet(error, limit=500))


def _read(
    response: http.client.HTTPResponse,
    limit: int,
    deadline: float,
    timeout_s: float,
    *,
    whole: bool = True,
) -> bytes:
    """At most `limit` bytes of a body, all arrived by `deadline` (a trickle times out). With
    `whole`, a longer body is a failure; without, its start is enough (an error's snippet)."""
    body = bytearray()
    while chunk := response.read1(min(READ_CHUNK, limit + 1 - len(body))):
        body += chunk
        if time.monotonic() > deadline:
            raise _TransientError(f"timed out after {timeout_s:g} s (the answer was arriving)")
        if len(body) > limit:
            if whole:
                raise _TransientError(f"the answer is over {limit} bytes")
            return bytes(body[:limit])
    return bytes(body)


def _lists_tools(body: bytes) -> bool:
    """Whether a 404's body is the server's "no such tool" (it lists the tools it has), not a
    wrong URL's."""
    try:
        document = json.loads(body)
    except ValueError:
        return False
    return isinstance(document, dict) and isinstance(document.get("tools"), list)


def _percentile(ordered: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list (0 for none)."""
    if not ordered:
        return 0.0
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]
