"""The real sandbox server for the agentic tests: `python -m rlhf_trainer.sandbox.server` on a
free local port with a fresh token, ready once its /healthz answers."""

from __future__ import annotations

import contextlib
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rlhfjob.contract.sandbox import HEALTH_PATH

START_SECONDS = 60.0


@dataclass
class Sandbox:
    url: str
    token: str
    log: Path


@contextlib.contextmanager
def running_sandbox(directory: Path) -> Iterator[Sandbox]:
    """A server for the duration of the block (killed after it)."""
    directory.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    token_file = directory / "token"
    token_file.write_text(token)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = directory / "server.log"
    command = [sys.executable, "-m", "rlhf_trainer.sandbox.server", "--host", "127.0.0.1",
               "--port", str(port), "--token-file", str(token_file)]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_SECONDS
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the sandbox never got ready: {log.read_text()[-2000:]}")
            time.sleep(0.05)  # polling its readiness
        yield Sandbox(url, token, log)
    finally:
        process.kill()
        process.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + HEALTH_PATH, timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False
