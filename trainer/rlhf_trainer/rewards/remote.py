"""Remote rewards: an HTTP reward server scores the responses (``reward.type: remote``).

A :class:`RemoteReward` has the call shape of :class:`rlhf_trainer.rewards.functions.RuleReward`
(``reward(prompts, responses, metadata) -> list[float]``), so the driver treats every reward
source alike. It decodes the token ids with the job's tokenizer, cuts the samples into requests of
``spec.batch_size``, keeps at most ``spec.max_concurrency`` of them in flight and returns the
rewards in sample order. Two wire protocols (docs/reward-protocol.md):

* ``rlhfjob``: ``{"prompts": [str], "responses": [str], "metadata": [object]}`` in,
  ``{"rewards": [float]}`` out.
* ``classify``: the classification API of vLLM and other OpenAI-compatible servers,
  ``{"model": ..., "input": [prompt + response], "use_activation": false}`` in,
  ``{"data": [{"index": i, "probs": [float, ...]}]}`` out; the reward is ``probs[0]``, the raw
  logit of label 0.

Failures are sorted by whether a restart can fix them:

* a timeout, a refused or broken connection, a 5xx or a 429 is retried (``spec.max_retries``
  times, exponential backoff from ``spec.backoff_seconds``, ``Retry-After`` honoured on 429/503);
  when the retries are spent :class:`RemoteRewardUnavailable` is raised. It is *retryable*: the
  server may be back after the operator restarts the job from its checkpoint.
* any other 4xx, or a 2xx whose body is not a valid answer, raises :class:`RemoteRewardRejected`
  (a :class:`~rlhf_trainer.rewards.functions.RewardFunctionError`) at once: the server says the
  requests are wrong, and sending them again after a restart would get the same answer.

Error messages carry a snippet of the server's own message (``rlhfjob.untrusted.snippet``:
printable ASCII, at most 200 characters, credentials masked) and the URL without credentials or
query, never the request bodies or headers (they may hold user data or secrets, and messages end
up in logs, Events and the job's status).

The server is outside the trainer's trust (``rlhfjob.untrusted``): no redirect is followed (a 3xx
is refused: the URL is wrong), only http and https are spoken, nothing is decompressed (an
encoded answer is refused), at most ``REWARD_ANSWER_MAX_BYTES`` of an answer are read (a longer
one is refused) and at most ``ERROR_BODY_MAX_BYTES`` of an error's, and the whole answer must
have arrived within ``spec.timeout_seconds`` of the request (a trickle times out). The
environment's proxy settings still apply.
"""

from __future__ import annotations

import http.client
import json
import math
import numbers
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from rlhf_trainer.rewards.functions import Decode, RewardFunctionError, checked_batch
from rlhfjob.api import RemoteRewardSpec
from rlhfjob.untrusted import (
    ERROR_BODY_MAX_BYTES,
    REWARD_ANSWER_MAX_BYTES,
    SNIPPET_CHARS,
    encoding_problem,
    redirect_problem,
    snippet,
    too_long_declared,
)

MAX_RETRY_AFTER_SECONDS = 60.0
"""A server's ``Retry-After`` is honoured up to this; longer waits are its problem, not the
step's (the retries are spent sooner and the job restarts from its checkpoint)."""
MAX_BACKOFF_SECONDS = 60.0
"""The doubling backoff stops growing here (or at ``spec.backoff_seconds`` when that is larger),
so many retries do not turn into hours of sleep."""
MESSAGE_CHARS = SNIPPET_CHARS
"""How much of a server's error body or message is quoted."""
RETRY_AFTER_STATUSES = (429, 503)
READ_CHUNK_BYTES = 64 * 1024


