"""One sandbox call, in processes of its own: ``python -I -m rlhf_trainer.sandbox.worker``.

The server (`rlhf_trainer.sandbox.runner`) starts this module for every call, with an empty
environment, in a session of its own, and writes the job (the tool, its arguments, the limits,
the user to run as, the isolation plan) to its standard input. Three processes, so that the one
running the call's code holds nothing the others need:

* the **worker** (trusted, the server's user) reads the job, leaves the server's namespaces
  (network, PIDs, mounts, IPC, host name; a user namespace too when the server is not root)
  and forks the init;
* the **init** (trusted; PID 1 of the call's PID namespace) makes the call's file system
  (`jail.private_mounts`), forks the call, reaps every process until the call is done, writes
  how it ended (``{"end": ...}``) and exits: the kernel then kills whatever the call left;
* the **call** drops to the call's user with no capabilities, takes its rlimits and runs the
  tool. Its standard output and error are the call's output (the server caps it); it writes
  ``{"report": ...}`` (outcome, the tool's value, the error's last line) on a private copy of
  the worker's standard error.

Where calls have no PID namespace but a user of their own (a root server without namespaces),
the server starts this module once more after each call, with ``{"reap": uid}``: it kills every
process of that user, so nothing a call started outlives it there either.

Everything the call writes is untrusted, its report too: the server reads both bounded, and
decides timeouts and kills from what it saw itself. Standard library only (and the tools): a
call starts a Python of its own, so what this imports is paid on every call.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import traceback
from typing import Any, NoReturn

from rlhf_trainer.sandbox import jail
from rlhf_trainer.sandbox.tools import TOOLS

MAX_JOB_BYTES = 4 << 20
SETUP_FAILED = 70
"""The worker's exit status when the sandbox could not be set up (nothing of the call ran)."""
ERROR_CHARS = 500
CALL_PATH = "/usr/local/bin:/usr/bin:/bin"
PRELOADED = (
    *("array", "base64", "bisect", "cmath", "collections", "copy", "dataclasses", "datetime"),
    *("decimal", "encodings.idna", "enum", "fractions", "functools", "hashlib", "heapq", "io"),
    *("itertools", "json", "math", "numbers", "operator", "random", "re", "socket"),
    *("statistics", "string", "struct", "textwrap", "time", "typing", "unicodedata"),
)
"""Standard modules imported before the call drops its user: a call may use them even where
the interpreter's own files are not readable to that user, and does not pay for them."""


def main() -> None:
    """The worker: read the job, leave the server's namespaces, fork the init, relay its end."""
    jail.die_with_parent()
    job = json.loads(sys.stdin.buffer.read(MAX_JOB_BYTES))
    if "reap" in job:
        _reap(job["reap"], job["gid"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for name in PRELOADED:
        importlib.import_module(name)
    plan = job["plan"]
    try:
        if plan["namespaces"]:
            user = jail.CLONE_NEWUSER if plan["user_namespace"] else 0
            jail.unshare(jail.NAMESPACES | user)
            if user:
                jail.map_own_ids()
    except OSError as error:
        _setup_failed(2, error)
    init = os.fork()
    if init == 0:
        _init(job)
    _, status = os.waitpid(init, 0)
    os._exit(_exit_code(status))


def _init(job: dict[str, Any]) -> None:
    """The init: the call's file system, then the call; reap until it ends, say how, exit."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # PID 1 ignores what it does not handle
        jail.die_with_parent()
        plan, limits = job["plan"], job["limits"]
        readonly = False
        if plan["namespaces"]:
            uid, gid = (
                (job["uid"], job["gid"]) if plan["drop_uid"] else (os.geteuid(), os.getegid())
            )
            readonly = jail.private_mounts(
                job["workdir"], limits["max_file_bytes"], uid, gid, job["hide"]
            )
    except OSError as error:
        _setup_failed(2, error)
    call = os.fork()
    if call == 0:
        _call(job)
    while True:  # as PID 1, the call's orphans are ours to reap too
        pid, status, usage = os.wait4(-1, 0)
        if pid == call:
            break
    code = os.waitstatus_to_exitcode(status)
    end = {
        "status": code if code >= 0 else None,
        "signal": -code if code < 0 else None,
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "readonly_root": readonly,
    }
    _write(2, {"end": end})
    os._exit(_exit_code(status))


def _reap(uid: int, gid: int) -> NoReturn:
    """End every process of a call's user (where no PID namespace ends them with the call):
    as that user, signal everyone it may signal, which is exactly its own processes; the kernel
    lets no fork slip past one such signal, and a second sweeps what was mid-fork."""
    jail.drop_privileges(uid, gid)
    for _ in range(2):
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
    os._exit(0)


def _call(job: dict[str, Any]) -> None:
    """The call: its user, limits, directory and environment; the tool; the report."""
    report = os.dup(2)  # not inherited by what the call executes
    os.dup2(1, 2)
    workdir, limits = job["workdir"], job["limits"]
    try:
        drop = job["plan"]["drop_uid"]
        jail.drop_privileges(job["uid"] if drop else None, job["gid"] if drop else None)
        jail.die_with_parent()  # after the user changed: a change of user clears it
        jail.apply_limits(limits)
        os.chdir(workdir)
    except OSError as error:
        _setup_failed(report, error)
    os.environ.clear()
    os.environ.update(PATH=CALL_PATH, HOME=workdir, TMPDIR="/tmp", LANG="C.UTF-8")
    sys.stderr = sys.stdout
    me = os.getpid()
    result = _run(job["tool"], job["arguments"], limits)
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    if os.getpid() != me:  # a process the code forked came back here: it reports nothing
        os._exit(0)
    _write(report, {"report": result})
    os._exit(0)


def _run(name: str, arguments: dict[str, Any], limits: dict[str, int]) -> dict[str, str]:
    """Run the tool; how it ended as the report's fields (outcome, value, error)."""
    try:
        value = TOOLS[name].function(**arguments)
    except MemoryError:
        return {"outcome": "killed", "error": f"memory limit ({limits['memory_bytes'] >> 20} MiB)"}
    except SystemExit as stop:
        if stop.code in (None, 0):
            return {"outcome": "ok", "value": ""}
        return {"outcome": "error", "error": f"SystemExit: {stop.code}"[:ERROR_CHARS]}
    except BaseException as error:
        return {"outcome": "error", "error": last_line(error)}
    text = "" if value is None else str(value)
    if len(text.encode()) > limits["max_output_bytes"]:
        cut = text.encode()[: limits["max_output_bytes"]].decode(errors="ignore")
        return {"outcome": "output_limit", "value": cut, "error": "the result is too long"}
    return {"outcome": "ok", "value": text}


def last_line(error: BaseException) -> str:
    """An exception as the model reads it: ``ZeroDivisionError: division by zero``."""
    try:
        lines = traceback.format_exception_only(type(error), error)
        return lines[-1].strip()[:ERROR_CHARS]
    except Exception:
        return type(error).__name__


def _write(fd: int, record: dict[str, Any]) -> None:
    data = (json.dumps(record) + "\n").encode()
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        pass


def _setup_failed(fd: int, error: OSError) -> NoReturn:
    _write(fd, {"setup_error": str(error)[:ERROR_CHARS]})
    os._exit(SETUP_FAILED)


def _exit_code(status: int) -> int:
    """A child's wait status as an exit status: its own, or 128 + the signal that killed it."""
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    main()
