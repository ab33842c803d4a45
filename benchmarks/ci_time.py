"""How long CI takes: `.ci/run` on clean clones of one commit, cold and warm, and how often green.

    python3 benchmarks/ci_time.py --cold            # one clone, every cache empty
    python3 benchmarks/ci_time.py --warm --runs 3   # clones using this machine's caches

Each run clones the commit (HEAD unless ``--commit``) into a fresh directory and runs
``bash .ci/run`` there with ``CI=true`` and no standard input, as CI does. A cold run also gets
a home directory of its own, so Go's module and build caches, uv's and pip's caches, npm's and
the control plane's binary cache (``~/.cache/rlhfjob``) all start empty, and Inductor's kernel
cache (under /tmp, not the home) is a new directory. The per-tier minutes
come from the run's ``.local/ci-tiers.json`` (`rlhf_local/tiers.py`); failed tests from
pytest's ``FAILED``/``ERROR`` lines.

Runs accumulate in ``benchmarks/results/ci-time.json`` while the commit stays the same (a new
commit starts the list again; the older commit's runs stay under ``earlier_runs``):
``cold_minutes`` and ``warm_minutes`` are the newest of each, ``consecutive_green_runs`` the
green runs since the last red one, ``flaky_tests`` every test that failed in some run of a
commit whose other runs passed it. Machine-readable on stdout too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "ci-time.json"
LIMIT_MINUTES = 90
GOAL = {"cold_minutes": 45, "warm_minutes": 30}
FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+::\S+)", re.MULTILINE)
#: Variables that point a tool at a cache; a cold run drops them and gets a new HOME instead.
CACHE_VARIABLES = ("GOPATH", "GOCACHE", "GOMODCACHE", "UV_CACHE_DIR", "PIP_CACHE_DIR",
                   "XDG_CACHE_HOME", "RLHF_CACHE_DIR", "npm_config_cache")  # fmt: skip


def commit_of(ref: str) -> str:
    out = subprocess.run(["git", "rev-parse", ref], cwd=REPO, check=True, capture_output=True)
    return out.stdout.decode().strip()


def environment(cold: bool, scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    env["CI"] = "true"
    if cold:
        for name in CACHE_VARIABLES:
            env.pop(name, None)
        home = scratch / "home"
        home.mkdir()
        env["HOME"] = str(home)
        # Inductor's compiled kernels live under /tmp/torchinductor_<user>, not the home.
        env["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor")
    return env


def one_run(commit: str, cold: bool, keep: bool) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix=f"ci-{'cold' if cold else 'warm'}-"))
    clone = scratch / "repo"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "checkout", "-q", commit], cwd=clone, check=True)
    log = scratch / "ci.log"
    print(f"[ci-time] {'cold' if cold else 'warm'} run of {commit[:10]} in {clone}; log {log}",
          file=sys.stderr, flush=True)  # fmt: skip
    started = time.monotonic()
    with log.open("w") as out:
        code = subprocess.run(["bash", ".ci/run"], cwd=clone, stdin=subprocess.DEVNULL,
                              stdout=out, stderr=subprocess.STDOUT,
                              env=environment(cold, scratch)).returncode  # fmt: skip
    minutes = (time.monotonic() - started) / 60
    text = log.read_text(errors="replace")
    tiers_file = clone / ".local" / "ci-tiers.json"
    tiers = json.loads(tiers_file.read_text()) if tiers_file.exists() else {"tiers": []}
    result = {
        "kind": "cold" if cold else "warm",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "minutes": round(minutes, 1),
        "green": code == 0,
        "exit_code": code,
        "tier_minutes": {t["name"]: round((t["seconds"] or 0) / 60, 1) for t in tiers["tiers"]},
        "tests": {t["name"]: t["summary"] for t in tiers["tiers"] if t.get("summary")},
        "failed_tests": sorted(set(FAILED.findall(text))),
    }
    if keep or code != 0:  # a red run's clone and log stay, to read why
        print(f"[ci-time] kept {scratch} (log: {log})", file=sys.stderr, flush=True)
    else:
        subprocess.run(["bash", "-c", "cd repo && .venv/bin/python -m rlhf_local down"],
                       cwd=scratch, capture_output=True, check=False)  # fmt: skip
        shutil.rmtree(scratch, ignore_errors=True)
    return result


def summarise(
    commit: str, runs: list[dict[str, Any]], earlier: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    def newest(kind: str) -> float | None:
        return next((r["minutes"] for r in reversed(runs) if r["kind"] == kind), None)

    green = 0
    for run in reversed(runs):
        if not run["green"]:
            break
        green += 1
    failed = {name for run in runs for name in run["failed_tests"]}
    passed_elsewhere = [r for r in runs if r["green"]]
    flaky = sorted(failed) if passed_elsewhere else []
    return {
        "benchmark": "ci-time",
        "command": "python3 benchmarks/ci_time.py --cold; python3 benchmarks/ci_time.py --warm "
        "--runs 3",
        "machine": f"{os.cpu_count()} cores; clean clones of the commit, .ci/run as CI runs it",
        "commit": commit,
        "date": runs[-1]["date"],
        "limit_minutes": LIMIT_MINUTES,
        "goal": GOAL,
        "cold_minutes": newest("cold"),
        "warm_minutes": newest("warm"),
        "consecutive_green_runs": green,
        "flaky_tests": len(flaky),
        "flaky_test_names": flaky,
        "runs": runs,
        "earlier_runs": earlier or [],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    kind = parser.add_mutually_exclusive_group(required=True)
    kind.add_argument("--cold", action="store_true", help="empty caches (a new HOME)")
    kind.add_argument("--warm", action="store_true", help="this machine's caches")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--commit", default="HEAD")
    parser.add_argument("--keep", action="store_true", help="keep green runs' clones and logs too")
    args = parser.parse_args()
    commit = commit_of(args.commit)
    previous = json.loads(RESULT.read_text()) if RESULT.exists() else {}
    same = previous.get("commit") == commit
    runs = previous.get("runs", []) if same else []
    earlier = previous.get("earlier_runs", [])
    if not same:  # the older commit's runs stay on record, the newest ten
        earlier = [
            *earlier,
            *({**r, "commit": previous["commit"]} for r in previous.get("runs", [])),
        ]
    for _ in range(args.runs):
        runs.append(one_run(commit, args.cold, args.keep))
        summary = summarise(commit, runs, earlier[-10:])
        RESULT.write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps({k: v for k, v in summary.items() if k != "runs"}), flush=True)
    return 0 if all(r["green"] for r in runs[-args.runs :]) else 1


if __name__ == "__main__":
    sys.exit(main())
