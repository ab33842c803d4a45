"""Kueue admits RLHFJobs as a whole, and a preemption loses no step.

Real Kueue (v0.17, on the local control plane) with a ClusterQueue whose quota holds one tiny
job; the operator (with the chart's `kueue.enabled` RBAC) owns each queued job's Workload. The
first test is the issue's story with the real trainer: a low-priority job trains and
checkpoints, a high-priority one arrives and preempts it, the low one checkpoints the step it is
on before its quota goes, waits, and resumes from that checkpoint once the other is done. The
second is cheap (no training): what a job waiting for admission shows, and that it has no pod.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_local import faults, kueue
from rlhf_local.faults import TrainingRecord
from rlhf_local.jobs import Jobs
from rlhf_local.operator_process import OperatorProcess
from rlhf_local.paths import REPO_ROOT
from rlhf_local.testing import LocalCluster, wait_for
from rlhfjob.contract import kueue as contract_kueue

pytestmark = pytest.mark.e2e

JOB_TIMEOUT = 600.0
QUEUES_EXAMPLE = REPO_ROOT / "examples" / "kueue" / "queues.yaml"
#: One fault job's pods (`faults.fault_job`): head, one trainer and two rollout engines, 1 CPU
#: and 2Gi each. The ClusterQueue's quota holds exactly one such job.
ONE_JOB = kueue.FlavorQuota("", cpu="4", memory="8Gi")


@pytest.fixture
def jobs(local_cluster: LocalCluster, namespace: str) -> Jobs:
    return Jobs(local_cluster, namespace)


@pytest.fixture
def admin(local_cluster: LocalCluster) -> Iterator[kueue.KueueAdmin]:
    with kueue.KueueAdmin(local_cluster) as made:
        yield made


def queue_for_one_job(admin: kueue.KueueAdmin, namespace: str) -> str:
    """A LocalQueue on a ClusterQueue with the cpu pool's quota for one job; its name."""
    flavor = admin.flavor("cpu")
    quota = kueue.FlavorQuota(flavor, cpu=ONE_JOB.cpu, memory=ONE_JOB.memory)
    queue = admin.cluster_queue("rlhf", [quota], namespaces=[namespace])
    admin.wait_cluster_queue_active(queue)
    return admin.local_queue(namespace, "rlhf", queue)


def queued(manifest: dict[str, Any], queue: str, priority: str | None = None) -> dict[str, Any]:
    labels = manifest["metadata"].setdefault("labels", {})
    labels[contract_kueue.LABEL_QUEUE_NAME] = queue
    if priority is not None:
        labels[contract_kueue.LABEL_PRIORITY_CLASS] = priority
    return manifest


def workload_of(jobs: Jobs, name: str) -> dict[str, Any] | None:
    found = [
        w
        for w in jobs.lc.custom.list_namespaced_custom_object(
            kueue.GROUP, kueue.VERSION, jobs.namespace, kueue.WORKLOADS
        )["items"]
        if w["metadata"].get("labels", {}).get(faults.LABEL_JOB) == name
    ]
    assert len(found) <= 1, f"{name} has {len(found)} Workloads"
    return found[0] if found else None


class Watch:
    """Samples, until stopped, what must never happen: a job's cluster or pods existing while
    its Workload holds no quota (no pod before admission, none after the quota went back)."""

    def __init__(self, jobs: Jobs, names: list[str]) -> None:
        self.jobs, self.names = jobs, names
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for name in self.names:
                try:
                    self._check(name)
                except Exception as error:  # a read racing a deletion: sample again
                    if "404" not in str(error):
                        self.violations.append(f"{name}: {error}")

    def _pods(self, name: str) -> int:
        core, selector = self.jobs.lc.core, f"{faults.LABEL_JOB}={name}"
        return len(core.list_namespaced_pod(self.jobs.namespace, label_selector=selector).items)

    def _check(self, name: str) -> None:
        # Pods before and after a Workload without quota: they existed while it held none.
        before = self._pods(name)
        if not before:
            return
        workload = workload_of(self.jobs, name)
        if workload is not None and kueue.has_quota_reservation(workload):
            return
        if after := self._pods(name):
            self.violations.append(f"{name} had {after} pods without a quota reservation")

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.violations


