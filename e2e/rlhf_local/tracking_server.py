"""A real MLflow tracking server for tests: `mlflow server` on a free port of the loopback, a
SQLite store, artifacts proxied over HTTP as a remote server serves them. The server runs from
a venv of its own, `SERVER_VENV` (`task setup` makes it; `e2e/requirements-mlflow-server.txt`
says why it is not the project's)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from rlhf_local.paths import REPO_ROOT
from rlhf_local.procs import free_port

SERVER_VENV = REPO_ROOT / ".local" / "mlflow-server"
"""The server's own venv (the Taskfile's MLFLOW_VENV)."""

START_TIMEOUT_S = 420.0
"""Seconds the server may take to answer `/health`: seconds idle, minutes on a loaded machine."""


@contextlib.contextmanager
def mlflow_server(directory: Path) -> Iterator[str]:
    """The server's URL while it runs; stopped with its whole process group after."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    python = SERVER_VENV / "bin" / "python"
    if not python.is_file():
        raise RuntimeError(f"no MLflow server venv at {SERVER_VENV}: run `task setup`")
    command = [str(python), "-m", "mlflow", "server", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}"]
    command += ["--artifacts-destination", str(directory / "artifacts")]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job workers
    log = directory / "mlflow-server.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(uri, server, log)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def wait_healthy(uri: str, server: subprocess.Popen[bytes], log: Path) -> None:
    """Poll `/health` until it answers; RuntimeError with the server's log if it never does."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(
                f"mlflow server exited {server.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.25)  # the interval between polls
    raise RuntimeError(f"mlflow server not healthy in time:\n{log.read_text()[-3000:]}")
