"""The operator across restarts of the API server and of etcd (issue 13).

One test, to keep the e2e tier short: a running job, then the API server stopped until the
operator's RLHFJob watch has failed to reconnect 7 times (kopf waits 1, 1, 2, 3, 5, 8, 13 s
between attempts), started again (same data, ports, certificates), and at once a second job
created and the first one suspended, while the watch still waits its 13 s (a warning says so
when a slow start of the API server used them up); then, once a steady job created after the
restart runs, etcd restarted, and a third job (created suspended, so cheap) created after it.
The operator must notice every change by itself: with `--timer-interval=1` the timer re-reads
jobs it already knows, so only the watch can find the second and third jobs.

The second job must get its RayCluster (the operator noticed it), not its Ray pods: KubeRay's
caches lag for up to half a minute after the API server is back, and a RayCluster it meets
then fails its reconciles ("services ... already exists", or a second head pod) until
controller-runtime's per-object backoff (doubling, up to 1000 s) parks it. That is KubeRay's
recovery, not the operator's; the steady job, created once KubeRay's caches are fresh again,
is the one that runs through etcd's restart.
"""

from __future__ import annotations

import re
import time
import warnings
from collections import Counter
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import kopf
import pytest

from rlhf_local import cluster
from rlhf_local.jobs import SLEEP_FOREVER, Jobs, job_manifest
from rlhf_local.operator_process import OperatorProcess, metric_value
from rlhf_local.testing import LocalCluster, wait_for
from rlhfjob import api
from rlhfjob.contract.kuberay import RAY_CLUSTERS, RAY_GROUP, RAY_VERSION

pytestmark = pytest.mark.e2e

OK_RECONCILES = 'rlhf_operator_reconciles_total{result="ok"}'
LABEL_JOB = f"{api.GROUP}/job"
#: kopf's line for a failed (re)connection of the RLHFJob watch (or of its re-listing).
WATCH_RETRY = re.compile(
    r"^\[([-\d: ,]+)\] \S+ +\[ERROR +\] Request attempt #(\d+)/\d+ failed; will retry: "
    rf"GET \S*/apis/{re.escape(api.GROUP)}/{api.VERSION}/{api.PLURAL}[?\s]",
    re.MULTILINE,
)
#: kopf's waits between attempts (the operator keeps kopf's default).
_backoffs = kopf.OperatorSettings().networking.error_backoffs
BACKOFFS: tuple[float, ...] = tuple(_backoffs) if isinstance(_backoffs, Iterable) else (_backoffs,)
#: Keep the API server down until this many attempts failed: the next waits BACKOFFS[6] = 13 s.
FAILED_ATTEMPTS = 7


def ray_clusters(jobs: Jobs) -> list[dict[str, Any]]:
    """Every RayCluster in the namespace, including any being deleted."""
    listed: Any = jobs.lc.custom.list_namespaced_custom_object(
        RAY_GROUP, RAY_VERSION, jobs.namespace, RAY_CLUSTERS
    )
    items: list[dict[str, Any]] = listed["items"]
    return items


def clusters_per_job(jobs: Jobs) -> Counter[str]:
    return Counter(
        rc["metadata"].get("labels", {}).get(LABEL_JOB, "?") for rc in ray_clusters(jobs)
    )


def uid_of_cluster(jobs: Jobs, name: str) -> str | None:
    found = jobs.ray_cluster(name)
    return None if found is None else str(found["metadata"]["uid"])


def log_since(operator: OperatorProcess, offset: int) -> str:
    with operator.log_path.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def ok_reconciles(operator: OperatorProcess) -> float:
    return metric_value(operator.metrics(), OK_RECONCILES)