def _opener() -> urllib.request.OpenerDirector:
    """HTTP and HTTPS only (no file:, ftp: or data:), the environment's proxy, and no redirect
    handler: a 3xx comes back as an HTTPError and is refused, never followed."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(),
        urllib.request.HTTPHandler(),
        urllib.request.HTTPSHandler(),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


_OPENER = _opener()


class RemoteRewardUnavailable(Exception):  # noqa: N818 (the name the driver and docs use)
    """The reward server could not be reached or kept failing (timeouts, connection errors, 5xx,
    429) after every retry. Retryable: the step fails and the job restarts from its checkpoint."""

    def __init__(self, name: str, url: str, attempts: int, problem: str) -> None:
        super().__init__(
            f"remote reward {name!r}: {url} unavailable after {attempts} attempt(s): {problem}"
        )
        self.name = name
        self.url = url
        self.attempts = attempts
        self.problem = problem


class RemoteRewardRejected(RewardFunctionError):  # noqa: N818 (the name the driver and docs use)
    """The reward server refused the requests (a 4xx other than 429) or answered with a body that
    is not a valid answer. Not retryable: the job fails with the server's words."""

    def __init__(self, name: str, url: str, problem: str, status: int | None = None) -> None:
        super().__init__(name, f"{url}: {problem}")
        self.url = url
        self.status = status


