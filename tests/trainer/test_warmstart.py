"""The warm driver (`rlhf_trainer.run.warmstart`): an in-place restart forked from a process that
imported everything already, with the attempt's streams, environment and signals."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlhf_local.harness import wait_for as wait_until
from rlhf_trainer.run import warmstart
from rlhfjob import contract
from rlhfjob.contract import ExitCode

HERE = Path(__file__).resolve().parent
CLIENT = (
    "import sys; from rlhf_trainer.run import warmstart; sys.exit(warmstart.delegate(sys.argv[1:]))"
)


def wait_for(condition: Any, timeout: float, what: str) -> None:
    wait_until(condition, timeout, what, interval=0.02)  # these take milliseconds


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def job_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """An operator-run attempt's environment, its sockets in a temporary directory of its own
    (short: a Unix socket's path has at most 107 bytes)."""
    short = Path(tempfile.mkdtemp(prefix="w", dir="/tmp"))
    monkeypatch.setattr("tempfile.tempdir", str(short))
    gcs = socket.create_server(("127.0.0.1", 0))  # the Ray cluster, as far as it looks
    env = {
        **os.environ,
        "TMPDIR": str(short),
        warmstart.ENV_JOB_NAME: "grpo",
        warmstart.ENV_JOB_NAMESPACE: "team-a",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "WARM_TEST_MARKER": "from-the-attempt",
    }
    env.pop(warmstart.ENV_WARM_ATTEMPT, None)
    env[warmstart.ENV_RAY_ADDRESS] = f"127.0.0.1:{gcs.getsockname()[1]}"
    yield env
    warmstart.stop(env)
    gcs.close()
    shutil.rmtree(short, ignore_errors=True)


def start_warm_driver(env: dict[str, str]) -> Path:
    """The job's warm driver, serving the stand-in target (no heavy imports)."""
    path = warmstart.socket_path(env)
    warmstart.start(env, target="warm_target:main", modules=())
    wait_for(path.exists, 30, "the warm driver's socket")
    return path


def attempt(env: dict[str, str], *argv: str) -> subprocess.Popen[str]:
    """An attempt's process: `rlhfjob train ARGV` as the entrypoint runs it, handing over."""
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, "train", *argv], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=HERE,
    )  # fmt: skip


def test_the_contract_it_copies_is_the_contracts() -> None:
    assert warmstart.JOB_ENDED_CODES == (ExitCode.SUCCEEDED, ExitCode.NON_RETRYABLE)
    assert warmstart.ENV_JOB_NAME == contract.ENV_JOB_NAME
    assert warmstart.ENV_JOB_NAMESPACE == contract.ENV_JOB_NAMESPACE
    assert warmstart.ENV_JOB_CONFIG == contract.ENV_JOB_CONFIG


def test_without_a_warm_driver_the_attempt_runs_itself(job_env: dict[str, str]) -> None:
    assert warmstart.delegate(["train"], job_env) is None
    local = {k: v for k, v in job_env.items() if k != warmstart.ENV_JOB_NAME}
    assert not warmstart.enabled(local), "a local `rlhfjob train` never uses one"
    assert not warmstart.enabled({**job_env, warmstart.ENV_WARM_RESTART: "0"})
    for address in ("", "auto", "ray://head:10001"):  # no cluster it could watch
        assert not warmstart.enabled({**job_env, warmstart.ENV_RAY_ADDRESS: address})


def test_an_attempt_runs_in_a_fork_with_its_own_streams_environment_and_code(
    job_env: dict[str, str],
) -> None:
    path = start_warm_driver(job_env)
    process = attempt(job_env, "echo", "7")
    output, _ = process.communicate(timeout=30)
    assert process.returncode == 7, output
    assert "marker=from-the-attempt" in output and "'echo', '7'" in output, output
    assert f"cwd={HERE}" in output
    assert path.exists(), "a failed attempt leaves the warm driver for the next"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"


