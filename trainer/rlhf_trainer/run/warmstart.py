"""A warm driver for in-place restarts: the next attempt forks a process that has imported
everything already.

An in-place restart (a killed or hung driver, the operator resubmitting `rlhfjob train` on the
same RayCluster) spent most of its seconds importing: torch, Ray, the trainer and the API's
models, about 3.3 s of the 6.7 s from the fault to the next trained step on two cores
(`benchmarks/results/recovery.json`). So a driver that starts cold also starts a *warm driver*
beside it, in a session of its own (so that stopping this attempt's Ray job leaves it): a
process that imports those modules and waits on a Unix socket private to the job. The next
attempt's `rlhfjob train` (`delegate`, which imports only the standard library) connects,
hands over its arguments, environment, working directory and standard streams, and the warm
driver forks a child that runs the attempt as the attempt's own process would. The attempt's
process stays the Ray job's entrypoint: it forwards SIGTERM and SIGINT to the child and exits
with the child's code; if it dies (SIGKILL, `ray job stop` escalating), the warm driver kills
the child at once, so an attempt never outlives its entrypoint. The child is the job's Ray
driver (`driver_info.pid`), so a fault aimed at the driver strikes it.

The warm driver exits when an attempt ends the job (succeeded, or failed for good), when the
Ray cluster it served is gone, or after `IDLE_EXIT_S` without an attempt. It is used under the
operator only (`$RLHF_JOB_NAME` set) unless `$RLHF_WARM_RESTART=0`; a local `rlhfjob train`
runs as before. Anything wrong with it (no socket, no answer, a refused hand-over) means the
attempt runs in its own process, as without it.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ENV_WARM_RESTART = "RLHF_WARM_RESTART"
"""``0`` turns the warm driver off (it is on under the operator, off elsewhere)."""
ENV_WARM_ATTEMPT = "RLHF_WARM_ATTEMPT"
"""Set in an attempt the warm driver forked: it neither hands over nor starts another."""
ENV_JOB_NAME = "RLHF_JOB_NAME"  # rlhfjob.contract.PodEnv's; not imported: this module is light
ENV_JOB_NAMESPACE = "RLHF_JOB_NAMESPACE"
ENV_JOB_CONFIG = "RLHF_JOB_CONFIG"
ENV_RAY_ADDRESS = "RAY_ADDRESS"

JOB_ENDED_CODES = (0, 3)
"""Exit codes after which no attempt follows (rlhf_trainer.run.driver.ExitCode: succeeded,
non-retryable): the warm driver exits with the attempt."""
IDLE_EXIT_S = 6 * 3600.0
CLUSTER_CHECK_S = 10.0
CONNECT_TIMEOUT_S = 2.0
START_TIMEOUT_S = 120.0
WARM_MODULES = (
    "torch",
    "ray",
    "rlhfjob.config",
    "rlhf_trainer.run.driver",
    "rlhf_trainer.run.loop",
)
"""What a warm driver imports before it listens: what a cold attempt spent its seconds on."""
DEFAULT_TARGET = "rlhfjob_cli:main"


def enabled(environ: Mapping[str, str]) -> bool:
    """Whether this attempt uses (or starts) a warm driver: under the operator, unless off, and
    not in an attempt a warm driver forked."""
    return (
        bool(environ.get(ENV_JOB_NAME))
        and _gcs_address(environ.get(ENV_RAY_ADDRESS)) is not None
        and environ.get(ENV_WARM_RESTART, "1") != "0"
        and not environ.get(ENV_WARM_ATTEMPT)
    )


def _gcs_address(address: str | None) -> tuple[str, int] | None:
    """The Ray cluster's GCS as (host, port) from ``$RAY_ADDRESS`` (what a Ray job's
    entrypoint gets); None for anything else, where no warm driver is used: it would not know
    when its cluster is gone."""
    if not address or "://" in address or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    return (host, int(port)) if port.isdigit() else None


def socket_path(environ: Mapping[str, str]) -> Path:
    """The job's socket: one per job and Ray cluster, in a directory only this user reads."""
    key = "/".join(
        environ.get(name, "") for name in (ENV_JOB_NAMESPACE, ENV_JOB_NAME, ENV_RAY_ADDRESS)
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"rlhfjob-warm-{os.getuid()}" / f"{digest}.sock"


# --------------------------------------------------------------------------------------------
# The attempt's side


def delegate(argv: list[str], environ: Mapping[str, str] | None = None) -> int | None:
    """Run this attempt in a fork of the job's warm driver and return its exit code; None when
    there is none to use (the caller then runs the attempt itself)."""
    environ = os.environ if environ is None else environ
    if not enabled(environ):
        return None
    path = socket_path(environ)
    if not path.exists():
        return None
    try:
        conn = _connect(path)
    except OSError as error:
        if isinstance(error, ConnectionRefusedError | FileNotFoundError):
            with contextlib.suppress(OSError):
                path.unlink()  # left by a warm driver that died: the next attempt starts one
        return None
    # Handed over from here on: never run the attempt here too, whatever happens (a second
    # driver). Without an answer the attempt failed, and the operator starts the next.
    conn.settimeout(None)
    child: list[int] = []
    pending: list[int] = []  # signals that came before the child's pid

    def forward(signum: int, _frame: Any) -> None:
        if not child:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(child[0], signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    reader = conn.makefile("rb")
    try:
        request = {"argv": argv, "env": dict(environ), "cwd": str(Path.cwd())}
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        first = reader.readline()
    except OSError:
        first = b""
    if not first.startswith(b"pid "):
        print("rlhfjob: the job's warm driver did not start the attempt", file=sys.stderr)
        return 1
    child.append(int(first.split()[1]))
    for pending_signal in pending:
        forward(pending_signal, None)
    last = reader.readline()
    conn.close()
    if last.startswith(b"exit "):
        return int(last.split()[1])
    return 1  # the warm driver died with the attempt in it


# --------------------------------------------------------------------------------------------
# The warm driver


def start(
    environ: Mapping[str, str] | None = None,
    target: str = DEFAULT_TARGET,
    modules: tuple[str, ...] = WARM_MODULES,
) -> None:
    """Start the job's warm driver for the next attempt, unless off or one is running.
    Called by an attempt that runs itself; returns at once."""
    environ = os.environ if environ is None else environ
    if not enabled(environ):
        return
    path = socket_path(environ)
    if _answers(path) or not _claim_start(path):
        return
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a dead warm driver's
    with contextlib.suppress(OSError):
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlhf_trainer.run.warmstart",
                str(path),
                target,
                ",".join(modules),
            ],
            env=dict(environ),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not this attempt's: stopping it leaves the warm driver
        )


