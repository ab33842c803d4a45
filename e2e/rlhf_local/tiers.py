"""`task test`: every tier CI runs, then a table of how long each took.

Standard library only, run as ``python3 e2e/rlhf_local/tiers.py``: its first tier creates the
venv the others run in, so it cannot need that venv itself. The control-plane build starts in
the background before lint (prefetch, then a cold compile) and the ``build`` tier is only what
is left of it when lint ends. The unit tier runs beside the build and the e2e tier, at the
lowest CPU priority (`lowest_priority`): the e2e tier waits on its clusters for about 40 % of
its time, and the unit tier, CPU-bound throughout, fills those idle cycles instead of running
after it. The table also goes to ``.local/ci-tiers.json``, which `benchmarks/ci_time.py`
collects from clean-clone runs::

    python3 e2e/rlhf_local/tiers.py [-- PYTEST ARGS FOR THE UNIT TIER]
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PY = ".venv/bin/python"
RESULT = REPO / ".local" / "ci-tiers.json"
#: pytest's closing line: "=== 1215 passed, 3 skipped in 774.12s (0:12:54) ===".
SUMMARY = re.compile(r"^=+ (.*\d+ (?:passed|failed|error).*) in [\d.]+s")
#: pytest-xdist's workers for the unit tier: one per core, at most 4 (each training test starts
#: a Ray of several processes). On 2 cores this took the tier from 17.3 to 13.7 minutes: the
#: quick tests run one process each, so one core idled through them. One test at a time from a
#: shared queue (xdist otherwise hands each worker a block of consecutive tests up front): the
#: slow ones, first in the queue (`tests/conftest.py`), spread over the workers, and the quick
#: ones fill the end.
UNIT_WORKERS = ["--numprocesses=auto", "--maxprocesses=4", "--maxschedchunk=1"]


@dataclass
class Tier:
    name: str
    argv: list[str]
    #: Runs beside the tiers after it, at the lowest priority, its output in `log` (printed
    #: whole when it ends) so that the foreground tier's output stays readable.
    background: bool = False
    seconds: float | None = None
    exit_code: int | None = None
    #: pytest's closing counts, for the tiers that run pytest.
    summary: str | None = None
    log_dir: Path = REPO / ".local"

    @property
    def log(self) -> Path:
        return self.log_dir / f"tier-{self.name}.log"


@dataclass
class Run:
    tiers: list[Tier]
    started: float = field(default_factory=time.time)
    clock: float = field(default_factory=time.monotonic)

    @property
    def passed(self) -> bool:
        return all(t.exit_code == 0 for t in self.tiers)

    @property
    def seconds(self) -> float:
        """Wall time from the first tier's start: background tiers overlap the others."""
        return time.monotonic() - self.clock


def tiers(unit_args: list[str]) -> list[Tier]:
    """The tiers in order: what CI runs is exactly this list."""
    return [
        Tier("setup", ["task", "setup"]),
        Tier("tools", [PY, "-m", "rlhf_local.build", "--tools"]),
        Tier("lint", ["task", "lint"]),
        Tier(
            "unit",
            [".venv/bin/pytest", "tests", *UNIT_WORKERS, "--durations=15", *unit_args],
            background=True,
        ),
        Tier("build", [PY, "-m", "rlhf_local.build", "--wait"]),
        Tier("e2e", ["task", "e2e"]),
    ]