def test_a_preempted_job_checkpoints_its_step_waits_and_resumes_where_it_stopped(
    jobs: Jobs,
    admin: kueue.KueueAdmin,
    operator: OperatorProcess,
    namespace: str,
    tmp_path: Path,
) -> None:
    queue = queue_for_one_job(admin, namespace)
    low_class, high_class = admin.priority_class("low", 100), admin.priority_class("high", 1000)
    checkpoints = tmp_path / "checkpoints"
    interval = 4
    low = queued(
        faults.fault_job("low", namespace, checkpoints, algorithm={"totalSteps": 12},
                         checkpoint={"intervalSteps": interval}),
        queue, low_class,
    )  # fmt: skip
    high = queued(
        faults.fault_job("high", namespace, checkpoints, algorithm={"totalSteps": 4}),
        queue, high_class,
    )  # fmt: skip
    record = TrainingRecord.of(low)
    watch = Watch(jobs, ["low", "high"])

    def explain() -> str:
        return (
            f"low: {jobs.status('low')}\nhigh: {jobs.status('high') if jobs.get('high') else None}"
            f"\nlow workload: {kueue.summary(workload_of(jobs, 'low') or {})}\n"
            f"steps: {record.steps_by_attempt()}\n{operator.log_tail(40)}"
        )

    jobs.create(low)
    wait_for(lambda: (jobs.condition("low", "Admitted") or {}).get("status") == "True", 60,
             "low to be admitted", details=explain)  # fmt: skip
    wait_for(
        lambda: len(record.checkpoint_steps()) >= 1
        and record.last_step() > record.checkpoint_steps()[-1],
        JOB_TIMEOUT, "low to train past a checkpoint", interval=0.2, details=explain,
    )  # fmt: skip

    jobs.create(high)
    # Kueue evicts low for high; low's trainer checkpoints the step it is on.
    draining = wait_for(lambda: jobs.condition("low", "Draining"), 60, "low to drain",
                        details=explain)  # fmt: skip
    assert draining["reason"] == "Preempted", draining
    assert jobs.phase("high") == "Pending" and jobs.ray_cluster("high") is None
    drained = wait_for(
        lambda: (c := jobs.condition("low", "Draining")) and c["status"] == "False" and c,
        120, "low's drain to end", details=explain,
    )  # fmt: skip
    assert drained["reason"] == "Drained", drained
    stopped_at = record.last_step()
    assert record.newest_checkpoint() == stopped_at, "the drain checkpointed the last step trained"
    interval_checkpoint = max(s for s in record.checkpoint_steps() if s % interval == 0)

    # high runs only once low's pods are gone and its quota went back; then low resumes.
    jobs.wait_phase("high", "Succeeded", JOB_TIMEOUT, operator)
    high_workload = wait_for(
        lambda: (w := workload_of(jobs, "high")) and kueue.is_true(w, kueue.FINISHED) and w,
        60, "high's Workload to be Finished", details=explain,
    )  # fmt: skip
    assert kueue.condition(high_workload, kueue.FINISHED)["reason"] == "Succeeded"
    status = jobs.wait_phase("low", "Succeeded", JOB_TIMEOUT, operator)["status"]
    violations = watch.stop()
    assert not violations, violations

    # Every step once: the resumed driver went on from the drain's checkpoint.
    problems = record.lineage_problems([], 12)
    assert not problems, f"{problems}\n{explain()}"
    assert status.get("restartCount", 0) == 0, "a preemption is not a failure"
    low_workload = workload_of(jobs, "low")
    assert low_workload is not None
    evictions = (low_workload.get("status", {}).get("schedulingStats") or {}).get("evictions", [])
    assert any(e.get("reason") == "Preempted" for e in evictions), low_workload.get("status")
    reasons = jobs.event_reasons("low")
    for reason in ("Queued", "Admitted", "Preempted", "Drained", "QuotaReleased"):
        assert reason in reasons, (reason, reasons)
    # The figure: steps trained twice after this preemption, with the drain's checkpoint (0)
    # and as it would have been without it (back to the last interval checkpoint).
    print(
        f"kueue preemption at step {stopped_at}: retrained 0 with the just-in-time checkpoint, "
        f"{stopped_at - interval_checkpoint} without it (intervalSteps {interval})"
    )
    assert stopped_at - interval_checkpoint <= interval


def test_the_example_queues_are_valid_kueue_objects(
    local_cluster: LocalCluster, namespace: str
) -> None:
    """The Kueue set-up of docs/operations.md passes Kueue's CRD schemas and webhooks (a
    server-side dry run, the LocalQueue in a namespace of the test's)."""
    documents = [d for d in yaml.safe_load_all(QUEUES_EXAMPLE.read_text()) if d]
    assert {d["kind"] for d in documents} >= {"ResourceFlavor", "ClusterQueue", "LocalQueue"}
    for document in documents:
        if "namespace" in document["metadata"]:
            document["metadata"]["namespace"] = namespace
        local_cluster.kubectl(
            "create", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(document)
        )


def test_a_job_kueue_cannot_admit_waits_with_kueues_words_and_no_pod(
    jobs: Jobs, admin: kueue.KueueAdmin, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    queue = queue_for_one_job(admin, namespace)
    # Twice the quota's rollout engines: no group of it may start (all or nothing).
    too_big = queued(
        faults.fault_job("too-big", namespace, tmp_path, roles={"rollout": {"replicas": 4}}),
        queue,
    )
    nowhere = queued(faults.fault_job("nowhere", namespace, tmp_path), "no-such-queue")
    jobs.create(too_big)
    jobs.create(nowhere)
    for name, words in (("too-big", "insufficient quota"), ("nowhere", "doesn't exist")):
        waiting = wait_for(
            lambda name=name, words=words: (
                (c := jobs.condition(name, "Admitted")) and words in c["message"] and c
            ),
            60, f"{name} to show Kueue's words", details=lambda name=name: str(jobs.status(name)),
        )  # fmt: skip
        assert waiting["status"] == "False"
        assert jobs.phase(name) == "Pending" and words in jobs.status(name)["message"]
        assert jobs.ray_cluster(name) is None
        pods = jobs.lc.core.list_namespaced_pod(
            namespace, label_selector=f"{faults.LABEL_JOB}={name}"
        ).items
        assert pods == []
