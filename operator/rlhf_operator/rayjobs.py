"""A small client for Ray's Job Submission REST API on the head's dashboard.

Only what the operator needs: submit (idempotent by submission id), read one job's status, stop
it. Every call carries the job's Ray token and has a timeout; a dashboard that does not answer
(or refuses the token) raises `DashboardUnavailableError`, which the reconciler turns into a
condition and a retry, never a failure of the job.

The head runs the job's own code, which may replace the dashboard: every answer is untrusted
(`rlhfjob.untrusted`). No redirect is followed (it would carry the token elsewhere and make the
operator a proxy), nothing is decompressed (a small gzip body inflates past the operator's
memory limit, and one operator serves every tenant), at most `DASHBOARD_MAX_BYTES` of an answer
is read, and an error quotes at most a sanitised snippet of it.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from rlhf_operator.parsers import ray_job_view
from rlhf_operator.ports import Dashboard, DashboardUnavailableError
from rlhf_operator.views import RayJobView
from rlhfjob.untrusted import (
    DASHBOARD_MAX_BYTES,
    ERROR_BODY_MAX_BYTES,
    encoding_problem,
    redirect_problem,
    snippet,
    too_long_declared,
)

__all__ = ["DashboardUnavailableError", "RayJobClient", "dashboard_session"]

REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=10, sock_connect=5)
"""One call, connecting and reading the whole answer included: a head that trickles its answer
holds one reconcile of its own job this long, nothing more."""


def dashboard_session() -> aiohttp.ClientSession:
    """The session the operator asks every dashboard through: nothing decompressed, no cookie
    kept (one head's cookie is no other head's business), no proxy from the environment."""
    return aiohttp.ClientSession(
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
        timeout=REQUEST_TIMEOUT,
    )


class RayJobClient:
    """`ports.RayJobsPort` over aiohttp."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        if session.auto_decompress:
            raise ValueError("the dashboard client needs a session that does not decompress")
        self._session = session

    async def _request(
        self, method: str, dashboard: Dashboard, path: str, payload: dict[str, Any] | None = None
    ) -> tuple[int, bytes]:
        """The answer's status and body (of a 2xx, whole; of another, its start)."""
        url = f"{dashboard.url}{path}"
        headers = {"Accept-Encoding": "identity"}
        if dashboard.token:
            headers["Authorization"] = f"Bearer {dashboard.token}"
        try:
            async with self._session.request(
                method,
                url,
                json=payload,
                headers=headers,
                timeout=REQUEST_TIMEOUT,
                allow_redirects=False,
            ) as response:
                body = await _answer(response)
        except (aiohttp.ClientError, TimeoutError, _RefusedAnswerError) as error:
            said = str(error) if isinstance(error, _RefusedAnswerError) else _client_error(error)
            problem = f"{method} {url}: {snippet(said, secrets=[dashboard.token])}"
            raise DashboardUnavailableError(problem) from None
        status = response.status
        if status in (401, 403):  # a token that does not match this head
            raise DashboardUnavailableError(f"{method} {url}: HTTP {status}")
        if status >= 500 and b"already exists" not in body:
            said = snippet(body, secrets=[dashboard.token])
            raise DashboardUnavailableError(f"{method} {url}: HTTP {status}: {said}")
        return status, body

    async def status(self, dashboard: Dashboard, submission_id: str) -> RayJobView | None:
        """The job's state, or None when no job with that id was submitted."""
        code, body = await self._request("GET", dashboard, f"/api/jobs/{submission_id}")
        if code == 404:
            return None
        try:
            document = json.loads(body) if code == 200 else None
        except (ValueError, RecursionError):
            document = None
        if not isinstance(document, dict) or "status" not in document:
            raise DashboardUnavailableError(f"unexpected answer for job {submission_id}: {code}")
        message = document.get("message")
        if isinstance(message, str) and dashboard.token:
            document["message"] = message.replace(dashboard.token, "<redacted>")
        try:
            return ray_job_view(submission_id, document)
        except ValueError as error:
            problem = f"malformed answer for job {submission_id}: {error}"
            raise DashboardUnavailableError(problem) from None

    async def submit(
        self,
        dashboard: Dashboard,
        submission_id: str,
        entrypoint: str,
        *,
        env: dict[str, str],
        metadata: dict[str, str],
    ) -> None:
        """Submit once: a second submission of the same id is a no-op, not a duplicate job."""
        payload = {
            "entrypoint": entrypoint,
            "submission_id": submission_id,
            "runtime_env": {"env_vars": env},
            "metadata": metadata,
        }
        code, body = await self._request("POST", dashboard, "/api/jobs/", payload)
        if code == 200 or b"already exists" in body:
            return
        said = snippet(body, secrets=[dashboard.token])
        raise DashboardUnavailableError(f"submitting {submission_id}: HTTP {code}: {said}")

    async def stop(self, dashboard: Dashboard, submission_id: str) -> None:
        code, body = await self._request("POST", dashboard, f"/api/jobs/{submission_id}/stop")
        if code not in (200, 404):
            said = snippet(body, secrets=[dashboard.token])
            raise DashboardUnavailableError(f"stopping {submission_id}: HTTP {code}: {said}")


class _RefusedAnswerError(Exception):
    """An answer the client will not read: a redirect, an encoded or an oversized body."""


async def _answer(response: aiohttp.ClientResponse) -> bytes:
    """The body of an answer that is neither a redirect nor encoded: of a 2xx, whole up to
    `DASHBOARD_MAX_BYTES` (a longer one is refused); of another status, its first
    `ERROR_BODY_MAX_BYTES` (only ever quoted as a snippet)."""
    if (problem := redirect_problem(response.status)) is not None:
        raise _RefusedAnswerError(problem)
    if (problem := encoding_problem(response.headers.get("Content-Encoding"))) is not None:
        raise _RefusedAnswerError(problem)
    whole = 200 <= response.status < 300
    limit = DASHBOARD_MAX_BYTES if whole else ERROR_BODY_MAX_BYTES
    if whole and too_long_declared(response.headers.get("Content-Length"), limit):
        raise _RefusedAnswerError(f"the answer is longer than {limit} bytes")
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > limit:
            if whole:
                raise _RefusedAnswerError(f"the answer is longer than {limit} bytes")
            del body[limit:]
            break
    return bytes(body)


def _client_error(error: BaseException) -> str:
    """aiohttp's words for a failed call (a timeout has none of its own)."""
    if isinstance(error, TimeoutError):
        return f"no answer within {REQUEST_TIMEOUT.total:g}s"
    return str(error) or type(error).__name__