def stop(environ: Mapping[str, str] | None = None) -> None:
    """Ask the job's warm driver to exit (the job ended in an attempt that ran itself)."""
    environ = os.environ if environ is None else environ
    if not enabled(environ):
        return
    with contextlib.suppress(OSError), _connect(socket_path(environ)) as conn:
        conn.sendall(json.dumps({"quit": True}).encode() + b"\n")


def _connect(path: Path) -> socket.socket:
    """A connection to the warm driver listening on `path` (OSError when none answers within
    CONNECT_TIMEOUT_S)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(CONNECT_TIMEOUT_S)
        conn.connect(str(path))
    except OSError:
        conn.close()
        raise
    return conn


def _answers(path: Path) -> bool:
    """Whether a warm driver listens on `path`."""
    with contextlib.suppress(OSError), _connect(path):
        return True
    return False


def _starting(path: Path) -> Path:
    return path.with_suffix(".starting")


def _claim_start(path: Path) -> bool:
    """Whether this attempt starts the warm driver: the first to create its marker does (a
    marker older than `START_TIMEOUT_S` is from one that died importing)."""
    marker = _starting(path)
    with contextlib.suppress(FileNotFoundError):
        if time.time() - marker.stat().st_mtime > START_TIMEOUT_S:
            marker.unlink()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:
        return False
    return True


def _resolve(target: str) -> Callable[[list[str]], int]:
    module, _, name = target.partition(":")
    function: Callable[[list[str]], int] = getattr(importlib.import_module(module), name)
    return function


def _warm_up_job_models() -> None:
    """Validate the job's file once, as each attempt will: the API's CEL programs compile and
    its schemas render on first use (0.7 s on two cores), and a fork inherits them done."""
    from rlhfjob.config import load_job

    with contextlib.suppress(Exception):  # the attempt reports a bad file itself
        load_job(os.environ[ENV_JOB_CONFIG])


def _cluster_alive(address: tuple[str, int] | None) -> bool:
    """Whether the Ray cluster's GCS still accepts connections."""
    if address is None:
        return False
    with contextlib.suppress(OSError), socket.create_connection(address, timeout=2.0):
        return True
    return False


