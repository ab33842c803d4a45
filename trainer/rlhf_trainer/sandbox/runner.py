"""The server's side of one call: start a worker, watch it, and say how the call ended.

Every call is a fresh ``python -I -m rlhf_trainer.sandbox.worker`` (`worker`'s docstring: its
three processes), started with an empty environment and no descriptor but its pipes, in a
session of its own. This side holds the limits the call cannot touch: the wall clock (the
worker's whole process group is killed when it runs out), the output cap (the same, at the
first byte past it), and the working directory it makes before and removes after. What the call
reports is untrusted and read bounded; a timeout or a kill is what this side saw, not what the
call said.

A `Plan` is how calls are isolated: the server finds the strongest one that works on its pod
once, at start (`probe`, over `plans`), and sends it with every call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_trainer.sandbox.worker import SETUP_FAILED
from rlhfjob.contract.sandbox import Outcome, SandboxIsolation, SandboxLimits, ToolResult

LOG = logging.getLogger(__name__)
WORKER = [sys.executable, "-I", "-X", "utf8", "-m", "rlhf_trainer.sandbox.worker"]
READ_CHUNK = 64 << 10
DRAIN_SECONDS = 2.0
"""How long the pipes may stay open after the worker exits (a process of the call that left
its group, where there is no PID namespace to end it): past this the call is over anyway."""
REAP_SECONDS = 10.0
REPORT_TAIL = 64 << 10
"""The end of the worker's report stream kept beyond the output's size: the records are last."""


@dataclass(frozen=True)
class Plan:
    """How calls are isolated on this server (the worker's ``plan``)."""

    namespaces: bool
    user_namespace: bool
    drop_uid: bool

    def as_job(self) -> dict[str, bool]:
        return {
            "namespaces": self.namespaces,
            "user_namespace": self.user_namespace,
            "drop_uid": self.drop_uid,
        }


def plans(choice: str, root: bool) -> list[Plan]:
    """The plans to try, strongest first: as root, namespaces and a user per slot, then a user
    per slot alone; as anyone else, namespaces inside a user namespace; then nothing but
    rlimits. ``choice`` (the server's ``--isolation``) may ask for one of them."""
    full = Plan(namespaces=True, user_namespace=not root, drop_uid=root)
    bare = Plan(namespaces=False, user_namespace=False, drop_uid=root)
    if choice == "namespaces":
        return [full]
    if choice == "none":
        return [bare]
    return [full, bare]


@dataclass(frozen=True)
class Slot:
    """One of the server's concurrent calls: its index, and the user its calls run as (as
    root: ``--run-as`` + index, so a call's processes count against its own RLIMIT_NPROC and
    no two calls can signal each other)."""

    index: int
    uid: int
    gid: int


@dataclass
class Runner:
    """Runs calls under `limits` with `plan`, in working directories under `work_root`."""

    limits: SandboxLimits
    plan: Plan
    work_root: str
    hide: tuple[str, ...] = ()
    """Paths a call must not read (the token file), covered where calls have their own mounts."""

    async def run(self, tool: str, arguments: dict[str, Any], wall: float, slot: Slot) -> Run:
        """One call, from the worker's start to its directory's removal."""
        workdir = tempfile.mkdtemp(prefix=f"call-{slot.index}-", dir=self.work_root)
        try:
            if self.plan.drop_uid:
                os.chown(workdir, slot.uid, slot.gid)
            job = {
                "tool": tool,
                "arguments": arguments,
                "plan": self.plan.as_job(),
                "uid": slot.uid,
                "gid": slot.gid,
                "workdir": workdir,
                "hide": list(self.hide),
                "limits": self.limits.model_dump(),
            }
            reap = None
            if self.plan.drop_uid and not self.plan.namespaces:  # no PID namespace ends them
                reap = json.dumps({"reap": slot.uid, "gid": slot.gid}).encode()
            return await self._watch(json.dumps(job).encode(), wall, reap)
        finally:
            await asyncio.to_thread(remove_tree, workdir)

    async def _watch(self, job: bytes, wall: float, reap: bytes | None = None) -> Run:
        """Start the worker, feed it the job, and watch it until it exits or the wall runs out;
        then end what the call left (its group; with `reap`, every process of its user). The
        pipes are this side's own, not asyncio's: the call is over when its worker exits,
        whoever still holds a pipe (asyncio's `wait` would wait for the pipes too)."""
        run = Run(wall=wall, limits=self.limits)
        job_read, job_write = os.pipe()
        out_read, out_write = os.pipe()
        report_read, report_write = os.pipe()
        started = time.monotonic()
        try:
            process = await asyncio.create_subprocess_exec(
                *WORKER,
                stdin=job_read,
                stdout=out_write,
                stderr=report_write,
                env={},
                cwd="/",
                start_new_session=True,
            )
        except BaseException:
            for fd in (job_write, out_read, report_read):
                os.close(fd)
            raise
        finally:
            for fd in (job_read, out_write, report_write):
                os.close(fd)
        feeding = asyncio.create_task(asyncio.to_thread(_write_all, job_write, job))
        output, output_pipe = await _reader(out_read)
        reports, report_pipe = await _reader(report_read)
        readers = [
            asyncio.create_task(run.read_output(output, process.pid)),
            asyncio.create_task(run.read_reports(reports)),
        ]
        try:
            try:
                await asyncio.wait_for(process.wait(), timeout=wall)
            except TimeoutError:
                run.stopped = run.stopped or "timeout"
            run.seconds = time.monotonic() - started
            kill_group(process.pid)  # a timeout's, or what the call left in its group
            await process.wait()
            if reap is not None:
                await self._watch(reap, REAP_SECONDS)
            await asyncio.wait(readers, timeout=DRAIN_SECONDS)
        finally:
            kill_group(process.pid)
            for reader in readers:
                reader.cancel()
            output_pipe.close()
            report_pipe.close()
            if process.returncode is None:
                await process.wait()
            await feeding  # done: its reader is gone
        run.returncode = process.returncode
        return run


def _write_all(fd: int, data: bytes) -> None:
    """The job into the worker's standard input, then EOF; a worker gone early is no error."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        pass
    finally:
        os.close(fd)


async def _reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    """A stream over a pipe's read end, and its transport (closing it closes the pipe)."""
    stream = asyncio.StreamReader(limit=READ_CHUNK)
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(stream), os.fdopen(fd, "rb", buffering=0)
    )
    return stream, transport


