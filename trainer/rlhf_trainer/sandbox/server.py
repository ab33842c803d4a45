"""The sandbox server, one per sandbox pod: tool calls over HTTP, each in a fresh child.

    python -m rlhf_trainer.sandbox.server --token-file FILE [--port 8470] [--host 0.0.0.0] \\
        [--run-as 65534] [--isolation auto|namespaces|none] [--work-root DIR] \\
        [--wall-seconds 10 --cpu-seconds 10 --memory-bytes ... (SandboxLimits' fields)]

The protocol is `rlhfjob.contract.sandbox`'s: ``POST /v1/call`` (bearer token), ``GET /healthz``
and ``GET /metrics``. The server itself never runs a tool: it checks the caller (the token,
compared in constant time; read once from its file and never logged), the body (bounded, a
`ToolCall`, arguments against the tool's JSON schema), waits for one of ``slots`` (503 past
``queue_seconds``), and hands the call to `runner` (a fresh worker process under the limits;
`docs/security.md`, "The sandbox", says what isolates it). Before it listens it runs one real
call under the strongest isolation this pod allows (`runner.probe`) and serves with that; where
calls get no network namespace it says so once in its log, in /healthz and in
``rlhf_sandbox_isolation{layer="network"}``: egress then rests on the pod's NetworkPolicy.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import math
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import exposition as prometheus_exposition
from pydantic import ValidationError

from rlhf_trainer.sandbox import jail
from rlhf_trainer.sandbox.runner import Runner, Slot, plans, probe
from rlhf_trainer.sandbox.tools import TOOLS
from rlhfjob.contract.sandbox import (
    CALL_PATH,
    HEALTH_PATH,
    MAX_REQUEST_BYTES,
    MAX_RESULT_BYTES,
    METRICS_PATH,
    SANDBOX_PORT,
    SandboxHealth,
    SandboxIsolation,
    SandboxLimits,
    ToolCall,
    ToolResult,
    limit_flag,
)

LOG = logging.getLogger("rlhf_trainer.sandbox.server")
DEFAULT_RUN_AS = 65534
CALLS_TOTAL = "rlhf_sandbox_calls_total"
CALL_SECONDS = "rlhf_sandbox_call_seconds"
IN_FLIGHT = "rlhf_sandbox_in_flight"
TIMEOUTS_TOTAL = "rlhf_sandbox_timeouts_total"
REJECTED_TOTAL = "rlhf_sandbox_rejected_total"
ISOLATION = "rlhf_sandbox_isolation"
CALL_BUCKETS_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
NO_NETWORK_NAMESPACE = (
    "calls get no network namespace of their own on this pod: their network isolation rests "
    "on the pod's NetworkPolicy"
)


class SandboxMetrics:
    """The server's series, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.calls = Counter(
            CALLS_TOTAL.removesuffix("_total"),
            "Calls run, by tool and outcome.",
            ["tool", "outcome"],
            registry=r,
        )
        self.seconds = Histogram(
            CALL_SECONDS,
            "Wall time of one call in its sandbox.",
            ["tool"],
            buckets=CALL_BUCKETS_SECONDS,
            registry=r,
        )
        self.in_flight = Gauge(IN_FLIGHT, "Calls running now.", registry=r)
        self.timeouts = Counter(
            TIMEOUTS_TOTAL.removesuffix("_total"),
            "Calls stopped by a time limit.",
            ["tool"],
            registry=r,
        )
        self.rejected = Counter(
            REJECTED_TOTAL.removesuffix("_total"),
            "Requests refused before running (unauthorized, bad_request, too_large, "
            "unknown_tool, invalid_arguments, full).",
            ["reason"],
            registry=r,
        )
        self.isolation = Gauge(
            ISOLATION,
            "1 where calls have this isolation layer (network, pids, mounts, "
            "readonly_root, uid), 0 where it rests on the pod.",
            ["layer"],
            registry=r,
        )

    def record(self, tool: str, result: ToolResult) -> None:
        self.calls.labels(tool, result.outcome).inc()
        self.seconds.labels(tool).observe(result.seconds)
        if result.outcome == "timeout":
            self.timeouts.labels(tool).inc()


