"""The operator's readiness endpoint against a real HTTP server standing in for the API server:
ready only while it answers the operator's read of RLHFJobs, and a refusal says why in a few
words, never the body."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import aiohttp
import pytest
from kubernetes import client

from rlhf_operator.readiness import READY_PATH, Readiness, jobs_readable

SECRET_BODY = "token=hunter2"
"""What a refusal's body holds: it must never reach the probe's answer."""


class _ApiServer(ThreadingHTTPServer):
    """Answers every GET with `status` (a JSON list of RLHFJobs, or a Status), recording paths."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.status = 200
        self.paths: list[str] = []


class _Handler(BaseHTTPRequestHandler):
    server: _ApiServer

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        ok = self.server.status == 200
        body = {"kind": "RLHFJobList", "items": []} if ok else {"message": SECRET_BODY}
        data = json.dumps(body).encode()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def api_server() -> Iterator[_ApiServer]:
    server = _ApiServer()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _client(port: int) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{port}"
    return client.ApiClient(configuration)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _problem(readiness: Readiness) -> str | None:
    return asyncio.run(readiness.problem())


def test_ready_while_the_api_server_lists_rlhfjobs_where_the_operator_serves(
    api_server: _ApiServer,
) -> None:
    port = api_server.server_address[1]
    assert _problem(Readiness(jobs_readable(_client(port), ()))) is None
    assert _problem(Readiness(jobs_readable(_client(port), ("team-a", "team-b")))) is None
    assert api_server.paths == [
        "/apis/rlhf.dev/v1alpha1/rlhfjobs?limit=1",  # cluster-wide: its ClusterRole
        "/apis/rlhf.dev/v1alpha1/namespaces/team-a/rlhfjobs?limit=1",  # its Role there
    ]


def test_a_refusal_makes_it_unready_naming_the_status_but_never_the_body(
    api_server: _ApiServer,
) -> None:
    api_server.status = 403  # a role lost, a token revoked
    problem = _problem(Readiness(jobs_readable(_client(api_server.server_address[1]), ())))
    assert problem == "the API server answered 403 Forbidden"
    assert SECRET_BODY not in problem


def test_an_api_server_that_does_not_answer_makes_it_unready() -> None:
    problem = _problem(Readiness(jobs_readable(_client(_closed_port()), ())))
    assert problem is not None and problem.startswith("the API server is unreachable ("), problem


def test_one_answer_of_the_api_server_stands_for_max_age(api_server: _ApiServer) -> None:
    now = [100.0]
    readiness = Readiness(
        jobs_readable(_client(api_server.server_address[1]), ()), max_age=5, clock=lambda: now[0]
    )

    async def probes() -> list[str | None]:
        answers = [await readiness.problem(), await readiness.problem()]
        api_server.status = 500
        now[0] += 4.9
        answers.append(await readiness.problem())  # still the first answer
        now[0] += 0.2
        answers.append(await readiness.problem())  # asked again
        return answers

    answers = asyncio.run(probes())
    assert answers == [None, None, None, "the API server answered 500 Internal Server Error"]
    assert len(api_server.paths) == 2


def test_the_endpoint_answers_200_when_ready_and_503_with_the_reason_when_not(
    api_server: _ApiServer,
) -> None:
    port = _closed_port()
    readiness = Readiness(jobs_readable(_client(api_server.server_address[1]), ()), max_age=0)

    async def get(path: str) -> tuple[int, str]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}{path}") as response,
        ):
            return response.status, await response.text()

    async def scenario() -> list[tuple[int, str]]:
        runner = await readiness.serve(port, host="127.0.0.1")
        try:
            answers = [await get(READY_PATH)]
            api_server.status = 401
            answers.append(await get(READY_PATH))
            answers.append(await get("/healthz"))  # kopf's, on another port
            return answers
        finally:
            await runner.cleanup()

    assert asyncio.run(scenario()) == [
        (200, "ready\n"),
        (503, "not ready: the API server answered 401 Unauthorized\n"),
        (404, "404: Not Found"),
    ]
