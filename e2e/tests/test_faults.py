"""Fault injection: the real trainer, under the operator, survives what production throws at it.

Each test applies a tiny GRPO job (`rlhf_local.faults.fault_job`: real ZeRO-3 trainer, real
rollout engines, on the stand-in Ray), injects a failure once a checkpoint exists (the in-place
cases 1, 2 and 6 one after another in one job, and the two losses of a whole cluster, 5 and 10,
in another: a job's start-up is most of what a case costs, and none of them disturbs the next),
and checks that the job ends Succeeded with every step after the last checkpoint trained
exactly once (`TrainingRecord.lineage_problems`) and every checkpoint still there and intact.
The last two tests are the failures that must end a job: one that keeps failing, and one
retrying cannot fix.

A real Prometheus (`rlhf_local.prometheus`) scrapes the operator and every Ray pod for the whole
module and evaluates the chart's alerts with durations of seconds: the in-place case runs
every dashboard query on what it scraped, and each alert is seen firing in the case that
provokes it (a hung trainer, a lost rollout pod, the operator's restart, and failing
reconciles: the operator's role loses a verb for a moment).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from rlhf_local import cluster, dashboards, faults, objectstore
from rlhf_local import prometheus as prom
from rlhf_local.faults import TrainingRecord
from rlhf_local.jobs import Jobs
from rlhf_local.operator_process import OperatorProcess, metric_value, verb_revoked
from rlhf_local.paths import local_dir
from rlhf_local.prometheus import Prometheus
from rlhf_local.standin import SCRAPE_TARGETS
from rlhf_local.testing import LocalCluster, wait_for
from rlhf_local.tiny_models import save_tiny_reward_model, save_tiny_tokenizer
from rlhf_trainer.state.bucket import BucketTier
from rlhfjob.contract.kuberay import RAY_CLUSTERS, RAY_GROUP, RAY_VERSION

pytestmark = pytest.mark.e2e

TOTAL_STEPS = 24
INTERVAL = 4
HEARTBEAT_TIMEOUT = 10
JOB_TIMEOUT = 600.0
"""From apply to Succeeded, failure and recovery included (provisioning takes most of it)."""


@pytest.fixture
def jobs(local_cluster: LocalCluster, namespace: str) -> Jobs:
    return Jobs(local_cluster, namespace)


@pytest.fixture(scope="module", autouse=True)
def prometheus(
    local_cluster: LocalCluster, operator: OperatorProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    """Prometheus over every case of the module, with the chart's alerts on short durations."""
    binaries = cluster.binaries()
    server = Prometheus(
        binaries.prometheus,
        tmp_path_factory.mktemp("prometheus"),
        operator.metrics_port,
        cluster.Layout(local_dir()).standin / SCRAPE_TARGETS,
        prom.render_rules(binaries.helm, prom.SHORT_ALERTS),
    )
    server.start()
    try:
        yield server
    finally:
        elapsed = time.time() - server.started
        print(f"[prometheus] {server.cpu_seconds():.1f} CPU-s over {elapsed:.0f} s of scraping")
        server.stop()


RATE_INTERVAL = "30s"
"""What `$__rate_interval` becomes: several scrapes at the stand-in's interval."""


def dashboard_queries_without_data(server: Prometheus, namespace: str, name: str,
                                   start: float) -> list[str]:  # fmt: skip
    """Every dashboard query, its variables filled in for the job, over the job's lifetime as a
    panel asks it; those with no finite value anywhere."""
    variables = {"namespace": namespace, "job": name, "__rate_interval": RATE_INTERVAL}
    empty = []
    for path in dashboards.paths():
        for query in dashboards.queries(path):
            expr = query.filled(variables)
            if not prom.has_data(server.query_range(expr, start, time.time())):
                empty.append(f"{query.dashboard} / {query.panel}: {expr}")
    return empty


