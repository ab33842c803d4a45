"""Detached background processes tracked by pid files, safe against pid reuse.

Every process starts in its own session (so it outlives `up` and its whole process group can
be signalled), logs to one file, and is recorded as ``<pid> <start time>``: a pid file whose
process has died and whose pid was reused by something else is recognised as stale, so `down`
never signals a stranger.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path


def _start_time(pid: int) -> str | None:
    """Kernel start time of `pid` (clock ticks since boot), or None when it is gone/zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields after it are space separated.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def start(
    name: str,
    argv: Sequence[str],
    *,
    log_dir: Path,
    pid_dir: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> int:
    """Start `argv` detached, appending its output to ``<log_dir>/<name>.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    pid_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / f"{name}.log").open("ab") as log:
        log.write(f"\n==== {time.strftime('%H:%M:%S')} start {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(env) if env is not None else None,
            cwd=cwd,
        )
    (pid_dir / f"{name}.pid").write_text(f"{proc.pid} {_start_time(proc.pid)}\n")
    return proc.pid


def running(pid_file: Path) -> int | None:
    """The pid recorded in `pid_file` when that very process is still alive."""
    try:
        pid_s, started = pid_file.read_text().split()
    except (OSError, ValueError):
        return None
    pid = int(pid_s)
    return pid if _start_time(pid) == started else None


def _reap(pid: int) -> None:
    """Collect `pid` if it is our child, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _alive(pids: Iterable[int]) -> list[int]:
    left = []
    for pid in pids:
        _reap(pid)
        if _start_time(pid) is not None:
            left.append(pid)
    return left


def kill_groups(pids: Iterable[int], grace: float = 15.0) -> None:
    """SIGTERM the process groups led by `pids`, then SIGKILL whatever outlives `grace`."""
    pids = list(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _alive(pids):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError:
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _alive(pids):
            return


def terminate(process: subprocess.Popen[bytes] | None, grace: float = 30.0) -> None:
    """SIGTERM a child this process started, SIGKILL it after `grace` seconds, and reap it."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def stop(pid_file: Path, grace: float = 15.0) -> bool:
    """Stop the process group recorded in `pid_file`; True when something was running."""
    pid = running(pid_file)
    if pid is not None:
        kill_groups([pid], grace)
    pid_file.unlink(missing_ok=True)
    return pid is not None


def find_by_cmdline(needle: str) -> list[int]:
    """Pids whose command line contains `needle` (a path unique to this cluster)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline and _start_time(int(entry.name)) is not None:
            found.append(int(entry.name))
    return found


def kill_pids(pids: Iterable[int], grace: float = 5.0) -> None:
    """SIGTERM then SIGKILL individual processes (not groups): for orphan sweeps."""
    pids = list(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _alive(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _alive(pids):
            return


@contextlib.contextmanager
def file_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on `directory/.lock` (one writer across processes)."""
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def free_port() -> int:
    """A port of the loopback that no one listens on now (the kernel's choice)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
