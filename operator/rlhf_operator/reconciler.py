"""Observe → decide → act for one RLHFJob (design decision 2).

`Reconciler.reconcile` reads the world (the job, its RayCluster, the current Ray job, the
heartbeat Lease) through its two ports (`Observer`), asks the pure lifecycle policy what to do
(`lifecycle.decide`), does it (`PlanExecutor`), and writes the status. It is safe to call at any
time and any number of times: kopf's handlers and timer only ever "kick" it. When an action
fails in a way the policy knows about (a submission that Ray refused, an object the API server
refused), that is observed and decided again; the reconciler never edits a plan.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from rlhf_operator.executor import EventSink, PlanExecutor
from rlhf_operator.lifecycle import CLUSTER_READY, Plan, decide
from rlhf_operator.metrics import OperatorMetrics
from rlhf_operator.network import NetworkSettings
from rlhf_operator.observer import Observer
from rlhf_operator.policy import JobPolicy
from rlhf_operator.ports import KubePort, RayJobsPort
from rlhf_operator.ray_auth import RayAuth
from rlhf_operator.views import Observed
from rlhfjob.api import Phase, RestartRecord, RLHFJob, RLHFJobStatus
from rlhfjob.api.base import json_size
from rlhfjob.config import InvalidJobError, UnknownFieldsError, parse_job

log = logging.getLogger("rlhf_operator")

MAX_DECISIONS = 3
"""Decisions per reconcile: the first, and one per action that failed in a known way (each
decision knows the failures before it, so the policy never plans the same failed action)."""
PARSE_CACHE_BYTES = 4 * 1024 * 1024
"""The spec bytes (as JSON) the parse cache keeps: some 80 MB of parsed jobs at most, a
thousand jobs of a few KiB."""
PARSE_CACHE_ENTRY_BYTES = 32 * 1024
"""A spec larger than this is not kept (parsing it again costs a few tens of milliseconds)."""
OUTDATED_RETRY_SECONDS = 60.0
"""How often a job with fields this operator does not know is looked at again (an upgraded
operator is a new process, so this only bounds a stale watch)."""


class Reconciler:
    """One operator's reconciles: a lock per job, the observer, the policy, the executor."""

    def __init__(
        self,
        kube: KubePort,
        ray_jobs: RayJobsPort,
        metrics: OperatorMetrics,
        emit: EventSink,
        ray_auth: RayAuth,
        policy: JobPolicy | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        dashboard_from_annotation: bool = False,
        network: NetworkSettings | None = None,
    ) -> None:
        """`dashboard_from_annotation` is a test hook (off in the chart): the dashboard is asked
        where the RayCluster's annotation says, as the local stand-in Ray publishes it, instead
        of at the head Service. Anyone who may annotate a RayCluster could point it elsewhere
        and be sent the job's Ray token, so a real operator never trusts it."""
        self.policy = policy or JobPolicy()
        self.metrics = metrics
        self.observer = Observer(
            kube, ray_jobs, ray_auth, clock, dashboard_from_annotation=dashboard_from_annotation
        )
        network = network or self.policy.network
        network = network or NetworkSettings(operator_namespace=self.policy.operator_namespace)
        # One source for both: the policies the job gets and the destinations it may name.
        self.policy = replace(self.policy, network=network)
        self.executor = PlanExecutor(kube, ray_jobs, ray_auth, metrics, emit, network)
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._phases: dict[tuple[str, str], str] = {}
        self._parsed = ParseCache()
        """Each job as last parsed: a job the timer finds unchanged is not validated again
        (most of a quiet reconcile's CPU)."""

    @property
    def dashboard_asks(self) -> int:
        """How many times a dashboard was asked for a job's state (for tests and benchmarks)."""
        return self.observer.dashboard_asks

    async def reconcile(self, namespace: str, name: str) -> float | None:
        """Bring one job one step closer to what it asks for; returns seconds until due again."""
        key = (namespace, name)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            started = time.perf_counter()
            try:
                delay = await self._reconcile(namespace, name)
            except Exception:
                self.metrics.reconciles.labels(result="error").inc()
                raise
            finally:
                self.metrics.reconcile_seconds.observe(time.perf_counter() - started)
            self.metrics.reconciles.labels(result="ok").inc()
            return delay

    def forget(self, namespace: str, name: str) -> None:
        self._locks.pop((namespace, name), None)
        self._parsed.pop((namespace, name))
        self._phases.pop((namespace, name), None)
        self.observer.forget(namespace, name)
        self._update_phase_gauge()
        self.metrics.forget_job(namespace, name)

    async def _reconcile(self, namespace: str, name: str) -> float | None:
        body = await self.observer.read_job(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return None
        try:
            job = await self._parse(body, f"{namespace}/{name}")
        except UnknownFieldsError as error:
            await self.executor.mark_outdated(body, error)
            return OUTDATED_RETRY_SECONDS
        except InvalidJobError as error:
            await self.executor.reject(body, error)
            return None
        pending = job.status is None or job.status.phase == Phase.PENDING
        problems = self.policy.problems(job)
        # Before any cluster exists: a job that breaks the policy never gets one. Later, the
        # lifecycle fails it and deletes its cluster (`ending.fail_policy`).
        if pending and problems:
            await self.executor.reject(body, InvalidJobError(f"{namespace}/{name}", problems))
            return None
        seen = replace(await self.observer.observe(job, body), policy_problems=tuple(problems))
        plan = decide(seen)
        for decision in range(1, MAX_DECISIONS + 1):
            news = await self.executor.act(job, body, seen, plan)
            if news is None:
                break
            if decision == MAX_DECISIONS:  # the policy planned an action it knew had failed
                log.error("%s/%s: an action failed again after %d decisions",
                          namespace, name, decision)  # fmt: skip
                break
            seen, plan = news, decide(news)  # it did not happen after all: news for the policy
        await self.executor.write_status(job, body, plan.status)
        self._record_metrics(job, seen, plan)
        self.observer.remember_silence(job, seen, plan)
        return plan.requeue_after

    async def _parse(self, body: dict[str, Any], source: str) -> RLHFJob:
        """`parse_job`, once per version of the object (the API server gives every change a
        new resourceVersion), off the event loop: validating a spec takes about a millisecond
        per KiB (its CEL rules), and the loop serves every job's handlers meanwhile. The
        parsed job is only read, never changed."""
        metadata = body["metadata"]
        key = (metadata.get("namespace", "default"), metadata["name"])
        version = (metadata.get("uid"), metadata.get("resourceVersion"))
        if (cached := self._parsed.get(key, version)) is not None:
            return cached
        job, size = await asyncio.to_thread(_parse_sized, body, source)
        self._parsed.put(key, version, job, size)
        return job

    def _record_metrics(self, job: RLHFJob, seen: Observed, plan: Plan) -> None:
        before = job.status or RLHFJobStatus()
        after = plan.status
        age = (seen.now - seen.created).total_seconds()
        provisioning = (Phase.PENDING, Phase.PROVISIONING)
        if before.phase in provisioning and _condition_true(after, CLUSTER_READY):
            self.metrics.cluster_ready_seconds.observe(age)
        if after.current_step is not None and before.current_step is None:
            self.metrics.first_step_seconds.observe(age)
        if after.restart_count > before.restart_count and after.restart_history:
            record = after.restart_history[-1]
            self.metrics.record_restart(job, record.reason)
            if record.detection_seconds is not None:
                self.metrics.detection_seconds.labels(reason=record.reason).observe(
                    record.detection_seconds
                )
        if (resumed := _newly_resumed(before, after)) is not None:
            assert resumed.resumed_time is not None
            seconds = (resumed.resumed_time - resumed.failure_time).total_seconds()
            self.metrics.recovery_seconds.labels(reason=resumed.reason).observe(seconds)
        self._phases[(job.metadata.namespace, job.metadata.name)] = after.phase.value
        self._update_phase_gauge()
        self.metrics.observe_job(job, after)

    def _update_phase_gauge(self) -> None:
        counts: dict[str, int] = {}
        for phase in self._phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        self.metrics.set_phase_counts(counts)


def _parse_sized(body: dict[str, Any], source: str) -> tuple[RLHFJob, int]:
    """The parsed job and the size of its spec as JSON (what `ParseCache` counts)."""
    return parse_job(body, source), json_size(body.get("spec")) or 0


class ParseCache:
    """Jobs as last parsed, by (namespace, name) and the (uid, resourceVersion) parsed at,
    bounded: a parsed job takes some twenty times its spec's JSON in memory, and a spec may
    take 128 KiB (`api.MAX_SPEC_BYTES`), so a spec above `max_entry_bytes` is parsed at every
    reconcile instead of kept, and past `max_bytes` the job reconciled longest ago goes."""

    def __init__(
        self, max_bytes: int = PARSE_CACHE_BYTES, max_entry_bytes: int = PARSE_CACHE_ENTRY_BYTES
    ) -> None:
        self.max_bytes, self.max_entry_bytes = max_bytes, max_entry_bytes
        self._entries: OrderedDict[tuple[str, str], tuple[tuple[Any, Any], RLHFJob, int]] = (
            OrderedDict()
        )
        self.bytes = 0
        """The JSON bytes of the specs kept."""

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[str, str], version: tuple[Any, Any]) -> RLHFJob | None:
        """The job parsed at `version` (None without a resourceVersion: nothing to compare)."""
        entry = self._entries.get(key)
        if entry is None or version[1] is None or entry[0] != version:
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, key: tuple[str, str], version: tuple[Any, Any], job: RLHFJob, size: int) -> None:
        """Keep `job` (its spec `size` bytes as JSON) in place of the key's earlier version."""
        self.pop(key)
        if size > self.max_entry_bytes:
            return
        self._entries[key] = (version, job, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped

    def pop(self, key: tuple[str, str]) -> None:
        if (entry := self._entries.pop(key, None)) is not None:
            self.bytes -= entry[2]


def _newly_resumed(before: RLHFJobStatus, after: RLHFJobStatus) -> RestartRecord | None:
    """The restart whose first resumed step this reconcile noticed, if any."""
    if not after.restart_history or after.restart_history[-1].resumed_time is None:
        return None
    last = after.restart_history[-1]
    old = next((r for r in before.restart_history if r.time == last.time), None)
    return last if old is None or old.resumed_time is None else None


def _condition_true(status: RLHFJobStatus, type_: str) -> bool:
    return any(c.type == type_ and c.status == "True" for c in status.conditions)