class FaultRun:
    """One fault job: apply it, wait for the moment to strike, check how it ended."""

    def __init__(self, jobs: Jobs, operator: OperatorProcess, checkpoints: Path, name: str,
                 **spec: Any) -> None:  # fmt: skip
        self.jobs, self.operator, self.name = jobs, operator, name
        self.manifest = faults.fault_job(name, jobs.namespace, checkpoints, **spec)
        self.total_steps = int(self.manifest["spec"]["algorithm"]["totalSteps"])
        self.interval = int(self.manifest["spec"]["checkpoint"]["intervalSteps"])
        self.record = TrainingRecord.of(self.manifest)
        jobs.create(self.manifest)

    def status(self) -> dict[str, Any]:
        return self.jobs.status(self.name)

    def cluster_uid(self) -> str:
        cluster = self.jobs.ray_cluster(self.name)
        assert cluster is not None
        return str(cluster["metadata"]["uid"])

    def wait_past_checkpoint(self, checkpoints: int = 1) -> int:
        """Wait for `checkpoints` checkpoints and a step trained after them; returns the newest."""

        def ready() -> int | None:
            steps = self.record.checkpoint_steps()
            if len(steps) >= checkpoints and self.record.last_step() > steps[-1]:
                return steps[-1]
            return None

        return wait_for(ready, JOB_TIMEOUT, f"{self.name} to train past a checkpoint",
                        interval=0.1, details=self.explain)  # fmt: skip

    def wait_for_restart(self, count: int = 1, timeout: float = 180) -> dict[str, Any]:
        return faults.wait_for_restart(self.jobs, self.name, count, timeout)

    def explain(self) -> str:
        return f"status: {self.status()}\nsteps: {self.record.steps_by_attempt()}\n" + (
            self.operator.log_tail(40)
        )

    def drain(self) -> int:
        """Suspend the training job: the trainer checkpoints the step it is on, then the cluster
        goes. Returns the drain's checkpoint step (the last step trained, so none is lost)."""
        self.jobs.patch_spec(self.name, {"suspend": True})
        asked = wait_for(lambda: self.jobs.condition(self.name, "Draining"), 30,
                         f"{self.name} to drain", details=self.explain)  # fmt: skip
        assert asked["status"] == "True", asked
        self.jobs.wait_phase(self.name, "Suspended", 120, self.operator)
        drained = self.jobs.condition(self.name, "Draining")
        assert drained is not None and drained["reason"] == "Drained", drained
        saved = self.record.newest_checkpoint()
        assert saved == self.record.last_step(), "the drain checkpointed the last step trained"
        wait_for(lambda: (self.status().get("lastCheckpoint") or {}).get("step") == saved, 30,
                 f"status to show the drain's checkpoint, step {saved}")  # fmt: skip
        wait_for(lambda: self.jobs.ray_cluster(self.name) is None, 90, "the cluster released")
        self.jobs.patch_spec(self.name, {"suspend": False})
        return saved

    def assert_recovered(
        self, resumed_from: list[int | None], drained: tuple[int, ...] = ()
    ) -> dict[str, Any]:
        """Succeeded; each attempt resumed from the checkpoint it had (a drained attempt goes
        on from its drain's checkpoint: its steps stay consecutive); no checkpoint lost."""
        status = self.jobs.wait_phase(self.name, "Succeeded", JOB_TIMEOUT, self.operator)["status"]
        problems = self.record.lineage_problems(resumed_from, self.total_steps)
        assert not problems, f"{problems}\n{self.explain()}"
        expected = sorted({*range(self.interval, self.total_steps + 1, self.interval), *drained})
        assert self.record.checkpoint_steps() == expected, "a checkpoint is missing or corrupt"
        assert status["restartCount"] == len(resumed_from)
        return dict(status)


@pytest.fixture
def fault_run(jobs: Jobs, operator: OperatorProcess, tmp_path: Path) -> Iterator[Any]:
    def start(name: str, **spec: Any) -> FaultRun:
        return FaultRun(jobs, operator, tmp_path / "checkpoints", name, **spec)

    yield start


def restart_time(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["time"].replace("Z", "+00:00")).timestamp()


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- 1-7: failures the job must survive -----------------------------------------------------------


