"""`task test`: every tier CI runs, in order, then a table of how long each took.

Standard library only, run as ``python3 e2e/rlhf_local/tiers.py``: its first tier creates the
venv the others run in, so it cannot need that venv itself. The control-plane build starts in
the background before lint (prefetch, then a cold compile at nice 19, on the CPU that lint and
the unit tier leave idle) and the ``build`` tier is only what is left of it when the unit tier
ends. The container images build beside it the same way (``rlhf_local.image_checks --background``),
and the ``images`` tier waits for them and smoke-checks each. The table also goes to
``.local/ci-tiers.json``, which `benchmarks/ci_time.py` collects from clean-clone runs::

    python3 e2e/rlhf_local/tiers.py [-- PYTEST ARGS FOR THE UNIT TIER]
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
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
#: quick tests run one process each, so one core idled through them.
UNIT_WORKERS = ["--numprocesses=auto", "--maxprocesses=4"]
#: What builds in the background, at nice 19, from the end of `tools` on: the control plane's
#: binaries and the container images. Each has --background, --wait (its tier) and --stop.
BACKGROUND_BUILDS = ("rlhf_local.build", "rlhf_local.image_checks")


@dataclass
class Tier:
    name: str
    argv: list[str]
    seconds: float | None = None
    exit_code: int | None = None
    #: pytest's closing counts, for the tiers that run pytest.
    summary: str | None = None


@dataclass
class Run:
    tiers: list[Tier]
    started: float = field(default_factory=time.time)

    @property
    def passed(self) -> bool:
        return all(t.exit_code == 0 for t in self.tiers)


def tiers(unit_args: list[str]) -> list[Tier]:
    """The tiers in order: what CI runs is exactly this list."""
    return [
        Tier("setup", ["task", "setup"]),
        Tier("tools", [PY, "-m", "rlhf_local.build", "--tools"]),
        Tier("lint", ["task", "lint"]),
        Tier("unit", [".venv/bin/pytest", "tests", *UNIT_WORKERS, "--durations=15", *unit_args]),
        Tier("build", [PY, "-m", "rlhf_local.build", "--wait"]),
        Tier("images", [PY, "-m", "rlhf_local.image_checks", "--wait"]),
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
            if match := SUMMARY.match(line.strip()):
                tier.summary = match.group(1)
    tier.exit_code = proc.returncode
    tier.seconds = time.monotonic() - t0


def table(run: Run) -> str:
    rows = [f"{'tier':8} {'minutes':>8}  result"]
    for t in run.tiers:
        minutes = f"{t.seconds / 60:8.1f}" if t.seconds is not None else f"{'-':>8}"
        result = {None: "not run", 0: "ok"}.get(t.exit_code, f"exit {t.exit_code}")
        rows.append(f"{t.name:8} {minutes}  {result}{f' ({t.summary})' if t.summary else ''}")
    total = sum(t.seconds or 0 for t in run.tiers)
    rows.append(f"{'total':8} {total / 60:8.1f}  {'passed' if run.passed else 'FAILED'}")
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


def save(run: Run) -> None:
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(run.started)),
        "passed": run.passed,
        "minutes": round(sum(t.seconds or 0 for t in run.tiers) / 60, 2),
        "tiers": [asdict(t) for t in run.tiers],
    }
    RESULT.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str]) -> int:
    run = Run(tiers(argv))
    try:
        for tier in run.tiers:
            run_tier(tier)
            if tier.exit_code != 0:
                break
            if tier.name == "tools":  # the builds overlap lint and the unit tier
                for builder in BACKGROUND_BUILDS:
                    subprocess.run([PY, "-m", builder, "--background"], cwd=REPO, check=True)
    finally:
        for builder in BACKGROUND_BUILDS:
            subprocess.run([PY, "-m", builder, "--stop"], cwd=REPO, check=False)
        save(run)
        print(f"\n[tiers] time per tier (also in {RESULT.relative_to(REPO)}):\n{table(run)}")
        print(closing_line(run), flush=True)
    return 0 if run.passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