class _TransientError(Exception):
    """One attempt failed in a way a retry may fix; ``retry_after`` is the server's wish."""

    def __init__(self, problem: str, retry_after: float | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.retry_after = retry_after


class _StoppedError(Exception):
    """Another request of the same call failed; this one gives up without a further attempt."""


def retry_delay(retry: int, backoff_seconds: float, retry_after: float | None = None) -> float:
    """Seconds to wait before retry number ``retry`` (0 for the first): the server's
    ``Retry-After`` when it sent one (capped at :data:`MAX_RETRY_AFTER_SECONDS`), else
    ``backoff_seconds * 2**retry`` (capped at :data:`MAX_BACKOFF_SECONDS` or the base delay)."""
    if retry_after is not None:
        return min(max(retry_after, 0.0), MAX_RETRY_AFTER_SECONDS)
    cap = max(MAX_BACKOFF_SECONDS, backoff_seconds)
    return min(backoff_seconds * 2.0 ** min(retry, 64), cap)


def parse_retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds; the HTTP-date form and garbage give None (the normal
    backoff then applies)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def display_url(url: str) -> str:
    """``url`` for messages: scheme, host, port and path; no credentials, query or fragment."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = f"{host}:{port}" if port is not None else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def server_message(body: bytes | bytearray) -> str:
    """What a server says in an error body: the ``error``/``message``/``detail`` field of a JSON
    object (the ``message`` inside an OpenAI-style ``error`` object), else the start of the
    body; a snippet of at most :data:`MESSAGE_CHARS` printable characters, secrets masked."""
    text = body.decode("utf-8", errors="replace")
    try:
        document = json.loads(text)
    except ValueError:
        document = None
    if isinstance(document, dict):
        for key in ("error", "message", "detail"):
            value = document.get(key)
            if isinstance(value, dict) and isinstance(value.get("message"), str):
                value = value["message"]
            if isinstance(value, str) and value:
                return _clip(value)
            if value:
                return _clip(json.dumps(value))
    return _clip(text) if text.strip() else "(empty body)"


def _clip(text: str) -> str:
    return snippet(text, limit=MESSAGE_CHARS)


def jsonable(value: Any) -> Any:
    """Dataset metadata as strict JSON: Parquet gives numpy scalars and arrays, dates, and NaN for
    missing values, which JSON has no word for (they become null)."""
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, dict):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    if hasattr(value, "tolist"):  # numpy scalars and arrays, torch tensors
        return jsonable(value.tolist())
    if hasattr(value, "isoformat"):  # dates and times
        return value.isoformat()
    return str(value)


@dataclass
class _CallStats:
    """What one call cost; read through :attr:`RemoteReward.last_stats`."""

    samples: int = 0
    batches: int = 0
    requests: int = 0
    retries: int = 0
    seconds: float = 0.0
    request_seconds: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_dict(self) -> dict[str, float]:
        with self.lock:
            durations = list(self.request_seconds)
            return {
                "samples": self.samples,
                "batches": self.batches,
                "requests": self.requests,
                "retries": self.retries,
                "seconds": self.seconds,
                "request_seconds_mean": sum(durations) / len(durations) if durations else 0.0,
                "request_seconds_max": max(durations, default=0.0),
            }


@dataclass
class RemoteReward:
    """Scores samples on an HTTP reward server; see the module docstring.

    Built with :meth:`from_spec`; called like a rule reward. Thread-safe for one call at a time
    (the driver scores one batch after another); :attr:`last_stats` describes the latest call.
    """

    spec: RemoteRewardSpec
    decode: Decode = field(repr=False)
    name: str = "remote"
    _last: _CallStats = field(default_factory=_CallStats, repr=False)

    @classmethod
    def from_spec(
        cls,
        spec: RemoteRewardSpec,
        decode: Callable[[list[int]], str] | None,
        *,
        name: str = "remote",
    ) -> RemoteReward:
        """Check what can be checked before any request: a remote reward scores text, so it
        needs the job's tokenizer (``decode``); credentials do not belong in the URL."""
        if decode is None:
            raise RewardFunctionError(
                name,
                "a remote reward scores text, which needs a tokenizer: set spec.model.tokenizer, "
                "or use a policy directory with one",
            )
        if urllib.parse.urlsplit(spec.url).username is not None:
            raise RewardFunctionError(
                name,
                f"{display_url(spec.url)}: credentials in the URL are not supported "
                "(they would travel to logs and the job's status)",
            )
        return cls(spec=spec, decode=decode, name=name)

    @property
    def url(self) -> str:
        """The endpoint as messages show it (no credentials, query or fragment)."""
        return display_url(self.spec.url)

    @property
    def last_stats(self) -> dict[str, float]:
        """The latest call: ``samples``, ``batches``, ``requests`` (HTTP attempts, retries
        included), ``retries``, ``seconds`` (wall time of the call) and
        ``request_seconds_mean`` / ``request_seconds_max`` (one attempt each). Set for a call that
        raised too."""
        return self._last.as_dict()

    def __call__(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        metadata: list[dict[str, Any]] | None = None,
    ) -> list[float]:
        metadata = checked_batch(prompts, responses, metadata)

        stats = _CallStats(samples=len(responses))
        self._last = stats
        started = time.monotonic()
        try:
            return self._score(prompts, responses, metadata, stats)
        finally:
            with stats.lock:
                stats.seconds = time.monotonic() - started

    def _score(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        metadata: list[dict[str, Any]],
        stats: _CallStats,
    ) -> list[float]:
        if not responses:
            return []
        prompt_texts = [self.decode(ids) for ids in prompts]
        response_texts = [self.decode(ids) for ids in responses]
        size = self.spec.batch_size
        bounds = [
            (start, min(start + size, len(responses))) for start in range(0, len(responses), size)
        ]
        stats.batches = len(bounds)
        bodies = [
            self._body(prompt_texts[start:end], response_texts[start:end], metadata[start:end])
            for start, end in bounds
        ]

        stop = threading.Event()
        workers = min(self.spec.max_concurrency, len(bodies))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="remote-reward") as pool:
            futures: list[Future[list[float]]] = [
                pool.submit(self._request, body, end - start, stop, stats)
                for body, (start, end) in zip(bodies, bounds, strict=True)
            ]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f in done and f.exception() is not None), None)
            if failed is not None:
                stop.set()  # the others stop at their next attempt or backoff
                for future in futures:
                    future.cancel()
                error = failed.exception()
                assert error is not None
                raise error
        rewards: list[float] = []
        for future in futures:
            rewards.extend(future.result())
        return rewards

    def _body(
        self, prompt_texts: list[str], response_texts: list[str], metadata: list[dict[str, Any]]
    ) -> bytes:
        if self.spec.protocol == "rlhfjob":
            document: dict[str, Any] = {
                "prompts": prompt_texts,
                "responses": response_texts,
                "metadata": jsonable(metadata),
            }
        else:
            document = {
                "input": [p + r for p, r in zip(prompt_texts, response_texts, strict=True)],
                "use_activation": False,
            }
            if self.spec.model is not None:
                document = {"model": self.spec.model, **document}
        return json.dumps(document, allow_nan=False).encode()

    def _request(
        self, body: bytes, count: int, stop: threading.Event, stats: _CallStats
    ) -> list[float]:
        """Send one request, retrying what a retry may fix; the rewards it got, validated."""
        attempts = self.spec.max_retries + 1
        for attempt in range(attempts):
            if stop.is_set():
                raise _StoppedError()
            with stats.lock:
                stats.requests += 1
                if attempt:
                    stats.retries += 1
            started = time.monotonic()
            try:
                payload = self._attempt(body)
            except _TransientError as transient:
                if attempt + 1 == attempts:
                    raise RemoteRewardUnavailable(
                        self.name, self.url, attempts, transient.problem
                    ) from None
                delay = retry_delay(attempt, self.spec.backoff_seconds, transient.retry_after)
                if stop.wait(delay):
                    raise _StoppedError() from None
                continue
            finally:
                with stats.lock:
                    stats.request_seconds.append(time.monotonic() - started)
            return self._rewards(payload, count)
        raise AssertionError("unreachable")  # pragma: no cover

    def _attempt(self, body: bytes) -> bytearray:
        """One POST; the body of a 2xx. Raises :class:`_TransientError` or
        :class:`RemoteRewardRejected`."""
        request = urllib.request.Request(
            self.spec.url,
            data=body,
            headers={
                "Content-Type": "application/json",
                "Accept": "application/json",
                "Accept-Encoding": "identity",
            },
            method="POST",
        )
        timeout = self.spec.timeout_seconds
        deadline = time.monotonic() + timeout
        try:
            with _OPENER.open(request, timeout=timeout) as response:
                return self._answer(response, deadline)
        except urllib.error.HTTPError as error:
            raise self._http_error(error, deadline) from None
        except urllib.error.URLError as error:
            reason = error.reason
            if isinstance(reason, TimeoutError):
                raise _TransientError(f"timed out after {timeout:g} s") from None
            if isinstance(reason, OSError):
                raise _TransientError(f"cannot connect: {_describe(reason)}") from None
            raise _TransientError(f"cannot connect: {snippet(str(reason))}") from None
        except TimeoutError:
            raise _TransientError(f"timed out after {timeout:g} s") from None
        except (OSError, http.client.HTTPException) as error:
            raise _TransientError(f"connection failed: {_describe(error)}") from None
        except ValueError as error:  # http.client.InvalidURL and friends: the spec is wrong
            raise RemoteRewardRejected(
                self.name, self.url, f"invalid request: {type(error).__name__}"
            ) from None

    def _answer(self, response: Any, deadline: float) -> bytearray:
        """A 2xx answer's body, refused when it is encoded or longer than
        :data:`REWARD_ANSWER_MAX_BYTES` (neither is read)."""
        problem = encoding_problem(response.headers.get("Content-Encoding"))
        limit = REWARD_ANSWER_MAX_BYTES
        if problem is None and too_long_declared(response.headers.get("Content-Length"), limit):
            problem = f"the answer is longer than {limit} bytes"
        if problem is not None:
            raise RemoteRewardRejected(self.name, self.url, problem)
        answer, whole = _read_bounded(response, limit, deadline, self.spec.timeout_seconds)
        if not whole:
            raise RemoteRewardRejected(
                self.name, self.url, f"the answer is longer than {limit} bytes"
            )
        return answer

    def _http_error(self, error: urllib.error.HTTPError, deadline: float) -> Exception:
        """What a non-2xx answer means: a redirect or any 4xx but 429 is refused, a 5xx or 429
        is worth a retry; the message is a snippet of at most the error body's start."""
        status = error.code
        try:
            if (problem := redirect_problem(status)) is not None:
                return RemoteRewardRejected(self.name, self.url, problem, status=status)
            if error.headers is not None and encoding_problem(
                error.headers.get("Content-Encoding")
            ):
                message = "(an encoded body, not read)"
            else:
                head, _ = _read_bounded(
                    error, ERROR_BODY_MAX_BYTES, deadline, self.spec.timeout_seconds
                )
                message = server_message(head)
        except (_TransientError, OSError, http.client.HTTPException):
            message = "(the body could not be read)"
        finally:
            error.close()
        if status >= 500 or status == 429:
            retry_after = None
            if status in RETRY_AFTER_STATUSES and error.headers is not None:
                retry_after = parse_retry_after(error.headers.get("Retry-After"))
            return _TransientError(f"HTTP {status}: {message}", retry_after)
        return RemoteRewardRejected(self.name, self.url, f"HTTP {status}: {message}", status=status)

    def _rewards(self, payload: bytes | bytearray, count: int) -> list[float]:
        """The rewards of a 2xx body, in sample order, or :class:`RemoteRewardRejected` naming
        what is wrong with it."""
        try:
            document = json.loads(payload)
        except ValueError:
            raise self._malformed(
                f"the body is not JSON (starts {snippet(payload[:60], limit=60)!r})"
            ) from None
        if self.spec.protocol == "rlhfjob":
            return self._rlhfjob_rewards(document, count)
        return self._classify_rewards(document, count)

    def _rlhfjob_rewards(self, document: Any, count: int) -> list[float]:
        if not isinstance(document, dict) or "rewards" not in document:
            raise self._malformed('expected an object with "rewards"')
        rewards = document["rewards"]
        if not isinstance(rewards, list):
            raise self._malformed(f'"rewards" is {type(rewards).__name__}, expected a list')
        if len(rewards) != count:
            raise self._malformed(f"{len(rewards)} rewards for {count} samples")
        return [self._number(value, f"reward {index}") for index, value in enumerate(rewards)]

    def _classify_rewards(self, document: Any, count: int) -> list[float]:
        if not isinstance(document, dict) or not isinstance(document.get("data"), list):
            raise self._malformed('expected an object with a "data" list')
        data = document["data"]
        if len(data) != count:
            raise self._malformed(f"{len(data)} results for {count} inputs")
        rewards: list[float | None] = [None] * count
        for position, item in enumerate(data):
            if not isinstance(item, dict):
                raise self._malformed(f"data[{position}] is not an object")
            index = item.get("index")
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
                raise self._malformed(
                    f"data[{position}].index is {index!r}, expected 0..{count - 1}"
                )
            if rewards[index] is not None:
                raise self._malformed(f"index {index} appears twice")
            probs = item.get("probs")
            if not isinstance(probs, list) or not probs:
                raise self._malformed(f"data[{position}].probs is not a non-empty list")
            rewards[index] = self._number(probs[0], f"data[{position}].probs[0]")
        return [reward for reward in rewards if reward is not None]

    def _number(self, value: Any, what: str) -> float:
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise self._malformed(f"{what} is {_clip(repr(value))}, expected a number")
        if not math.isfinite(value):
            raise self._malformed(f"{what} is {value}, not finite")
        return float(value)

    def _malformed(self, problem: str) -> RemoteRewardRejected:
        return RemoteRewardRejected(self.name, self.url, f"malformed answer: {problem}")


def _read_bounded(
    source: Any, limit: int, deadline: float, timeout: float
) -> tuple[bytearray, bool]:
    """The start of a body, at most ``limit`` bytes, and whether that is all of it. One read at
    a time (each returns what has arrived), so a server that trickles its answer times out at
    ``deadline`` instead of holding the request one byte per socket timeout; nothing is copied
    (a refused answer costs the bound once)."""
    read = getattr(source, "read1", None) or source.read
    body = bytearray()
    while chunk := read(min(READ_CHUNK_BYTES, limit + 1 - len(body))):
        body += chunk
        if len(body) > limit:
            del body[limit:]
            return body, False
        if time.monotonic() > deadline:
            raise _TransientError(f"timed out after {timeout:g} s (the answer was still arriving)")
    return body, True


def _describe(error: BaseException) -> str:
    """An OS error as its type and reason ("ConnectionRefusedError: Connection refused")."""
    text = getattr(error, "strerror", None) or str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
