"""The operator's readiness endpoint (`--readiness-port`; the chart's readinessProbe).

kopf's own endpoint (`--health-port`) is the liveness probe: it answers while kopf's event loop
runs, whatever the API server does, so an outage of the control plane restarts nothing. Ready
says more: the operator has started (its endpoint opens only then) and the API server answers
its read of RLHFJobs now (connected, its token and roles good, the CRD installed), checked at
most every `MAX_AGE_S` however often it is asked. A refusal says why in a few words, never the
API server's body.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiohttp import web
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rlhfjob import api

READY_PATH = "/readyz"
MAX_AGE_S = 5.0
"""Seconds an answer of the API server stands for (probes of several kubelets share it)."""
CHECK_TIMEOUT = (1, 3)
"""Seconds to connect and to read: inside the chart's probe timeout (5 s)."""


def jobs_readable(api_client: client.ApiClient, namespaces: tuple[str, ...]) -> Callable[[], None]:
    """A blocking check that raises unless the API server lists RLHFJobs (one at most) where the
    operator serves: every namespace, or the first it watches (its Roles are per namespace)."""
    custom = client.CustomObjectsApi(api_client)

    def check() -> None:
        if namespaces:
            custom.list_namespaced_custom_object(
                api.GROUP, api.VERSION, namespaces[0], api.PLURAL,
                limit=1, _request_timeout=CHECK_TIMEOUT,
            )  # fmt: skip
        else:
            custom.list_cluster_custom_object(
                api.GROUP, api.VERSION, api.PLURAL, limit=1, _request_timeout=CHECK_TIMEOUT
            )

    return check


def _why(error: Exception) -> str:
    """A few words on a failed check: the HTTP status and reason, or the error's type."""
    if isinstance(error, ApiException):
        return f"the API server answered {error.status} {error.reason or ''}".strip()
    return f"the API server is unreachable ({type(error).__name__})"


class Readiness:
    """Answers `READY_PATH`: 200 when `check` (blocking, run off the event loop) passed within
    the last `max_age` seconds, 503 with the reason otherwise."""

    def __init__(
        self,
        check: Callable[[], None],
        *,
        max_age: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._check = check
        self._max_age = max_age
        self._clock = clock
        self._checked_at: float | None = None
        self._problem: str | None = "not checked yet"
        self._lock = asyncio.Lock()

    async def problem(self) -> str | None:
        """Why the operator is not ready; None when it is."""
        async with self._lock:  # one check at a time: the others wait for its answer
            now = self._clock()
            if self._checked_at is None or now - self._checked_at >= self._max_age:
                try:
                    await asyncio.to_thread(self._check)
                    self._problem = None
                except Exception as error:  # any failure is an answer: not ready
                    self._problem = _why(error)
                self._checked_at = self._clock()
        return self._problem

    async def _answer(self, _: web.Request) -> web.Response:
        problem = await self.problem()
        if problem is None:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"not ready: {problem}\n")

    async def serve(self, port: int, host: str = "0.0.0.0") -> web.AppRunner:
        """Serve `READY_PATH` on `port` until the returned runner is cleaned up."""
        app = web.Application()
        app.add_routes([web.get(READY_PATH, self._answer)])
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        return runner