@dataclass
class Run:
    """What the server saw of one call, and the `ToolResult` it makes of that."""

    wall: float
    limits: SandboxLimits
    output: bytes = b""
    reports: bytes = b""
    stopped: str = ""
    """Why the server killed the call: "timeout" or "output_limit"; empty if it did not."""
    seconds: float = 0.0
    returncode: int | None = None

    async def read_output(self, stream: asyncio.StreamReader, group: int) -> None:
        """Keep the output up to the cap; at the first byte past it, kill the call."""
        cap = self.limits.max_output_bytes
        kept = bytearray()
        while chunk := await stream.read(READ_CHUNK):
            kept += chunk
            if len(kept) > cap:
                self.stopped = self.stopped or "output_limit"
                kill_group(group)
                del kept[cap:]
                break
        self.output = bytes(kept)

    async def read_reports(self, stream: asyncio.StreamReader) -> None:
        """The report stream, read to its end (a writer must never block on it), its tail kept."""
        keep = 4 * self.limits.max_output_bytes + REPORT_TAIL
        kept = bytearray()
        while chunk := await stream.read(READ_CHUNK):
            kept += chunk
            if len(kept) > keep:
                del kept[: len(kept) - keep]
        self.reports = bytes(kept)

    def records(self) -> dict[str, Any]:
        """The last record of each kind ("report", "end", "setup_error") in the stream."""
        found: dict[str, Any] = {}
        for line in self.reports.splitlines():
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # the call may write anything here
                continue
            if isinstance(record, dict) and len(record) == 1:
                found.update(record)
        return found

    def result(self, call_id: str = "") -> tuple[ToolResult, str]:
        """The call's result, and the setup failure (empty when the sandbox was set up)."""
        records = self.records()
        try:
            outcome, error = self._ending(records)
        except (TypeError, ValueError, KeyError):  # a record of the right name, the wrong shape
            outcome, error = "error", "the call's end could not be read"
        setup = str(records.get("setup_error", ""))[:500] if _setup_failed(records) else ""
        output = self.output.decode(errors="replace")
        report = records.get("report")
        if isinstance(report, dict) and isinstance(report.get("value"), str):
            room = self.limits.max_output_bytes - len(self.output)
            output += report["value"].encode()[: max(room, 0)].decode(errors="ignore")
        result = ToolResult(
            call_id=call_id, outcome=outcome, output=output, error=error, seconds=self.seconds
        )
        return result, setup

    def _ending(self, records: dict[str, Any]) -> tuple[Outcome, str]:
        """How the call ended: what the server did first, then how its process ended (the
        init's record), then what the call reported."""
        if self.stopped == "timeout":
            return "timeout", f"wall time limit ({self.wall:g} s)"
        if self.stopped == "output_limit":
            return "output_limit", f"output over {self.limits.max_output_bytes} bytes"
        if _setup_failed(records):
            return "error", "sandbox setup failed"
        end = records.get("end")
        if not isinstance(end, dict):
            return "error", f"the sandbox's worker failed (exit status {self.returncode})"
        if end.get("signal"):
            return _signalled(int(end["signal"]), float(end.get("cpu_seconds") or 0), self.limits)
        report = records.get("report")
        if isinstance(report, dict) and report.get("outcome") in _OUTCOMES:
            return report["outcome"], str(report.get("error", ""))[:500]
        if end.get("status"):
            return "error", f"exited with status {int(end['status'])}"
        return "error", "the call ended without a result"


