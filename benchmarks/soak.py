"""A tiny job trained for hours under periodic faults: nothing lost, nothing leaking.

    python benchmarks/soak.py [--minutes 120] [--fault-interval 10] [--out FILE]   # task soak

The soak itself, its faults and its figures are `rlhf_local.soak` (the e2e tier runs a
10-minute variant of it); this file runs one with an operator of its own in a namespace of its
own and writes `benchmarks/results/soak.json`. Run a long soak from a clone you do not edit
meanwhile: the job's restarts import the checkout again.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path

from rlhf_local import soak
from rlhf_local.session import operator_session

RESULTS = Path(__file__).resolve().parent / "results" / "soak.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=120)
    parser.add_argument("--fault-interval", type=float, default=10, help="minutes")
    parser.add_argument("--faults", default=",".join(soak.FAULTS), help="in turn, comma-separated")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    # SIGTERM ends the soak as Ctrl-C does: the session's cleanup stops its operator (an
    # orphaned one, of older code, kept reconciling every job after a killed soak).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        plan = soak.Plan(
            args.minutes, args.fault_interval, tuple(f for f in args.faults.split(",") if f)
        )
    except ValueError as error:
        parser.error(str(error))
    with operator_session("soak", say=soak.say) as session:
        figures = soak.run(session, plan)
    result = {
        "benchmark": "soak",
        "command": f"python benchmarks/soak.py --minutes {args.minutes:g} "
        f"--fault-interval {args.fault_interval:g}",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": "2 cores, 24 GiB; local control plane, KWOK nodes, stand-in Ray",
        "job": f"rlhf_local.faults.fault_job: 1 trainer rank, 2 rollout engines, a checkpoint "
        f"every {soak.CHECKPOINT_INTERVAL} steps",
        **figures,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    summary = {
        k: v for k, v in result.items() if k not in ("samples", "faults", "trainer_segments")
    }
    print(json.dumps(summary, indent=1))
    return 0 if result["faults_recovered"] == result["faults_injected"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