class SandboxServer:
    """The HTTP side; `runner` and `isolation` are set by the start-up probe."""

    def __init__(
        self,
        token: str,
        limits: SandboxLimits,
        *,
        run_as: int = DEFAULT_RUN_AS,
        isolation: str = "auto",
        work_root: str | None = None,
        hide: Sequence[str] = (),
    ) -> None:
        if not token:
            raise ValueError("the sandbox token is empty")
        self._token = token.encode()
        self.limits = limits
        self.run_as = run_as
        self.isolation_choice = isolation
        self.hide = tuple(hide)
        self._own_work_root = work_root is None
        self.work_root = work_root or tempfile.mkdtemp(prefix="rlhf-sandbox-")
        Path(self.work_root).chmod(0o711)  # calls reach their own directory, list none
        self.metrics = SandboxMetrics()
        self.validators = {
            name: jsonschema.Draft202012Validator(TOOLS[name].parameters) for name in TOOLS
        }
        self.runner: Runner | None = None
        self.isolation: SandboxIsolation | None = None
        self._slots: asyncio.Queue[Slot] = asyncio.Queue()
        root = os.geteuid() == 0
        for index in range(limits.slots):
            uid, gid = (run_as + index,) * 2 if root else (os.geteuid(), os.getegid())
            self._slots.put_nowait(Slot(index, uid, gid))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.router.add_post(CALL_PATH, self.call)
        app.router.add_get(HEALTH_PATH, self.health)
        app.router.add_get(METRICS_PATH, self.prometheus)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        """Find the strongest isolation that works here (a real call) before listening."""
        candidates = plans(self.isolation_choice, root=os.geteuid() == 0)
        first = self._slots.get_nowait()  # nothing runs yet: the probe runs in slot 0
        try:
            self.runner, self.isolation = await probe(
                self.limits, candidates, self.work_root, self.hide, first
            )
        finally:
            self._slots.put_nowait(first)
        for layer, on in self.isolation.model_dump().items():
            self.metrics.isolation.labels(layer).set(1 if on else 0)
        LOG.info("sandbox isolation: %s", self.isolation.model_dump())
        if not self.isolation.network:
            LOG.warning(NO_NETWORK_NAMESPACE)
        for path in self.hide:
            if Path(path).stat().st_mode & stat.S_IROTH and not self.isolation.mounts:
                LOG.warning(
                    "the token file is readable by every user, and calls here do not "
                    "get it hidden: mount it readable by its owner only"
                )

    async def _stop(self, _: web.Application) -> None:
        if self._own_work_root:
            await asyncio.to_thread(shutil.rmtree, self.work_root, True)

    def _authorized(self, request: web.Request) -> bool:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self._token
        )

    def _refuse(self, status: int, reason: str, message: str, **extra: Any) -> web.Response:
        self.metrics.rejected.labels(reason).inc()
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
        if status == 503:
            headers["Retry-After"] = "1"
        return web.json_response({"error": message, **extra}, status=status, headers=headers)

    async def call(self, request: web.Request) -> web.Response:
        """``POST /v1/call``: the checks in order (who, how big, what, which tool, its
        arguments), a slot, the run, the result."""
        if not self._authorized(request):
            return self._refuse(401, "unauthorized", "a valid bearer token is required")
        if (request.content_length or 0) > MAX_REQUEST_BYTES:
            return self._refuse(413, "too_large", f"the call is over {MAX_REQUEST_BYTES} bytes")
        try:
            call = ToolCall.model_validate_json(await request.read())
        except web.HTTPRequestEntityTooLarge:
            return self._refuse(413, "too_large", f"the call is over {MAX_REQUEST_BYTES} bytes")
        except ValidationError as error:
            return self._refuse(400, "bad_request", "not a ToolCall: " + _problems(error))
        if call.tool not in TOOLS:
            return self._refuse(404, "unknown_tool", f"no tool {call.tool!r}", tools=list(TOOLS))
        problem = jsonschema.exceptions.best_match(
            self.validators[call.tool].iter_errors(call.arguments)
        )
        if problem is not None:
            self.metrics.rejected.labels("invalid_arguments").inc()
            where = "/".join(str(part) for part in problem.absolute_path) or "arguments"
            message = f"invalid arguments: {where}: {problem.message}"[:500]
            return _answer(ToolResult(call_id=call.call_id, outcome="error", error=message))
        try:
            slot = await asyncio.wait_for(self._slots.get(), timeout=self.limits.queue_seconds)
        except TimeoutError:
            return self._refuse(503, "full", f"all {self.limits.slots} slots are busy")
        try:
            result = await self._run(call, slot)
        finally:
            self._slots.put_nowait(slot)
        self.metrics.record(call.tool, result)
        return _answer(result)

    async def _run(self, call: ToolCall, slot: Slot) -> ToolResult:
        assert self.runner is not None
        wall = min(self.limits.wall_seconds, call.timeout_s or math.inf)
        self.metrics.in_flight.inc()
        started = time.monotonic()
        try:
            run = await self.runner.run(call.tool, call.arguments, wall, slot)
        finally:
            self.metrics.in_flight.dec()
        result, setup = run.result(call.call_id)
        if setup:
            LOG.error("a call's sandbox could not be set up: %s", setup)
        LOG.info(
            "call %r tool=%s outcome=%s %.3fs",
            call.call_id[:64],
            call.tool,
            result.outcome,
            time.monotonic() - started,
        )
        return result

    async def health(self, _: web.Request) -> web.Response:
        assert self.isolation is not None
        health = SandboxHealth(
            tools=list(TOOLS),
            slots=self.limits.slots,
            in_flight=self.limits.slots - self._slots.qsize(),
            isolation=self.isolation,
        )
        return web.json_response(health.model_dump())

    async def prometheus(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": prometheus_exposition.CONTENT_TYPE_LATEST},
        )