def test_operator_survives_api_server_and_etcd_restarts(
    local_cluster: LocalCluster, namespace: str, operator: OperatorProcess
) -> None:
    jobs = Jobs(local_cluster, namespace)
    assert operator.process is not None
    pid = operator.process.pid

    jobs.create(job_manifest("first", namespace, SLEEP_FOREVER))
    jobs.wait_phase("first", "Running", 180, operator)
    first_uid = uid_of_cluster(jobs, "first")
    assert first_uid is not None
    assert len(jobs.ray_submissions("first")) == 1

    # -- the API server goes away until the operator's watch has failed to reconnect 7 times.
    offset = operator.log_path.stat().st_size

    def failed_attempt() -> tuple[int, float] | None:
        """The latest failed attempt of the watch (number, when) once it is the 7th or later."""
        found = WATCH_RETRY.findall(log_since(operator, offset))
        if not found or int(found[-1][1]) < FAILED_ATTEMPTS:
            return None
        when = datetime.strptime(found[-1][0], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        return int(found[-1][1]), when

    with cluster.stopped("kube-apiserver"):
        attempt, failed_at = wait_for(
            failed_attempt,
            60,
            f"the operator's RLHFJob watch to fail to reconnect {FAILED_ATTEMPTS} times",
            details=lambda: operator.log_tail(20),
        )
    # Back and ready: change things at once, while the watch waits for its next attempt. Only
    # the watch (its re-list) can tell the operator about "second".
    jobs.create(job_manifest("second", namespace, SLEEP_FOREVER))
    assert uid_of_cluster(jobs, "first") == first_uid, "the restart replaced first's RayCluster"
    assert len(jobs.ray_submissions("first")) == 1
    jobs.patch_spec("first", {"suspend": True})
    if time.time() > failed_at + BACKOFFS[attempt - 1]:
        warnings.warn(
            "the API server took so long to start that the operator's watch may have "
            "reconnected before the changes: this run did not test its backoff window",
            stacklevel=1,
        )

    wait_for(
        lambda: uid_of_cluster(jobs, "second"),
        120,
        "the operator to notice the second job (its RayCluster)",
        details=lambda: operator.log_tail(60),
    )
    jobs.wait_phase("first", "Suspended", 60, operator)
    # Running before etcd goes, for the same reason (KubeRay's caches go stale across etcd's
    # outage too): a job KubeRay met only with fresh caches.
    jobs.create(job_manifest("steady", namespace, SLEEP_FOREVER))
    jobs.wait_phase("steady", "Running", 240, operator)
    steady_uid = uid_of_cluster(jobs, "steady")
    submissions = [job["submission_id"] for job in jobs.ray_submissions("steady")]
    assert len(submissions) == 1, submissions

    # -- etcd goes away while the second job runs.
    with cluster.stopped("etcd"):
        wait_for(
            lambda: not cluster.healthy("kube-apiserver"),
            60,
            "the API server to report etcd gone (/readyz)",
        )
    reconciled = ok_reconciles(operator)
    jobs.create(job_manifest("third", namespace, SLEEP_FOREVER, suspend=True))
    jobs.wait_phase("third", "Suspended", 90, operator)
    wait_for(
        lambda: ok_reconciles(operator) >= reconciled + 5,
        60,
        "the operator to reconcile again after etcd's restart",
    )

    wait_for(lambda: jobs.ray_cluster("first") is None, 120, "first's RayCluster to be deleted")
    assert jobs.phase("steady") == "Running"
    assert jobs.phase("first") == "Suspended"
    assert uid_of_cluster(jobs, "steady") == steady_uid, "etcd's restart replaced a RayCluster"
    per_job = clusters_per_job(jobs)
    assert per_job["steady"] == 1 and per_job["second"] <= 1, f"RayClusters per job: {per_job}"
    assert set(per_job) <= {"steady", "second"}, f"RayClusters per job: {per_job}"
    resubmitted = [job["submission_id"] for job in jobs.ray_submissions("steady")]
    assert resubmitted == submissions, "etcd's restart resubmitted the trainer"
    assert jobs.ray_cluster("third") is None

    assert operator.process is not None and operator.process.pid == pid
    assert operator.process.poll() is None, "the operator exited"
    assert operator.healthy()
