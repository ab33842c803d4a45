"""A job under periodic faults on the local control plane: nothing lost, nothing leaking.

Two callers: `task soak` (`benchmarks/soak.py`: 2 hours, a fault every 10 minutes, writes
`benchmarks/results/soak.json`) and the e2e tier's 10-minute variant
(`e2e/tests/test_soak.py`: each fault once, two minutes apart).

One tiny GRPO job (`rlhf_local.faults.fault_job`: one trainer rank, two rollout engines, a
checkpoint every `CHECKPOINT_INTERVAL` steps) trains for `Plan.minutes` while, every
`Plan.fault_interval` minutes, the next fault of `FAULTS` strikes, in turn: the driver killed, a
rollout pod deleted, the API server restarted, etcd restarted, the trainer's node drained.
After each, the soak waits for the job to train again (`Plan.recovery_timeout`) and records how
long that took and what it cost. Every `SAMPLE_INTERVAL_S` it samples the operator's and the
trainer's (the policy rank's actor and the driver) resident memory, open file descriptors and
threads, and the objects the job owns. At the end the job is deleted and whatever it owned and
is still there after `ORPHAN_TIMEOUT_S` is an orphan.

Figures (`run`'s dictionary):

* ``faults_injected``, ``faults_recovered`` (trained again within the timeout);
* ``steps_lost``: over every restart, the steps between the newest checkpoint when the fault
  struck and the one the next attempt resumed from (0: never an older checkpoint than needed);
* ``goodput``: the kept steps' training time (``step_seconds`` of the step log, the last
  attempt's record of each step) over the wall time from the first step to the end; where the
  rest went: ``retrained_s`` (steps trained again after a restart), ``recovering_s`` (from a
  fault to the first step after it, less what was trained meanwhile), ``between_steps_s``;
* ``operator_rss_growth_mb_per_hour``: the slope of a least-squares line through the
  operator's RSS after the first `WARMUP_FRACTION` of the run; ``trainer_rss_growth_mb_per_hour``
  the largest such slope of the policy rank's actor over its lifetimes of at least
  `MIN_SEGMENT_S` (a drain replaces it; None in a shorter run);
* ``operator_growth``: the operator's open file descriptors and threads, last sample less the
  first (a short run's leak check, where an RSS slope says little);
* ``orphans``: objects labelled with the job left after its deletion.

The job's driver, ranks and operator import the checkout they run from (the virtual
environment installs it editable), and a restart imports it again: run a long soak from a
clone you do not edit meanwhile (`git clone . /tmp/soak && cd /tmp/soak && task soak`). One run
that shared its checkout with a change to the API's models had its restarted driver under
another spec digest, which found the actors the killed one left invisible (that case is now
handled: `rlhf_trainer.ranks.adoption.kill_actors_of_other_specs`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlhf_local import cluster, faults, procs
from rlhf_local.faults import TrainingRecord
from rlhf_local.harness import wait_for
from rlhf_local.jobs import Jobs
from rlhf_local.session import Session
from rlhf_operator.names import LABEL_JOB
from rlhfjob.contract.kuberay import RAY_CLUSTERS, RAY_GROUP, RAY_VERSION

CHECKPOINT_INTERVAL = 20
SAMPLE_INTERVAL_S = 30.0
ORPHAN_TIMEOUT_S = 300.0
WARMUP_FRACTION = 0.1
MIN_SEGMENT_S = 900.0
ROLLOUT_ENGINES = 2
"""The job's rollout engines (`fault_job`): a step with all of them is fully recovered."""
STEPS_IN_OUTAGE = 5
"""Steps the trainer must log while the API server or etcd is down (training goes on)."""
NAME = "soak"


