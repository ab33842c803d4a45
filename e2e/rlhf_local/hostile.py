"""Hostile HTTP endpoints for the security tests: what a job's replaced dashboard, or a remote
reward server it names, could answer (issue 49).

`Hostile` is a real aiohttp server on 127.0.0.1 (a random port) in a thread with its own event
loop, so a synchronous client (the trainer's remote reward, the e2e tier's operator process)
and an asynchronous one (the operator's dashboard client in the unit tier) meet it alike. The
handlers are the attacks: a compression bomb (`encoded(bomb(...))`), a body of a GiB
(`endless`), a redirect to another server (`redirect`), an error page (`failing`), an answer
that trickles (`trickle`); `json_answer` is the well-behaved control.
"""

from __future__ import annotations

import asyncio
import threading
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

MIB = 1024 * 1024
ServerHandler = Callable[["Hostile", web.Request], Awaitable[web.StreamResponse]]
"""What a `Hostile` server answers a request with (the server, to count what it sent)."""
WBITS = {"gzip": 31, "deflate": 15}
"""zlib's window bits for each Content-Encoding."""


class Hostile:
    """A real HTTP server answering every request with `handler`; it records each request's
    method, path and headers, and `sent` counts the body bytes a handler managed to write."""

    def __init__(self, handler: ServerHandler | None = None) -> None:
        self.handler = handler or json_answer({})
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.sent = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="hostile")
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path, dict(request.headers)))
        return await self.handler(self, request)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = self._runner.addresses[0][1]
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> Hostile:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the hostile server did not start")
        return self

    def __exit__(self, *_: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


_GONE = (ConnectionError, aiohttp.ClientConnectionResetError)
"""What writing to a client that hung up raises."""


def bomb(encoding: str, inflated_mib: int) -> bytes:
    """`inflated_mib` MiB of zeros compressed for `encoding` (gzip or deflate): about a
    thousandth of that, built a MiB at a time (never holding what it inflates to)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, WBITS[encoding])
    zeros = bytes(MIB)
    return b"".join(compressor.compress(zeros) for _ in range(inflated_mib)) + compressor.flush()


def inflated_size(body: bytes, encoding: str) -> int:
    """What `body` inflates to, counted a MiB at a time."""
    inflater = zlib.decompressobj(WBITS[encoding])
    size, data = 0, body
    while data:
        size += len(inflater.decompress(data, MIB))
        data = inflater.unconsumed_tail
    return size


def encoded(body: bytes, encoding: str) -> ServerHandler:
    """A 200 whose body is `body`, declared as compressed with `encoding`."""

    async def handle(server: Hostile, request: web.Request) -> web.StreamResponse:
        headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
        return web.Response(body=body, headers=headers)

    return handle


def endless(*, declared: bool, chunk: bytes = b"x" * MIB, mib: int = 1024) -> ServerHandler:
    """A 200 of `mib` MiB written a chunk at a time until the client goes (`declared`: with a
    Content-Length; else chunked, so only the client's own bound can stop the read)."""

    async def handle(server: Hostile, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        if declared:
            response.content_length = mib * MIB
        await response.prepare(request)
        try:
            for _ in range(mib * MIB // len(chunk)):
                await response.write(chunk)
                server.sent += len(chunk)
        except _GONE:
            pass  # the client hung up: the rest is never sent
        return response

    return handle


def redirect(status: int, to: str) -> ServerHandler:
    """A `status` redirect to the same path under `to`/stolen."""

    async def handle(server: Hostile, request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, headers={"Location": f"{to}/stolen{request.path}"})

    return handle


def failing(status: int, body: bytes) -> ServerHandler:
    """An answer of `status` with `body` as plain text."""

    async def handle(server: Hostile, request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, body=body, content_type="text/plain")

    return handle


def trickle(period: float = 0.05) -> ServerHandler:
    """A 200's headers at once, then one byte every `period` seconds for a minute or so: each
    read of the client gets something, so only a deadline on the whole answer stops it."""

    async def handle(server: Hostile, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = 10_000
        await response.prepare(request)
        try:
            for _ in range(int(60 / period)):
                await response.write(b" ")
                server.sent += 1
                await asyncio.sleep(period)
        except _GONE:
            pass
        return response

    return handle


def json_answer(document: Any) -> ServerHandler:
    """The well-behaved control: a 200 with `document` as JSON."""

    async def handle(server: Hostile, request: web.Request) -> web.StreamResponse:
        return web.json_response(document)

    return handle