def test_signals_reach_the_attempt_and_it_dies_with_its_process(job_env: dict[str, str]) -> None:
    tmp_path = Path(job_env["TMPDIR"])
    start_warm_driver(job_env)
    # SIGTERM (a drain, `ray job stop`): forwarded, the attempt stops cleanly.
    pidfile = tmp_path / "first.pid"
    process = attempt(job_env, "wait", str(pidfile))
    wait_for(pidfile.exists, 30, "the first attempt")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 4
    # SIGKILL of the attempt's process: the forked attempt goes too, never outliving it.
    pidfile = tmp_path / "second.pid"
    process = attempt(job_env, "wait", str(pidfile))
    wait_for(lambda: pidfile.exists() and bool(pidfile.read_text()), 30, "the second attempt")
    child = int(pidfile.read_text())
    process.kill()
    process.wait(timeout=30)
    wait_for(lambda: not alive(child), 10, "the forked attempt killed")


def test_an_attempt_dies_with_its_process_killed_before_it_read_the_childs_pid(
    job_env: dict[str, str],
) -> None:
    """The entrypoint killed between the fork and reading the child's pid (a loaded node):
    its end resets the connection instead of closing it, and the child still goes."""
    pidfile = Path(job_env["TMPDIR"]) / "unread.pid"
    conn = warmstart._connect(start_warm_driver(job_env))
    request = {"argv": ["train", "wait", str(pidfile)], "env": job_env, "cwd": str(HERE)}
    with Path(os.devnull).open("r+b") as null:
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [null.fileno()] * 3)
    wait_for(lambda: pidfile.exists() and bool(pidfile.read_text()), 30, "the attempt")
    child = int(pidfile.read_text())
    wait_for(lambda: select.select([conn], [], [], 0)[0], 10, "the pid line, left unread")
    conn.close()  # what the kernel does to a killed process's socket
    wait_for(lambda: not alive(child), 10, "the forked attempt killed")


def test_an_attempt_that_ends_the_job_ends_the_warm_driver(job_env: dict[str, str]) -> None:
    path = start_warm_driver(job_env)
    process = attempt(job_env, "echo", "0")
    assert process.wait(timeout=30) == 0
    wait_for(lambda: not path.exists(), 10, "the warm driver gone with the job")
    assert warmstart.delegate(["train"], job_env) is None


def test_one_warm_driver_per_job_and_cluster(job_env: dict[str, str]) -> None:
    path = start_warm_driver(job_env)
    warmstart.start(job_env, target="warm_target:main", modules=())  # already there: no second
    other = warmstart.socket_path({**job_env, warmstart.ENV_RAY_ADDRESS: "10.0.0.1:6379"})
    assert other != warmstart.socket_path(job_env) and other.parent == path.parent


def test_a_dead_warm_drivers_socket_neither_hangs_nor_blocks_the_next(
    job_env: dict[str, str],
) -> None:
    path = warmstart.socket_path(job_env)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))  # bound, never listening: what a killed warm driver leaves
    assert warmstart.delegate(["train"], job_env) is None
    assert not path.exists()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))
    assert start_warm_driver(job_env) == path  # started over the dead one's socket
    process = attempt(job_env, "echo", "5")
    assert process.wait(timeout=30) == 5


def test_an_attempt_dies_with_its_warm_driver_and_its_entrypoint_fails(
    job_env: dict[str, str],
) -> None:
    tmp_path = Path(job_env["TMPDIR"])
    path = start_warm_driver(job_env)
    pidfile = tmp_path / "attempt.pid"
    process = attempt(job_env, "wait", str(pidfile))
    wait_for(lambda: pidfile.exists() and bool(pidfile.read_text()), 30, "the attempt")
    child = int(pidfile.read_text())
    os.kill(parent_of(child), signal.SIGKILL)  # the warm driver
    assert process.wait(timeout=30) == 1, "an attempt lost with its warm driver failed"
    wait_for(lambda: not alive(child), 10, "the attempt gone with the warm driver")
    assert warmstart.delegate(["train"], job_env) is None and not path.exists()


def parent_of(pid: int) -> int:
    """From /proc (the state's next field is the parent's pid)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
