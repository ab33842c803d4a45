"""Real sandbox servers for the sandbox tests: each a `python -m rlhf_trainer.sandbox.server`
process on a free local port, ready once its /healthz answers (it runs a real call before it
listens), with a fresh token and a uid range of its own (so a test that counts a server's
leftover processes never sees another's)."""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rlhfjob.contract.sandbox import CALL_PATH, HEALTH_PATH, METRICS_PATH, SandboxLimits

START_SECONDS = 60.0
GENEROUS = SandboxLimits(
    wall_seconds=5,
    cpu_seconds=4,
    memory_bytes=256 << 20,
    max_processes=8,
    max_output_bytes=8192,
    slots=4,
    queue_seconds=5,
)
TIGHT = SandboxLimits(
    wall_seconds=20,
    cpu_seconds=1,
    memory_bytes=128 << 20,
    max_processes=4,
    max_output_bytes=2048,
    max_file_bytes=1 << 20,
    slots=1,
    queue_seconds=0.3,
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Sandbox:
    """One running server, and raw HTTP to it (the client's tests use `SandboxClient`)."""

    process: subprocess.Popen[bytes]
    url: str
    token: str
    token_file: Path
    log: Path
    run_as: int
    slots: int

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def health(self) -> dict[str, Any]:
        status, body = self.get(HEALTH_PATH)
        assert status == 200, body
        health: dict[str, Any] = json.loads(body)
        return health

    def metrics(self) -> str:
        return self.get(METRICS_PATH)[1].decode()

    def post(self, body: bytes, token: str | None = None) -> tuple[int, dict[str, Any]]:
        """A raw call: the status and the JSON answer."""
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(self.url + CALL_PATH, body, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")

    def isolated(self, layer: str) -> bool:
        return bool(self.health()["isolation"][layer])

    def processes(self) -> list[int]:
        """Live processes of this server's call users (its slots' uids); a zombie is dead,
        waiting for whoever its parent is now to reap it."""
        found = []
        for entry in Path("/proc").iterdir():
            try:
                fields = dict(
                    line.split(":", 1) for line in (entry / "status").read_text().splitlines()
                )
            except (OSError, ValueError):
                continue
            uid = int(fields["Uid"].split()[0])
            if self.run_as <= uid < self.run_as + self.slots and "Z" not in fields["State"]:
                found.append(int(entry.name))
        return found

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)


def start_sandbox(
    directory: Path, limits: SandboxLimits, *flags: str, token: str | None = None
) -> Sandbox:
    """A server started and ready (its /healthz answered), or a failure with its log."""
    directory.mkdir(parents=True, exist_ok=True)
    token = token or secrets.token_hex(32)
    token_file = directory / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    port = free_port()
    run_as = 200_000 + secrets.randbelow(100_000) * 16
    log = directory / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlhf_trainer.sandbox.server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--token-file",
                str(token_file),
                "--run-as",
                str(run_as),
                *limits.to_args(),
                *flags,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    sandbox = Sandbox(
        process, f"http://127.0.0.1:{port}", token, token_file, log, run_as, limits.slots
    )
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the sandbox server exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(sandbox.url + HEALTH_PATH, timeout=2) as answer:
                if answer.status == 200:
                    return sandbox
        except OSError:
            time.sleep(0.05)  # polling its readiness, not waiting for an event
    sandbox.stop()
    raise AssertionError(f"the sandbox server never got ready: {log.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def job_token() -> str:
    """The token of the tests' job: its sandbox pods share it, as a job's do."""
    return secrets.token_hex(32)


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory: pytest.TempPathFactory, job_token: str) -> Iterator[Sandbox]:
    """A server with room to spare, shared by the tests that do not break it."""
    server = start_sandbox(tmp_path_factory.mktemp("sandbox"), GENEROUS, token=job_token)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tight(tmp_path_factory: pytest.TempPathFactory, job_token: str) -> Iterator[Sandbox]:
    """A server of small limits and one slot: the limits tests, and a full server."""
    server = start_sandbox(tmp_path_factory.mktemp("tight"), TIGHT, token=job_token)
    yield server
    server.stop()