def test_1_2_6_killed_frozen_and_corrupt_restarts_resume_in_place_then_a_drain_loses_no_step(
    fault_run: Any, prometheus: Prometheus
) -> None:
    """Three in-place restarts of one job, each from the checkpoint it had, then a suspend.

    1. a killed driver is resubmitted in place from the newest checkpoint;
    2. a frozen driver is judged hung within the heartbeat timeout, stopped, and resubmitted;
    6. a driver frozen after the newest checkpoint was corrupted, then killed, resumes from the
       previous one;
    and then a suspend mid-step (as a preemption would): no step is trained twice after it.
    One job for the three because none disturbs the next (each is an in-place restart of the
    same cluster): a job's start-up is most of what each case cost on its own.
    """
    started = time.time()
    # Steps enough after the drain for several of Prometheus's scrapes of the last driver (every
    # 5 s): the earlier attempts each train a few seconds only.
    # Generating a step ahead (`maxStaleness: 1`): each restart and the drain strike with a
    # batch in flight, which the checkpoint carries (issue 27).
    run = fault_run("inplace", algorithm={"totalSteps": 64, "maxStaleness": 1})

    # 1: killed.
    run.wait_past_checkpoint()
    cluster_uid = run.cluster_uid()
    faults.kill_driver(run.jobs, run.name)
    killed = run.wait_for_restart()
    after_kill = run.record.newest_checkpoint()
    assert killed["reason"] == "TrainerFailed", killed
    assert killed["detectionSeconds"] < 10, "measured from the driver's exit as Ray reports it"
    assert run.cluster_uid() == cluster_uid, "an in-place restart keeps the RayCluster"
    wait_for(lambda: run.status()["restartHistory"][0].get("resumedTime"), 120,
             "the operator to see training resume", details=run.explain)  # fmt: skip

    # 2: frozen (SIGSTOP: the heartbeat stops too).
    run.wait_past_checkpoint(checkpoints=len(run.record.checkpoint_steps()) + 1)
    pid = faults.freeze_driver(run.jobs, run.name)
    frozen_at = time.time()
    hung = run.wait_for_restart(count=2, timeout=HEARTBEAT_TIMEOUT + 60)
    after_freeze = run.record.newest_checkpoint()
    assert hung["reason"] == "TrainerHung", hung
    detected_after = restart_time(hung) - frozen_at
    assert detected_after <= HEARTBEAT_TIMEOUT + 5, f"hang detected after {detected_after:.1f}s"
    assert run.cluster_uid() == cluster_uid

    # 6: the newest checkpoint corrupt. Freeze first so no newer one appears, corrupt it, kill.
    run.wait_past_checkpoint(checkpoints=len(run.record.checkpoint_steps()) + 1)
    faults.freeze_driver(run.jobs, run.name)
    newest = run.record.newest_checkpoint()
    assert newest is not None
    faults.corrupt_checkpoint(run.record.step_dir(newest))
    previous = run.record.newest_checkpoint()
    assert previous is not None and previous < newest, "the corrupt checkpoint no longer counts"
    faults.kill_driver(run.jobs, run.name)
    run.wait_for_restart(count=3)
    assert run.cluster_uid() == cluster_uid

    # Then a drain, and the job ends with every step after each checkpoint trained once.
    run.wait_past_checkpoint(checkpoints=len(run.record.checkpoint_steps()) + 1)
    drained = run.drain()
    status = run.assert_recovered([after_kill, after_freeze, previous], drained=(drained,))
    assert status["restartCount"] == 3, "a drain is not a restart"
    assert not process_alive(pid), "the frozen driver was stopped"
    healthy = next(c for c in status["conditions"] if c["type"] == "Healthy")
    assert healthy["status"] == "True"
    progress = status["progress"]
    assert progress["stepsPerSecond"] > 0 and progress["tokensPerSecond"] > 0, progress
    assert progress["rewardMean"] is not None and progress["eta"], progress
    header, row = cluster_table(run)
    assert "ETA" in header.split() and progress["eta"] in row.split(), (header, row)
    # What Prometheus scraped of this job: every dashboard query has data, and the alerts of a
    # hung trainer and of restarts running out fired for this job.
    namespace = run.jobs.namespace
    checking = time.monotonic()
    empty = dashboard_queries_without_data(prometheus, namespace, run.name, started)
    print(f"[prometheus] dashboard queries checked in {time.monotonic() - checking:.1f} s")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    fired = prometheus.fired(started, selector=f'namespace="{namespace}", rlhfjob="{run.name}"')
    expected = {"RLHFJobTrainerHung", "RLHFJobRestartsNearlyExhausted",
                "RLHFJobProvisioningStuck", "RLHFJobNoStepProgress"}  # fmt: skip
    assert expected <= fired, f"fired: {sorted(fired)}\n{prometheus.log_tail()}"


