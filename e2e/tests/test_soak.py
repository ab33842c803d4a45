"""The soak's 10-minute variant (issue 28): each fault once, two minutes apart, nothing lost.

`task soak` runs the same soak (`rlhf_local.soak`) for 2 hours with a fault every 10 minutes;
here every kind strikes once, in turn, starting half a minute in: the driver killed, a rollout
pod deleted, the API server restarted, etcd restarted, the trainer's node drained. The job must
recover from each, resume from its newest checkpoint every time, keep most of the wall time for
training steps, leak no file descriptors or threads in the operator, and leave nothing behind
once deleted. The figures are printed (`-rA` or a failure shows them) and written to the test's
temporary directory (`soak.json`, samples included).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_local import soak
from rlhf_local.operator_process import OperatorProcess
from rlhf_local.session import Session
from rlhf_local.testing import LocalCluster

pytestmark = pytest.mark.e2e

PLAN = soak.Plan(minutes=10, fault_interval=2, first_fault=0.5, recovery_timeout=240)
"""Five faults at 0.5, 2.5, 4.5, 6.5 and 8.5 minutes; the last has 90 s before the end."""
MIN_GOODPUT = 0.7
"""Five faults in ten minutes (the long soak's bar is 0.85 at one in ten): their recoveries
took 8-60 s each in the 2-hour soak, so a run whose recoveries add up to more than three
minutes is a regression, not noise."""
MAX_NEW_FDS, MAX_NEW_THREADS = 10, 3
"""The operator's file descriptors and threads after the soak against before it (the 2-hour
soak: 19-24 descriptors and 12-13 threads throughout)."""


@pytest.mark.timeout(PLAN.minutes * 60 + 6 * PLAN.recovery_timeout)
def test_a_ten_minute_soak_under_every_fault_loses_nothing_and_leaks_nothing(
    local_cluster: LocalCluster,
    namespace: str,
    operator: OperatorProcess,
    tmp_path: Path,
) -> None:
    session = Session(local_cluster, namespace, operator, tmp_path, cluster_was_running=True)
    figures = soak.run(session, PLAN)
    summary = {k: v for k, v in figures.items() if k not in ("samples", "trainer_segments")}
    (tmp_path / "soak.json").write_text(json.dumps(figures, indent=1))
    report = json.dumps(summary, indent=1)
    print(report)

    assert [f["fault"] for f in figures["faults"]] == list(soak.FAULTS), report
    assert figures["faults_recovered"] == figures["faults_injected"], report
    assert figures["steps_lost"] == 0, report
    assert figures["lineage_problems"] == [], report
    assert figures["goodput"] >= MIN_GOODPUT, report
    growth = figures["operator_growth"]
    assert growth is not None, report
    assert growth["fds"] <= MAX_NEW_FDS and growth["threads"] <= MAX_NEW_THREADS, report
    assert figures["orphans"] == 0, report