def say(message: str) -> None:
    print(f"[soak {datetime.now(UTC):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Plan:
    """How long the soak runs and how often, how soon and which faults strike."""

    minutes: float
    fault_interval: float
    """Minutes between faults."""
    faults: tuple[str, ...] = ()
    """`FAULTS` by name, struck in turn (all of them when empty)."""
    first_fault: float | None = None
    """Minutes from the first step to the first fault (`fault_interval` when None)."""
    recovery_timeout: float = 600.0
    """Seconds a fault may take to recover before it counts as not recovered."""

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")

    @property
    def in_turn(self) -> tuple[str, ...]:
        return self.faults or tuple(FAULTS)


# ---------------------------------------------------------------------------------------------
# Processes


def proc_stats(pid: int) -> dict[str, float] | None:
    """RSS (MiB), open file descriptors and threads of a live process; None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
        "fds": fds,
        "threads": int(fields["Threads"]),
    }


def policy_rank_pid() -> int | None:
    """The policy rank's actor process (Ray titles it `ray::PolicyWorker...`)."""
    found = procs.find_by_cmdline("ray::PolicyWorker")
    return found[0] if found else None


def driver_pid(jobs: Jobs) -> int | None:
    with contextlib.suppress(Exception):
        status = jobs.status(NAME)
        return faults.driver_pid(jobs.dashboard(NAME), status["submissionId"], jobs.ray_token(NAME))
    return None


def owned_objects(jobs: Jobs) -> dict[str, int]:
    """The job's objects by kind (what carries its label), the RayCluster included."""
    selector = f"{LABEL_JOB}={NAME}"
    core, ns = jobs.lc.core, jobs.namespace
    counts = {
        "pods": len(core.list_namespaced_pod(ns, label_selector=selector).items),
        "services": len(core.list_namespaced_service(ns, label_selector=selector).items),
        "configmaps": len(core.list_namespaced_config_map(ns, label_selector=selector).items),
        "secrets": len(core.list_namespaced_secret(ns, label_selector=selector).items),
        "serviceaccounts": len(
            core.list_namespaced_service_account(ns, label_selector=selector).items
        ),
    }
    clusters: Any = jobs.lc.custom.list_namespaced_custom_object(
        RAY_GROUP, RAY_VERSION, ns, RAY_CLUSTERS, label_selector=selector
    )
    counts["rayclusters"] = len(clusters["items"])
    return counts


# ---------------------------------------------------------------------------------------------
# Faults


@dataclass
class Soak:
    session: Session
    plan: Plan
    jobs: Jobs
    record: TrainingRecord
    samples: list[dict[str, Any]] = field(default_factory=list)

    def last_step_time(self) -> float:
        records = self.record.records()
        return float(records[-1]["time"]) if records else 0.0

    def steps_after(self, when: float) -> list[dict[str, Any]]:
        return [r for r in self.record.records() if float(r["time"]) > when]

    def attempt(self) -> int:
        attempts = self.record.steps_by_attempt()
        return max(attempts) if attempts else 0


def _kill_driver(soak: Soak) -> str:
    return f"SIGKILL to driver {faults.kill_driver(soak.jobs, NAME)}"


def _delete_rollout_pod(soak: Soak) -> str:
    return f"deleted {faults.delete_pod(soak.jobs, NAME, 'rollout')}"


def _outage(component: str) -> Callable[[Soak], str]:
    def strike(soak: Soak) -> str:
        started = time.time()
        with cluster.stopped(component, echo=False):
            wait_for(
                lambda: len(soak.steps_after(started)) >= STEPS_IN_OUTAGE,
                120,
                f"{STEPS_IN_OUTAGE} steps trained while {component} is down",
            )
        return f"{component} stopped for {time.time() - started:.1f} s, training went on"

    return strike


def _drain_trainer_node(soak: Soak) -> str:
    with faults.node_drain(soak.jobs, NAME) as (node, drain):
        output, _ = drain.communicate(timeout=soak.plan.recovery_timeout)
        if drain.returncode != 0:
            raise RuntimeError(f"kubectl drain {node}: {output}")
    return f"drained {node}"


FAULTS: dict[str, Callable[[Soak], str]] = {
    "kill_driver": _kill_driver,
    "delete_rollout_pod": _delete_rollout_pod,
    "api_server_restart": _outage("kube-apiserver"),
    "etcd_restart": _outage("etcd"),
    "node_drain": _drain_trainer_node,
}


@dataclass
class FaultResult:
    fault: str
    at: float
    what: str = ""
    recovered: bool = False
    recovered_s: float | None = None
    """From the fault to the job's recovery (`recovered_at`)."""
    restarted: bool = False
    newest_checkpoint: int | None = None
    resumed_from: int | None = None
    steps_lost: int = 0
    error: str | None = None


RESTARTING = ("kill_driver",)
"""Faults after which a new driver attempt (a higher attempt number) trains."""
MOVING = ("node_drain",)
"""Faults after which the job trains on another cluster from the drain's checkpoint, under the
same attempt number (a drain is no restart): its driver stopped before the drain returned."""
OUTAGES = ("api_server_restart", "etcd_restart")
"""Faults of the control plane: training goes on, the operator must catch up afterwards."""


def recovered_at(soak: Soak, name: str, attempt: int, since: float, over: float) -> float | None:
    """When the job showed it recovered from fault `name` (struck at `since`, over at `over`),
    if it has: a new attempt's first step; after a drain, the first step logged once it was
    over; a step with every rollout engine again after one with fewer; the operator reporting
    a step logged after the control plane came back."""
    later = soak.steps_after(since)
    if name in RESTARTING:
        later = [r for r in later if int(r.get("attempt", 0)) > attempt]
    elif name in MOVING:
        later = soak.steps_after(over)
    elif name == "delete_rollout_pod":
        engines = [int(r.get("rollout_engines", ROLLOUT_ENGINES)) for r in later]
        degraded = next((i for i, n in enumerate(engines) if n < ROLLOUT_ENGINES), None)
        later = (
            []
            if degraded is None
            else [r for r in later[degraded:] if r.get("rollout_engines") == ROLLOUT_ENGINES]
        )
    elif name in OUTAGES:
        back = soak.steps_after(over)  # steps logged with the control plane back
        seen = soak.jobs.status(NAME).get("currentStep") or 0
        return time.time() if back and seen >= int(back[0]["step"]) else None
    return float(later[0]["time"]) if later else None


def strike(soak: Soak, name: str) -> FaultResult:
    """Inject one fault and wait until the job trains again."""
    result = FaultResult(name, time.time())
    attempt, checkpoint = soak.attempt(), soak.record.newest_checkpoint()
    try:
        result.what = FAULTS[name](soak)
        over = time.time()
        at = wait_for(
            lambda: recovered_at(soak, name, attempt, result.at, over),
            soak.plan.recovery_timeout,
            f"{NAME} to recover from {name}",
        )
        result.recovered = True
        result.recovered_s = round(at - result.at, 2)
    except Exception as error:  # a fault that does not recover is a finding, not a crash
        result.error = f"{type(error).__name__}: {error}"[:500]
    if soak.attempt() > attempt:
        result.restarted = True
        result.newest_checkpoint = checkpoint
        result.resumed_from = soak.record.steps_by_attempt()[soak.attempt()][0] - 1
        # A checkpoint written after `checkpoint` was read only makes the resume newer.
        result.steps_lost = max(0, (checkpoint or 0) - result.resumed_from)
    say(f"{name}: {asdict(result)}")
    return result


# ---------------------------------------------------------------------------------------------
# Figures


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread * 3600


def operator_growth(samples: list[dict[str, Any]], started: float, ended: float) -> float | None:
    warm = started + WARMUP_FRACTION * (ended - started)
    points = [
        (s["t"], s["operator"]["rss_mb"]) for s in samples if s["t"] >= warm and s["operator"]
    ]
    return slope_per_hour(points)


def trainer_growth(samples: list[dict[str, Any]]) -> tuple[float | None, list[dict[str, Any]]]:
    """The largest RSS slope of the policy rank over its lifetimes of at least MIN_SEGMENT_S."""
    segments: dict[int, list[tuple[float, float]]] = {}
    for sample in samples:
        rank = sample.get("policy_rank")
        if rank:
            segments.setdefault(rank["pid"], []).append((sample["t"], rank["rss_mb"]))
    report = []
    for pid, points in segments.items():
        seconds = points[-1][0] - points[0][0]
        # Leave out its first minutes: the allocator's pools fill during the first steps.
        settled = [p for p in points if p[0] >= points[0][0] + WARMUP_FRACTION * seconds]
        slope = slope_per_hour(settled) if seconds >= MIN_SEGMENT_S else None
        report.append({"pid": pid, "seconds": round(seconds), "slope_mb_per_hour": slope})
    slopes = [r["slope_mb_per_hour"] for r in report if r["slope_mb_per_hour"] is not None]
    return (max(slopes) if slopes else None), report


def goodput(
    records: list[dict[str, Any]], struck: list[FaultResult], ended: float
) -> dict[str, Any]:
    """Kept training time over wall time, and where the rest went."""
    if not records:
        return {"goodput": None}
    kept: dict[int, dict[str, Any]] = {}
    for record in records:  # later attempts overwrite: the last record of a step is kept
        kept[int(record["step"])] = record
    total_step_s = sum(float(r["step_seconds"]) for r in records)
    kept_s = sum(float(r["step_seconds"]) for r in kept.values())
    started = float(records[0]["time"]) - float(records[0]["step_seconds"])
    wall = ended - started
    recovering = 0.0
    for fault in struck:
        if fault.recovered_s is None:
            continue
        trained = sum(
            float(r["step_seconds"])
            for r in records
            if fault.at < float(r["time"]) <= fault.at + fault.recovered_s
        )
        recovering += max(0.0, fault.recovered_s - trained)
    return {
        "goodput": round(kept_s / wall, 4),
        "wall_s": round(wall, 1),
        "kept_training_s": round(kept_s, 1),
        "retrained_s": round(total_step_s - kept_s, 1),
        "recovering_s": round(recovering, 1),
        "between_steps_s": round(wall - total_step_s - recovering, 1),
        "steps_kept": len(kept),
        "steps_trained": len(records),
    }


# ---------------------------------------------------------------------------------------------
# The run


def sample(soak: Soak, started: float) -> None:
    operator = soak.session.operator.process
    rank = policy_rank_pid()
    driver = driver_pid(soak.jobs)
    entry: dict[str, Any] = {
        "t": round(time.time() - started, 1),
        "step": soak.record.last_step(),
        "operator": proc_stats(operator.pid) if operator else None,
        "policy_rank": {"pid": rank, **(proc_stats(rank) or {})} if rank else None,
        "driver": {"pid": driver, **(proc_stats(driver) or {})} if driver else None,
    }
    with contextlib.suppress(Exception):  # the API server may be the fault of the moment
        entry["owned"] = owned_objects(soak.jobs)
    soak.samples.append(entry)


@contextlib.contextmanager
def sampling(soak: Soak, started: float) -> Iterator[Callable[[], None]]:
    """`tick()` samples when a sample is due; the faults run between ticks."""
    due = [0.0]

    def tick() -> None:
        if time.time() >= due[0]:
            sample(soak, started)
            due[0] = time.time() + SAMPLE_INTERVAL_S

    yield tick
    sample(soak, started)


def process_growth(samples: list[dict[str, Any]], process: str) -> dict[str, float] | None:
    """The last sample's open file descriptors and threads of `process` less the first's."""
    seen = [s[process] for s in samples if s.get(process) and "fds" in s[process]]
    if len(seen) < 2:
        return None
    return {key: seen[-1][key] - seen[0][key] for key in ("fds", "threads")}


def run(session: Session, plan: Plan) -> dict[str, Any]:
    """Soak one job in `session`'s namespace as `plan` says; the figures (module docstring)."""
    jobs = Jobs(session.lc, session.namespace)
    manifest = faults.fault_job(
        NAME,
        session.namespace,
        session.workdir / "checkpoints",
        algorithm={"totalSteps": 10**6},
        checkpoint={"intervalSteps": CHECKPOINT_INTERVAL, "keepLast": 3},
        recovery={"maxRestarts": 1000, "backoffSeconds": 1, "maxBackoffSeconds": 30},
    )
    soak = Soak(session, plan, jobs, TrainingRecord.of(manifest))
    applied = time.time()
    jobs.create(manifest)
    wait_for(lambda: soak.record.records(), plan.recovery_timeout, "the first step")
    say(f"training after {time.time() - applied:.1f} s; soaking {plan.minutes:g} min")
    started = time.time()
    end = started + plan.minutes * 60
    first = plan.fault_interval if plan.first_fault is None else plan.first_fault
    results: list[FaultResult] = []
    with sampling(soak, started) as tick:
        next_fault = started + first * 60
        while time.time() < end:
            tick()
            if time.time() >= next_fault and time.time() < end - 60:
                results.append(strike(soak, plan.in_turn[len(results) % len(plan.in_turn)]))
                next_fault += plan.fault_interval * 60
            time.sleep(1)  # the soak's own pace (sampling and fault schedule), no sync
    ended = time.time()
    records = soak.record.records()
    figures = goodput(records, results, ended)
    jobs.delete(NAME)

    def gone() -> bool:
        return not any(owned_objects(jobs).values())

    with contextlib.suppress(Exception):
        wait_for(gone, ORPHAN_TIMEOUT_S, "the job's objects to go")
    left = owned_objects(jobs)
    trainer_slope, segments = trainer_growth(soak.samples)
    problems = soak.record.lineage_problems(
        [r.resumed_from for r in results if r.restarted], soak.record.last_step()
    )
    return {
        "hours": round((ended - started) / 3600, 3),
        "fault_interval_minutes": plan.fault_interval,
        "faults_injected": len(results),
        "faults_recovered": sum(r.recovered for r in results),
        "steps_lost": sum(r.steps_lost for r in results),
        "lineage_problems": problems,
        **figures,
        "operator_rss_growth_mb_per_hour": operator_growth(soak.samples, 0, ended - started),
        "trainer_rss_growth_mb_per_hour": trainer_slope,
        "operator_growth": process_growth(soak.samples, "operator"),
        "trainer_segments": segments,
        "orphans": sum(left.values()),
        "orphans_by_kind": left,
        "faults": [asdict(r) for r in results],
        "samples": soak.samples,
    }
