"""A job's head that answers the operator as an attacker would, against the real operator process
with the chart's RBAC (issue 49).

A job's entrypoint runs on its own head and may replace the Ray dashboard there. The operator
asks every job's dashboard, and one operator serves every tenant: if an answer could crash it
(a compression bomb past its memory limit) every job in the cluster would stop being reconciled;
if it followed a redirect, it would carry the job's token elsewhere and act as the job's proxy.
Here the job's RayCluster names a hostile dashboard (the stand-in's annotation, the operator's
`--dev-dashboard-from-annotation` hook: the address is the attacker's, the client is the one the
chart runs) and the test watches the operator: its peak memory stays put, it goes on
reconciling, and the job's status quotes only a short snippet. The same client code meets every
hostile answer in the unit tier (`tests/security/test_untrusted_endpoints.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlhf_local.hostile import Hostile, bomb, encoded, failing, json_answer, redirect
from rlhf_local.jobs import SLEEP_FOREVER, Jobs, condition_of, job_manifest
from rlhf_local.operator_process import OperatorProcess
from rlhf_local.testing import LocalCluster, wait_for
from rlhfjob.contract import DASHBOARD_ANNOTATION
from rlhfjob.contract.kuberay import RAY_CLUSTERS, RAY_GROUP, RAY_VERSION

pytestmark = pytest.mark.e2e

INFLATED_MIB = 384
"""What the bomb inflates to: most of the chart's memory limit for the operator (512Mi)."""
SEEN_WITHIN_S = 45
SECRET = "AKIAIOSFODNN7EXAMPLE"


def _peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def _point_at(lc: LocalCluster, namespace: str, name: str, url: str) -> None:
    """Name `url` as the job's dashboard on its RayCluster (the stand-in's annotation)."""
    patch = {"metadata": {"annotations": {DASHBOARD_ANNOTATION: url}}}
    lc.custom.patch_namespaced_custom_object(
        RAY_GROUP, RAY_VERSION, namespace, RAY_CLUSTERS, name, patch
    )


def _refusal(
    jobs: Jobs, lc: LocalCluster, name: str, head: Hostile, says: str
) -> dict[str, Any] | None:
    """The job's DashboardReachable condition once the operator asked `head` and says `says`;
    meanwhile the RayCluster is made to keep naming `head` (the stand-in names its own Ray
    head once that is up: a replaced dashboard would have won over the real one)."""
    cluster = jobs.ray_cluster(name)
    if cluster is None:
        return None
    if (cluster["metadata"].get("annotations") or {}).get(DASHBOARD_ANNOTATION) != head.url:
        _point_at(lc, jobs.namespace, name, head.url)
    condition = condition_of(jobs.status(name), "DashboardReachable")
    if not head.requests or condition is None or condition["status"] != "False":
        return None
    return condition if says in condition.get("message", "") else None


def _bounded(operator: OperatorProcess, before: float) -> None:
    """The operator is alive and its peak memory has not grown past a few dozen MiB."""
    assert operator.process is not None and operator.process.poll() is None, "operator died"
    grown = _peak_rss_mib(operator.process.pid) - before
    assert grown < 64, f"the operator's peak memory grew by {grown:.0f} MiB"


@pytest.mark.attack(
    "a job replaces the dashboard on its own head to crash the cluster-wide operator by memory "
    f"(a gzip bomb: {INFLATED_MIB} MiB from a few hundred KiB) or to steer it elsewhere with a "
    "redirect (the job's token sent on, the answer in the job's status)",
    "the operator's dashboard client: nothing decompressed, at most 1 MiB read, no redirect "
    "followed, errors quoted as a short snippet (rlhf_operator.rayjobs, rlhfjob.untrusted); "
    "tried against the real operator process",
)
def test_a_hostile_dashboard_neither_crashes_nor_steers_the_operator(
    operator: OperatorProcess, local_cluster: LocalCluster, namespace: str
) -> None:
    jobs, name = Jobs(local_cluster, namespace), "hostile-head"
    assert operator.process is not None
    page = f"Traceback (most recent call last): key={SECRET}\n".encode() * 50_000
    with (
        Hostile(encoded(bomb("gzip", INFLATED_MIB), "gzip")) as bombing,
        Hostile(json_answer({"status": "SUCCEEDED"})) as elsewhere,
        Hostile(redirect(307, elsewhere.url)) as redirecting,
        Hostile(failing(500, page)) as failing_head,
    ):
        jobs.create(job_manifest(name, namespace, SLEEP_FOREVER))
        wait_for(lambda: jobs.ray_cluster(name), SEEN_WITHIN_S, f"{name}'s RayCluster")
        before = _peak_rss_mib(operator.process.pid)
        steps = [
            (bombing, "not accepted"),
            (redirecting, "a redirect, which is not followed"),
            (failing_head, "HTTP 500: Traceback"),
        ]
        for head, says in steps:

            def refused(head: Hostile = head, says: str = says) -> dict[str, Any] | None:
                _bounded(operator, before)  # at every look: a growth is what a timeout reports
                assert elsewhere.requests == []  # no redirect followed: the token went nowhere
                return _refusal(jobs, local_cluster, name, head, says)

            condition = wait_for(
                refused,
                SEEN_WITHIN_S,
                f"the operator to ask {head.url} and say: {says}",
                details=lambda: operator.log_tail(30),
            )
            message = condition["message"]
            assert len(message) < 400 and message.isascii() and SECRET not in message, message
        _bounded(operator, before)
        assert elsewhere.requests == []
        assert operator.healthy()  # alive, and reconciling all along: each step was seen
        jobs.delete(name)