def serve(
    path: Path, target: str = DEFAULT_TARGET, modules: tuple[str, ...] = WARM_MODULES
) -> None:
    """Import `modules` and `target`, listen on `path` and run each attempt in a fork."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # its socket goes with it
    for module in modules:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    if "rlhfjob.config" in modules:
        _warm_up_job_models()
    run = _resolve(target)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    temporary = path.with_suffix(f".{os.getpid()}")
    listener.bind(str(temporary))
    temporary.chmod(0o600)
    listener.listen()
    try:
        temporary.rename(path)  # visible only once it listens
        with contextlib.suppress(FileNotFoundError):
            _starting(path).unlink()
        _serve(listener, run)
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _serve(listener: socket.socket, run: Callable[[list[str]], int]) -> None:
    ended, wake = socket.socketpair()  # an attempt that ended the job wakes the loop
    last_used = time.monotonic()
    address = _gcs_address(os.environ.get(ENV_RAY_ADDRESS))
    while True:
        ready, _, _ = select.select([listener, ended], [], [], CLUSTER_CHECK_S)
        if ended in ready:
            return
        if not ready:
            if time.monotonic() - last_used > IDLE_EXIT_S or not _cluster_alive(address):
                return
            continue
        conn, _ = listener.accept()
        last_used = time.monotonic()
        try:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
        except (OSError, ValueError):
            conn.close()
            continue
        if request.get("quit"):
            conn.close()
            return
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        server = os.getpid()
        pid = os.fork()
        if pid == 0:  # the attempt
            listener.close()
            conn.close()
            _become_attempt(request, fds, run, server)
        for fd in fds:
            os.close(fd)
        threading.Thread(target=_watch, args=(conn, pid, wake), daemon=True).start()


def _become_attempt(
    request: dict[str, Any], fds: list[int], run: Callable[[list[str]], int], server: int
) -> None:
    """In the forked child: take the attempt's streams, environment and directory, run it."""
    code = 1
    try:
        _die_with(server)
        for target_fd, fd in enumerate(fds):
            os.dup2(fd, target_fd)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[ENV_WARM_ATTEMPT] = "1"
        print(f"[warm start] this attempt is a fork of the job's warm driver (pid {os.getppid()})",
              file=sys.stderr, flush=True)  # fmt: skip
        os.chdir(request["cwd"])
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        sys.argv = ["rlhfjob", *request["argv"]]
        code = run(list(request["argv"]))
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # the attempt's own failure, reported by its code
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            atexit._run_exitfuncs()  # what the interpreter's exit would run (Ray's shutdown)
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)  # never back into the warm driver's loop


def _die_with(server: int) -> None:
    """SIGKILL this forked attempt when the warm driver (`server`, its parent) dies: with it
    goes the one process that would kill the attempt when its entrypoint dies (Linux)."""
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != server:  # it died before the call took effect
        os._exit(1)


def _watch(conn: socket.socket, pid: int, ended: socket.socket) -> None:
    """Tell the attempt's process the child's pid, then its exit code; kill the child if that
    process goes first (its connection closes)."""
    with contextlib.suppress(OSError):
        conn.sendall(f"pid {pid}\n".encode())
    status = None
    while status is None:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = raw
            break
        ready, _, _ = select.select([conn], [], [], 0.2)
        if ready and _closed(conn):  # the attempt's process is gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    code = 128 - code if code < 0 else code  # killed by a signal: as a shell reports it
    with contextlib.suppress(OSError):
        conn.sendall(f"exit {code}\n".encode())
    conn.close()
    if code in JOB_ENDED_CODES:
        ended.send(b"x")


def _closed(conn: socket.socket) -> bool:
    """Whether the attempt's process closed its end. One that died before it read the "pid"
    line resets the connection instead (a Unix socket closed with unread data): gone too."""
    try:
        return not conn.recv(1)
    except OSError:
        return True


if __name__ == "__main__":
    _, socket_arg, target_arg, modules_arg = sys.argv
    serve(Path(socket_arg), target_arg, tuple(filter(None, modules_arg.split(","))))