def cluster_table(run: FaultRun) -> tuple[str, str]:
    """`kubectl get rlhfjobs NAME`: its header and the job's row."""
    output = cluster.kubectl("get", "rlhfjobs", run.name, "-n", run.jobs.namespace)
    header, row = output.split("\n")[:2]
    return header, row


COLOCATED = {"placement": "colocated", "replicas": None, "minReplicas": None, "cpu": None,
             "memory": None}  # fmt: skip
"""The fault job's rollout, colocated: an engine inside the trainer rank, no rollout pods."""


def test_1_colocated_killed_driver_is_resubmitted_in_place_with_its_engines(
    fault_run: Any,
) -> None:
    run = fault_run("kill-colocated", roles={"rollout": COLOCATED}, algorithm={"totalSteps": 12})
    cluster = wait_for(lambda: run.jobs.ray_cluster(run.name), 60, "the RayCluster")
    groups = [group["groupName"] for group in cluster["spec"]["workerGroupSpecs"]]
    assert groups == ["trainer"], "a colocated rollout has no pods of its own"
    run.wait_past_checkpoint()
    faults.kill_driver(run.jobs, run.name)
    restart = run.wait_for_restart()
    resumed = run.record.newest_checkpoint()
    assert restart["reason"] == "TrainerFailed"
    assert run.cluster_uid() == cluster["metadata"]["uid"], "in place: the same RayCluster"
    status = run.assert_recovered([resumed])
    assert status["restartHistory"][0]["resumedTime"], "the operator saw training resume"


def reward_model_spec(directory: Path) -> dict[str, Any]:
    """What the fault job adds for a reward-model role of two replicas (one may be lost): the
    tiny tokenizer and reward model saved under `directory`, weighed in beside the task's rule."""
    tokenizer = save_tiny_tokenizer(directory / "tokenizer")
    reward_model = save_tiny_reward_model(directory / "reward-model", tokenizer, "4")
    return {
        "model": {"tokenizer": str(tokenizer), "reward": str(reward_model)},
        "reward": {
            "type": "combined",
            "function": None,
            "components": [
                {"function": "rlhf_trainer.data.tasks:target_token_reward"},
                {"type": "model", "weight": 0.1},
            ],
        },
        "roles": {"reward": {"replicas": 2, "minReplicas": 1, "cpu": 1, "memory": "2Gi"}},
    }


def test_3_lost_rollout_and_reward_pods_degrade_training_and_both_rejoin(
    fault_run: Any, tmp_path: Path, prometheus: Prometheus
) -> None:
    """One run, two elastic roles: a rollout pod and a reward-model pod are lost at once; the
    job is Degraded and trains on, and the replacement engine and reward model rejoin. Each
    batch is generated a step ahead (`maxStaleness: 1`), so the engine is lost while it
    generates beside an update."""
    started = time.time()
    extra = reward_model_spec(tmp_path / "models")
    # Long enough for the replacement pods' Ray nodes and actors to come back mid-run: they
    # rejoin about 30 steps after the loss (step 5) on an idle machine, so 4x that margin.
    run = fault_run(
        "elastic",
        algorithm={"totalSteps": 120, "stopAtEos": False, "maxStaleness": 1},
        checkpoint={"intervalSteps": 40},
        **extra,
    )
    faults.wait_for_step(run.jobs, run.name, 5, JOB_TIMEOUT, run.operator)
    faults.delete_pod(run.jobs, run.name, "rollout")
    faults.delete_pod(run.jobs, run.name, "reward")

    def degraded() -> dict[str, Any] | None:
        condition = run.jobs.condition(run.name, "Degraded")
        shown = condition and condition["status"] == "True"
        both = shown and "rollout" in condition["message"] and "reward" in condition["message"]
        return condition if both else None

    wait_for(degraded, 60, "the Degraded condition naming both roles", details=run.explain)
    assert run.status()["phase"] == "Running", "degraded, not failed"

    def restored() -> bool:
        condition = run.jobs.condition(run.name, "Degraded")
        return bool(condition and condition["status"] == "False")

    wait_for(restored, 300, "the engine and the reward model to rejoin", details=run.explain)
    rejoined_at = run.status().get("currentStep") or 0
    assert rejoined_at < run.total_steps, "they rejoined before training ended"
    print(f"[case 3] rejoined at step {rejoined_at} of {run.total_steps}")
    run.assert_recovered([])
    reasons = run.jobs.event_reasons(run.name)
    assert "Degraded" in reasons and "ReplicasRestored" in reasons, reasons
    records = run.record.records()
    engines = {r.get("rollout_engines") for r in records}
    assert {1, 2} <= engines, f"steps ran with {engines} engines"
    parts = {tuple(sorted(r.get("reward_components") or {})) for r in records}
    assert parts == {("function", "model")}, f"every step scored by both parts: {parts}"
    lags = {lag for r in records[1:] for lag in r.get("staleness", {})}
    assert lags == {"1"}, f"every batch after the first generated a step ahead: {lags}"
    selector = f'namespace="{run.jobs.namespace}", rlhfjob="{run.name}"'
    assert "RLHFJobDegraded" in prometheus.fired(started, selector=selector)