def _problems(error: ValidationError) -> str:
    """A validation error without the values given (they may be anything)."""
    parts = [
        f"{'.'.join(str(p) for p in item['loc']) or 'body'}: {item['msg']}"
        for item in error.errors(include_input=False, include_url=False)[:3]
    ]
    return "; ".join(parts)[:300]


def _answer(result: ToolResult) -> web.Response:
    """The result as JSON, its output cut further if escaping made it larger than a client
    reads (`MAX_RESULT_BYTES`: control characters take six bytes each)."""
    body = result.model_dump_json().encode()
    while len(body) > MAX_RESULT_BYTES:
        result = result.model_copy(update={"output": result.output[: len(result.output) // 2]})
        body = result.model_dump_json().encode()
    return web.Response(body=body, content_type="application/json")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlhf_trainer.sandbox.server")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=SANDBOX_PORT)
    parser.add_argument("--token-file", required=True, help="the bearer token, read once")
    parser.add_argument(
        "--run-as",
        type=int,
        default=DEFAULT_RUN_AS,
        help="as root: slot i's calls run as this uid (and gid) + i",
    )
    parser.add_argument(
        "--isolation",
        choices=["auto", "namespaces", "none"],
        default="auto",
        help="auto: the strongest that works here",
    )
    parser.add_argument("--work-root", help="where calls' directories are made (default: new)")
    for name, field in SandboxLimits.model_fields.items():
        parser.add_argument(
            limit_flag(name),
            dest=name,
            type=float if field.annotation is float else int,
            default=field.default,
        )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    jail.not_dumpable()  # the token in this process's memory: not for processes of its uid
    limits = SandboxLimits(**{name: getattr(args, name) for name in SandboxLimits.model_fields})
    token_file = os.path.realpath(args.token_file)
    token = Path(token_file).read_text().strip()
    server = SandboxServer(
        token,
        limits,
        run_as=args.run_as,
        isolation=args.isolation,
        work_root=args.work_root,
        hide=[token_file],
    )
    web.run_app(
        server.app(),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        shutdown_timeout=2.0,
    )


if __name__ == "__main__":
    main()