def run_tier(tier: Tier) -> None:
    """Run one tier with its output passed through; record its time, status and counts."""
    print(f"\n[tiers] {tier.name}: {' '.join(tier.argv)}", flush=True)
    t0 = time.monotonic()
    with subprocess.Popen(
        tier.argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            read_summary(tier, line)
    tier.exit_code = proc.returncode
    tier.seconds = time.monotonic() - t0


def read_summary(tier: Tier, line: str) -> None:
    if match := SUMMARY.match(line.strip()):
        tier.summary = match.group(1)


def lowest_priority() -> None:
    """In a background tier's process, before it starts: nice 19 for it and every process it
    starts (the I/O priority follows), and the same for its session's autogroup. Linux shares
    the CPU fairly between sessions (autogroups) whatever their processes' nice values, so
    without the second a background tier in its own session took half the CPU from the e2e
    tier's clusters."""
    with contextlib.suppress(OSError):
        os.nice(19 - os.nice(0))
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text("19")


@dataclass
class Background:
    """A background tier under way: its process, and the thread that records when it ended."""

    tier: Tier
    proc: subprocess.Popen[bytes]
    waiter: threading.Thread


def start_background(tier: Tier) -> Background:
    """Start a background tier in a session of its own (so that it can be stopped whole); its
    time and exit code are recorded when it ends, not when it is waited for."""
    print(f"\n[tiers] {tier.name}, in the background: {' '.join(tier.argv)} > {tier.log}")
    tier.log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tier.log.open("wb") as log:
        proc = subprocess.Popen(
            tier.argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=lowest_priority,
        )  # fmt: skip

    def wait() -> None:
        tier.exit_code = proc.wait()
        tier.seconds = time.monotonic() - t0

    waiter = threading.Thread(target=wait, name=f"tier-{tier.name}", daemon=True)
    waiter.start()
    return Background(tier, proc, waiter)


def finish_background(job: Background) -> None:
    """Wait for a background tier, then pass its output through and take its counts."""
    print(f"\n[tiers] {job.tier.name}: waiting for it to end (its output follows)", flush=True)
    job.waiter.join()
    for line in job.tier.log.read_text(errors="replace").splitlines(keepends=True):
        sys.stdout.write(line)
        read_summary(job.tier, line)
    sys.stdout.flush()


def stop_background(job: Background) -> None:
    """A background tier still running when the run ends early: its whole session goes."""
    proc = job.proc
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def table(run: Run) -> str:
    rows = [f"{'tier':8} {'minutes':>8}  result"]
    for t in run.tiers:
        minutes = f"{t.seconds / 60:8.1f}" if t.seconds is not None else f"{'-':>8}"
        result = {None: "not run", 0: "ok"}.get(t.exit_code, f"exit {t.exit_code}")
        beside = " beside the tiers after it" if t.background else ""
        rows.append(
            f"{t.name:8} {minutes}  {result}{f' ({t.summary})' if t.summary else ''}{beside}"
        )
    total = run.seconds
    rows.append(f"{'total':8} {total / 60:8.1f}  {'passed' if run.passed else 'FAILED'} (wall)")
    return "\n".join(rows)


def closing_line(run: Run) -> str:
    """Every pytest tier's counts added up, as one plain last line: "tests: N passed, N failed"
    (", N skipped" when any were)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    for tier in run.tiers:
        for number, word in re.findall(
            r"(\d+) (passed|failed|skipped|errors?)", tier.summary or ""
        ):
            counts[word.rstrip("s") if word.startswith("error") else word] += int(number)
    failed = counts["failed"] + counts["error"]
    skipped = f", {counts['skipped']} skipped" if counts["skipped"] else ""
    return f"tests: {counts['passed']} passed, {failed} failed{skipped}"


def save(run: Run, path: Path = RESULT) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(run.started)),
        "passed": run.passed,
        "minutes": round(run.seconds / 60, 2),
        "tiers": [asdict(t) for t in run.tiers],
    }
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def main(argv: list[str]) -> int:
    run = Run(tiers(argv))
    background: list[Background] = []
    try:
        for tier in run.tiers:
            if tier.background:
                background.append(start_background(tier))
                continue
            run_tier(tier)
            if tier.exit_code != 0:
                break
            if tier.name == "tools":  # the build overlaps lint (and the unit tier)
                subprocess.run([PY, "-m", "rlhf_local.build", "--background"], cwd=REPO, check=True)
        for job in background:  # their results count even after a failure
            finish_background(job)
    finally:
        for job in background:
            stop_background(job)
        subprocess.run([PY, "-m", "rlhf_local.build", "--stop"], cwd=REPO, check=False)
        save(run)
        print(f"\n[tiers] time per tier (also in {RESULT.relative_to(REPO)}):\n{table(run)}")
        print(closing_line(run), flush=True)
    return 0 if run.passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