def test_4_lost_trainer_pods_shrink_then_grow_the_elastic_trainer_and_a_node_drain_moves_it(
    fault_run: Any,
) -> None:
    # Steps enough to still train when the node drain comes, after two restarts: the grown
    # attempt starts near step 17 and the drain reaches it about 7 steps later (an idle
    # machine), so 100 leaves ten times that margin.
    trainer = {"replicas": 2, "minReplicas": 1, "replacementTimeoutSeconds": 5}
    run = fault_run("rank", roles={"trainer": trainer}, algorithm={"totalSteps": 100})
    run.wait_past_checkpoint()
    # The training pool is full, so the lost pod is not replaced: after the timeout training
    # resumes from the checkpoint on the one replica left, and the job is Degraded.
    with faults.pool_full(run.jobs, run.name, "trainer"):
        faults.delete_pod(run.jobs, run.name, "trainer")
        restart = run.wait_for_restart()
        assert restart["reason"] in ("TrainerPodLost", "TrainerFailed"), restart
        # Degraded may first say something else (the new attempt's engines not yet up).
        wait_for(lambda: (c := run.jobs.condition(run.name, "Degraded"))
                            and c["status"] == "True"
                            and "trainer 1/2 replicas" in c["message"] and c, 180,
                            "the job to train degraded", details=run.explain)  # fmt: skip
        assert run.status()["trainerReplicas"] == 1
        run.wait_past_checkpoint(checkpoints=len(run.record.checkpoint_steps()) + 1)
        lost_at = run.record.steps_by_attempt()[1][0] - 1  # the newest checkpoint it found
        assert lost_at in run.record.checkpoint_steps(), lost_at
    # The pool has room again: the replacement pod comes up, the trainer checkpoints the step it
    # is on and restarts on both replicas (a resize, not a failure).
    resize = run.wait_for_restart(count=2, timeout=240)
    assert resize["reason"] == "TrainerResized", resize
    wait_for(lambda: 2 in run.record.steps_by_attempt(), JOB_TIMEOUT, "the grown attempt",
             details=run.explain)  # fmt: skip
    grown_at = run.record.steps_by_attempt()[2][0] - 1
    assert grown_at == run.record.steps_by_attempt()[1][-1], "the resize lost no step"
    wait_for(lambda: (run.jobs.condition(run.name, "Degraded") or {}).get("status") == "False",
             180, "Degraded to clear", details=run.explain)  # fmt: skip
    assert "trainerReplicas" not in run.status()
    # Then a trainer node is drained: the budget holds the eviction back until the trainer
    # checkpointed the step it was on; the job moves off the node and loses no step.
    with faults.node_drain(run.jobs, run.name) as (node, drain):
        moved = wait_for(lambda: _moved_off(run, node), 120, f"{run.name} to move off {node}",
                         details=run.explain)  # fmt: skip
        # The trainer was asked to checkpoint its step and stop (Draining); or the drain's
        # evictions took the rollout pods beside it first (both may sit on the drained node),
        # and it checkpointed the last step it trained, then exited.
        draining = moved.get("Draining") or {}
        if node in draining.get("message", ""):
            assert (draining["status"], draining["reason"]) == ("False", "Drained"), draining
        drained = run.record.newest_checkpoint()
        assert drained == run.record.last_step(), f"the drain saved the last step: {moved}"
        output, _ = drain.communicate(timeout=240)
        assert drain.returncode == 0, f"kubectl drain: {output}"
        run.jobs.wait_phase(run.name, "Running", 240, run.operator)
        placed = {p.spec.node_name for p in run.jobs.pods(run.name, "trainer")}
        assert node not in placed, f"a trainer pod is back on the drained {node}"
    status = run.assert_recovered([lost_at, grown_at], drained=(grown_at, drained))
    assert (status["restartCount"], status["resizes"]) == (2, 1), "a resize, then no restart"