_OUTCOMES = ("ok", "error", "timeout", "killed", "output_limit")


def _setup_failed(records: dict[str, Any]) -> bool:
    """Whether the worker said its setup failed (before the call's code ran), and ended so."""
    end = records.get("end")
    ended = not isinstance(end, dict) or end.get("status") == SETUP_FAILED
    return "setup_error" in records and ended


def _signalled(number: int, cpu_seconds: float, limits: SandboxLimits) -> tuple[Outcome, str]:
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    cpu_out = cpu_seconds >= limits.cpu_seconds
    if number == signal.SIGXCPU or (number == signal.SIGKILL and cpu_out):
        return "timeout", f"CPU time limit ({limits.cpu_seconds} s)"
    if number == signal.SIGKILL:
        return "killed", f"killed: {name} (memory or process limits)"
    return "killed", f"killed: {name}"


def kill_group(group: int) -> None:
    """SIGKILL a call's whole process group (its worker's session); gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


def remove_tree(path: str) -> None:
    """Remove a call's directory whatever the call did to its modes (as the server's user)."""

    def retry(function: Any, failed: str, _: Any) -> None:
        with contextlib.suppress(OSError):
            Path(failed).parent.chmod(0o700)
            Path(failed).chmod(0o700)
        with contextlib.suppress(OSError):
            function(failed)

    shutil.rmtree(path, onerror=retry)


PROBE_TOOL, PROBE_ARGUMENTS, PROBE_ANSWER = "calculator", {"expression": "6 * 7"}, "42"


async def probe(
    limits: SandboxLimits, candidates: list[Plan], work_root: str, hide: tuple[str, ...], slot: Slot
) -> tuple[Runner, SandboxIsolation]:
    """The first plan under which a real call works, and what it isolates; none working is a
    server that cannot run calls at all (RuntimeError)."""
    problems = []
    for plan in candidates:
        runner = Runner(limits=limits, plan=plan, work_root=work_root, hide=hide)
        run = await runner.run(PROBE_TOOL, PROBE_ARGUMENTS, limits.wall_seconds, slot)
        result, setup = run.result()
        if result.ok and result.output == PROBE_ANSWER:
            readonly = bool(run.records()["end"].get("readonly_root"))
            return runner, SandboxIsolation(
                network=plan.namespaces,
                pids=plan.namespaces,
                mounts=plan.namespaces,
                readonly_root=plan.namespaces and readonly,
                uid=plan.drop_uid,
            )
        problems.append(f"{plan}: {setup or result.error}")
    raise RuntimeError("no sandbox plan works here: " + "; ".join(problems))
