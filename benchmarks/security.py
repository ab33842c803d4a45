"""Every attack the tests try, run once, and what blocked each: `benchmarks/results/security.json`.

    python benchmarks/security.py          # task bench:security (starts the local cluster)

Runs the tests marked `attack(what, blocked_by)` (`-m attack`) among `TESTS` (the unit tier's
`tests/security/`, `tests/sandbox/` and marked unit tests; the e2e attacks on the admission
policy, the CRD, the operator's ownership checks and its RBAC, against the real API server and
operator) with the `rlhf_local.attack_report` plugin, then groups the outcomes by attack: an
attack is blocked when every test that tries it passed, and `blocked_by` lists each layer that
stopped it. The token auth attack (a running job's head) is tried by the e2e tier's training
test, not here. Machine-readable on stdout too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "security.json"
TESTS = [
    "tests/security",
    "tests/sandbox",
    "tests/operator/test_network.py",
    "tests/operator/test_views.py",
    "tests/operator/test_reconciler.py",
    "tests/trainer/test_checkpoint.py",
    "e2e/tests/test_attacks.py",
    "e2e/tests/test_security.py",
    "e2e/tests/test_operator_power.py",
    "e2e/tests/test_hostile_dashboard.py",
    "e2e/tests/test_api_validation.py",
    "e2e/tests/test_netpol_packets.py",
]
"""Where the attack tests are; the token auth test (`e2e/tests/test_operator.py`) trains a job
for minutes, so the e2e tier alone runs it."""
MIN_ATTACKS = 20


def group(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per attack: the layers that blocked it, its tests, blocked if all passed."""
    attacks: dict[str, dict[str, Any]] = {}
    for result in results:
        entry = attacks.setdefault(
            result["attack"], {"attack": result["attack"], "blocked_by": [], "tests": [],
                               "blocked": True}
        )  # fmt: skip
        if result["blocked_by"] not in entry["blocked_by"]:
            entry["blocked_by"].append(result["blocked_by"])
        entry["tests"].append(result["test"])
        entry["blocked"] = entry["blocked"] and result["blocked"]
    return list(attacks.values())


def main() -> int:
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "attacks.json"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "rlhf_local.attack_report",
                   f"--attack-report={report}", "-m", "attack", *TESTS]  # fmt: skip
        run = subprocess.run(command, cwd=REPO, check=False)
        results = json.loads(report.read_text()) if report.exists() else []
    attacks = group(results)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                            text=True, check=False).stdout.strip()  # fmt: skip
    blocked = sum(entry["blocked"] for entry in attacks)
    document = {
        "command": "python benchmarks/security.py",
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "commit": commit,
        "attacks_tried": len(attacks),
        "attacks_blocked": blocked,
        "goal": f"attacks_tried >= {MIN_ATTACKS} and attacks_blocked == attacks_tried",
        "pytest_exit_code": run.returncode,
        "attacks": [
            {key: entry[key] for key in ("attack", "blocked_by", "blocked", "tests")}
            for entry in attacks
        ],
    }
    RESULT.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(document, indent=2))
    return 0 if len(attacks) >= MIN_ATTACKS and blocked == len(attacks) else 1


if __name__ == "__main__":
    sys.exit(main())