def _moved_off(run: FaultRun, node: str) -> dict[str, dict[str, Any]] | None:
    """The job's conditions by type, once the operator moved it off the drained `node`: its
    `NodeDrained` Event names the node and a drain under way has ended. An Event, not the
    conditions of the move (`ClusterReady` False, `NodeDrained`): those last only until
    KubeRay calls the new cluster ready, within a second here, where pods start at once."""
    moving = [e for e in run.jobs.events(run.name) if e.reason == "NodeDrained"]
    conditions = {c["type"]: c for c in run.status().get("conditions", [])}
    drain_ended = (conditions.get("Draining") or {}).get("status") != "True"
    return conditions if drain_ended and any(node in (e.message or "") for e in moving) else None


def test_5_10_a_lost_head_then_a_cluster_deleted_with_its_volumes_checkpoints_resume(
    fault_run: Any, jobs: Jobs, s3_bucket: str
) -> None:
    """Two losses of the whole Ray cluster in one job, each answered by a new RayCluster:

    5. the head pod is lost: the new cluster's trainer resumes from the volume's newest
       checkpoint;
    10. the RayCluster is deleted and the volume loses every checkpoint: the trainer resumes
        from the newest complete one in a real S3 bucket (checkpoints go to the volume every 4
        steps and to the bucket every 8, in the background).
    """
    keys = objectstore.credentials()
    jobs.lc.core.create_namespaced_secret(jobs.namespace, {
        "metadata": {"name": "bucket-keys"},
        "stringData": {"AWS_ACCESS_KEY_ID": keys.access_key_id,
                       "AWS_SECRET_ACCESS_KEY": keys.secret_access_key},
    })  # fmt: skip
    store = {"bucket": s3_bucket, "endpoint": objectstore.endpoint_url(),
             "credentialsSecret": "bucket-keys", "intervalSteps": 8, "keepLast": 2}  # fmt: skip
    run = fault_run("cluster-loss", algorithm={"totalSteps": 40},
                    checkpoint={"objectStore": store})  # fmt: skip
    bucket = BucketTier(objectstore.client(), s3_bucket, f"{run.jobs.namespace}/{run.name}/", 2)

    # 5: the head pod lost.
    run.wait_past_checkpoint()
    first_cluster = run.cluster_uid()
    faults.delete_pod(run.jobs, run.name, "head")
    restart = run.wait_for_restart(timeout=240)
    at_failure = run.record.newest_checkpoint() or 0
    assert restart["reason"] == "HeadLost", restart
    wait_for(lambda: run.jobs.ray_cluster(run.name) and run.cluster_uid() != first_cluster, 240,
             "a new RayCluster", details=run.explain)  # fmt: skip
    # The new attempt resumes from the newest checkpoint, at least the one there at the failure
    # (the old driver may have finished one more as its head went).
    wait_for(lambda: 1 in run.record.steps_by_attempt(), JOB_TIMEOUT, "the resumed attempt",
             details=run.explain)  # fmt: skip
    after_head = run.record.steps_by_attempt()[1][0] - 1
    assert after_head >= at_failure and after_head in run.record.checkpoint_steps(), after_head

    # 10: a bucket checkpoint of the new attempt and a step after it, then the cluster deleted.
    def uploaded_by_this_attempt() -> bool:
        complete = bucket.complete()
        return bool(complete) and after_head < complete[0].step < run.record.last_step()

    wait_for(uploaded_by_this_attempt, JOB_TIMEOUT,
             "a checkpoint of the resumed attempt in the bucket and a step after it",
             details=run.explain)  # fmt: skip
    status = run.status()
    pid = faults.driver_pid(run.jobs.dashboard(run.name), status["submissionId"],
                            run.jobs.ray_token(run.name))  # fmt: skip
    assert pid is not None
    jobs.lc.custom.delete_namespaced_custom_object(
        RAY_GROUP, RAY_VERSION, jobs.namespace, RAY_CLUSTERS, run.name
    )
    wait_for(lambda: not process_alive(pid), 120, "the old driver to die with its cluster")
    newest = bucket.complete()[0].step  # an upload the driver did not finish is not complete
    for step in run.record.checkpoint_steps():
        faults.remove_checkpoint(run.record.step_dir(step))
    assert run.record.checkpoint_steps() == []
    restart = run.wait_for_restart(count=2, timeout=240)
    assert restart["reason"] == "HeadLost" and "deleted" in restart["message"], restart
    done = run.jobs.wait_phase(run.name, "Succeeded", JOB_TIMEOUT, run.operator)["status"]
    problems = run.record.lineage_problems([after_head, newest], run.total_steps)
    assert not problems, f"{problems}\n{run.explain()}"
    assert newest in run.record.checkpoint_steps(), "downloaded back onto the volume"
    assert [u.step for u in bucket.complete()] == [40, 32], "the last step's, keepLast 2"
    assert done["restartCount"] == 2


def test_7_operator_restart_mid_job_makes_no_duplicate_cluster_or_submission(
    fault_run: Any, operator: OperatorProcess, prometheus: Prometheus
) -> None:
    run = fault_run("operator", algorithm={"totalSteps": 120}, checkpoint={"intervalSteps": 40})
    faults.wait_for_step(run.jobs, run.name, 2, JOB_TIMEOUT, operator)
    cluster = run.cluster_uid()
    running = time.time()
    assert "RLHFJobOperatorDown" not in prometheus.fired(running - 30, running)
    operator.stop()
    operator.start()
    wait_for(lambda: "RLHFJobOperatorDown" in prometheus.fired(running), 30,
             "the operator-down alert to fire for the restart")  # fmt: skip
    wait_for(
        lambda: (
            metric_value(operator.metrics(), 'rlhf_operator_reconciles_total{result="ok"}') >= 3
        ),
        60,
        "the restarted operator to reconcile",
    )
    assert run.status()["phase"] == "Running", run.explain()
    assert run.cluster_uid() == cluster
    # Reconciles that fail (the operator may no longer write the job's status) fire the
    # reconcile-errors alert on the real Prometheus; with the verb back, the job goes on.
    errors = 'rlhf_operator_reconciles_total{result="error"}'
    failing_since, errors_before = time.time(), metric_value(operator.metrics(), errors)
    with verb_revoked(run.jobs.lc, "rlhfjobs/status", "patch"):
        wait_for(lambda: "RLHFJobOperatorReconcileErrors" in prometheus.fired(failing_since), 90,
                 "the reconcile-errors alert to fire", details=run.explain)  # fmt: skip
        assert metric_value(operator.metrics(), errors) > errors_before
    submissions = run.jobs.ray_submissions(run.name)
    assert len(submissions) == 1, f"{submissions}\n{run.explain()}"
    run.assert_recovered([])
    assert run.jobs.event_reasons(run.name).count("Submitted") == 1


# --- 8-9: failures that must end the job ------------------------------------------------------


def test_8_a_job_that_always_fails_is_failed_after_max_restarts(
    jobs: Jobs, operator: OperatorProcess, tmp_path: Path
) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the checkpoint volume should be\n")
    manifest = faults.fault_job("doomed", jobs.namespace, blocked, recovery={"maxRestarts": 2})
    jobs.create(manifest)
    status = jobs.wait_phase("doomed", "Failed", JOB_TIMEOUT, operator)["status"]
    assert status["restartCount"] == 2
    assert "after 2 restarts" in status["message"]
    assert "Not a directory" in status["message"], status["message"]
    assert [r["reason"] for r in status["restartHistory"]] == ["TrainerFailed", "TrainerFailed"]
    assert "RestartsExhausted" in jobs.event_reasons("doomed")


def test_9_a_non_retryable_error_fails_the_job_at_once(
    jobs: Jobs, operator: OperatorProcess, tmp_path: Path
) -> None:
    manifest = faults.fault_job(
        "broken", jobs.namespace, tmp_path, reward={"function": "rlhf_no_such_module:reward"}
    )
    jobs.create(manifest)
    status = jobs.wait_phase("broken", "Failed", JOB_TIMEOUT, operator)["status"]
    assert status["restartCount"] == 0
    assert "rlhf_no_such_module" in status["message"], status["message"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "NonRetryableError"
