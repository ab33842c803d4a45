"""Observe → decide → act for one RLHFJob (design decision 2).

`Reconciler.reconcile` reads the world (the job, its RayCluster, the current Ray job, the
heartbeat Lease), asks the pure policy what to do, does it, and writes the status. It is safe to
call at any time and any number of times: kopf's handlers and timer only ever "kick" it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

from rlhf_operator import builder
from rlhf_operator.kube import Kube, parse_time
from rlhf_operator.metrics import OperatorMetrics
from rlhf_operator.policy import (
    CLUSTER_READY,
    DASHBOARD_REACHABLE,
    ApplyCluster,
    ClusterView,
    DeleteCluster,
    DeleteJob,
    Event,
    HeartbeatView,
    Observed,
    Plan,
    RoleView,
    StopRayJob,
    SubmitRayJob,
    decide,
    submission_id,
)
from rlhf_operator.rayjobs import RayJobClient
from rlhfjob import contract
from rlhfjob.api import Condition, Phase, RestartRecord, RLHFJob, RLHFJobStatus
from rlhfjob.config import InvalidJobError, parse_job
from rlhfjob.contract import LeaseReport, PodEnv

log = logging.getLogger("rlhf_operator")


EventSink = Callable[[dict[str, Any], Event], None]
STATUS_FIELDS = frozenset(field.alias or name for name, field in RLHFJobStatus.model_fields.items())
"""The status keys the operator owns (anything else there, it leaves alone)."""
EVENT_MESSAGE_LIMIT = 1024
"""The API server rejects longer Event messages."""


def heartbeat_from_lease(lease: Any) -> HeartbeatView | None:
    """Read the trainer's Lease; unreadable annotations count as missing, never as a crash."""
    if lease is None or lease.spec is None or lease.spec.renew_time is None:
        return None
    renewed = lease.spec.renew_time
    if renewed.tzinfo is None:
        renewed = renewed.replace(tzinfo=UTC)
    report = LeaseReport.from_annotations(lease.metadata.annotations or {})
    return HeartbeatView(renewed=renewed, **vars(report))


def _pod_ready(pod: Any) -> bool:
    if pod.metadata.deletion_timestamp is not None or pod.status is None:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def role_views(cluster: dict[str, Any], pods: list[Any]) -> dict[str, RoleView]:
    """Ready worker pods per group against the group's replicas (one group per role)."""
    ready: dict[str, int] = {}
    for pod in pods:
        labels = pod.metadata.labels or {}
        if labels.get("ray.io/node-type") == "worker" and _pod_ready(pod):
            group = labels.get("ray.io/group", "")
            ready[group] = ready.get(group, 0) + 1
    return {
        group["groupName"]: RoleView(ready.get(group["groupName"], 0), group.get("replicas", 0))
        for group in cluster.get("spec", {}).get("workerGroupSpecs") or []
    }


def scheduling_problem(pods: list[Any]) -> str | None:
    """The scheduler's message for a pod of the cluster it could not place, if any."""
    for pod in pods:
        for condition in (pod.status.conditions if pod.status else None) or []:
            if condition.type == "PodScheduled" and condition.status == "False":
                return f"pod {pod.metadata.name}: {condition.message or condition.reason}"
    return None


def head_created(pods: list[Any]) -> datetime | None:
    """Creation time of the newest head pod that is not being deleted."""
    times = [
        pod.metadata.creation_timestamp
        for pod in pods
        if (pod.metadata.labels or {}).get("ray.io/node-type") == "head"
        and pod.metadata.deletion_timestamp is None
        and pod.metadata.creation_timestamp is not None
    ]
    return max(times) if times else None


def head_not_ready_since(cluster: dict[str, Any]) -> datetime | None:
    """From KubeRay's HeadPodReady condition: since when the head is not Ready (None: it is)."""
    for condition in (cluster.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "HeadPodReady" and condition.get("status") == "False":
            return parse_time(condition.get("lastTransitionTime")) or datetime.now(UTC)
    return None


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        ray_jobs: RayJobClient,
        metrics: OperatorMetrics,
        emit: EventSink,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.kube = kube
        self.ray_jobs = ray_jobs
        self.metrics = metrics
        self.emit = emit
        self.clock = clock
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._phases: dict[tuple[str, str], str] = {}

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
        self._phases.pop((namespace, name), None)
        self._update_phase_gauge()

    async def _reconcile(self, namespace: str, name: str) -> float | None:
        body = await self.kube.get_job(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return None
        try:
            job = parse_job(body, f"{namespace}/{name}")
        except InvalidJobError as error:
            await self._reject(body, error)
            return None
        seen = await self.observe(job, body)
        plan = decide(seen)
        await self.act(job, body, seen, plan)
        await self._write_status(job, body, plan.status)
        self._record_metrics(job, seen, plan)
        return plan.requeue_after

    async def observe(self, job: RLHFJob, body: dict[str, Any]) -> Observed:
        namespace = job.metadata.namespace
        now = self.clock()
        created = parse_time(body["metadata"].get("creationTimestamp")) or now
        status = job.status or RLHFJobStatus()
        cluster_body = await self.kube.get_ray_cluster(namespace, builder.ray_cluster_name(job))
        pods = []
        if cluster_body is not None:
            pods = await self.kube.cluster_pods(namespace, cluster_body["metadata"]["name"])
        cluster = self._cluster_view(job, cluster_body, pods)
        ray_job = previous_ray_job = dashboard_error = problem = None
        attempt = submission_id(job, status.restart_count)
        if cluster and cluster.ready and not cluster.deleting and cluster.dashboard:
            try:
                ray_job = await self.ray_jobs.status(cluster.dashboard, attempt)
                if ray_job is None and status.restart_count > 0:
                    previous = submission_id(job, status.restart_count - 1)
                    previous_ray_job = await self.ray_jobs.status(cluster.dashboard, previous)
            except Exception as error:  # any failure to talk to Ray is "unreachable"
                dashboard_error = str(error) or type(error).__name__
        elif cluster and not cluster.ready:
            problem = scheduling_problem(pods)
        lease = await self.kube.get_lease(namespace, builder.heartbeat_lease_name(job))
        return Observed(
            job=job,
            now=now,
            created=created,
            cluster=cluster,
            ray_job=ray_job,
            previous_ray_job=previous_ray_job,
            dashboard_error=dashboard_error,
            heartbeat=heartbeat_from_lease(lease),
            scheduling_problem=problem,
        )

    @staticmethod
    def _cluster_view(
        job: RLHFJob, body: dict[str, Any] | None, pods: list[Any]
    ) -> ClusterView | None:
        if body is None:
            return None
        metadata = body["metadata"]
        annotations = metadata.get("annotations") or {}
        return ClusterView(
            name=metadata["name"],
            created=parse_time(metadata.get("creationTimestamp")) or datetime.now(UTC),
            ready=(body.get("status") or {}).get("state") == "ready",
            deleting=bool(metadata.get("deletionTimestamp")),
            dashboard=annotations.get(contract.DASHBOARD_ANNOTATION) or builder.dashboard_url(job),
            head_not_ready_since=head_not_ready_since(body),
            head_created=head_created(pods),
            roles=role_views(body, pods),
        )

    async def act(self, job: RLHFJob, body: dict[str, Any], seen: Observed, plan: Plan) -> None:
        namespace, name = job.metadata.namespace, job.metadata.name
        dashboard = seen.cluster.dashboard if seen.cluster else None
        for action in plan.actions:
            match action:
                case ApplyCluster():
                    for manifest in builder.build_owned_objects(job):
                        await self.kube.apply(manifest)
                    await self.kube.create_if_missing(builder.build_heartbeat_lease(job))
                case DeleteCluster(reason=reason):
                    log.info("%s/%s: deleting RayCluster (%s)", namespace, name, reason)
                    await self.kube.delete_ray_cluster(namespace, builder.ray_cluster_name(job))
                case SubmitRayJob():
                    assert dashboard is not None
                    await self._submit(job, dashboard, action, plan)
                case StopRayJob(submission_id=stopped) if dashboard:
                    try:
                        await self.ray_jobs.stop(dashboard, stopped)
                    except Exception as error:
                        log.warning("%s/%s: could not stop %s: %s", namespace, name, stopped, error)
                case DeleteJob():
                    log.info("%s/%s: ttlSecondsAfterFinished passed, deleting", namespace, name)
                    await self.kube.delete_job(namespace, name)
        for event in plan.events:
            if len(event.message) > EVENT_MESSAGE_LIMIT:
                event = Event(
                    event.type, event.reason, event.message[: EVENT_MESSAGE_LIMIT - 3] + "..."
                )
            self.emit(body, event)

    async def _submit(self, job: RLHFJob, dashboard: str, action: SubmitRayJob, plan: Plan) -> None:
        attempt = str(job.status.restart_count if job.status else 0)
        env = PodEnv(
            job_name=job.metadata.name, job_namespace=job.metadata.namespace, attempt=int(attempt)
        ).to_env()
        metadata = {"rlhfjob": job.metadata.name, "attempt": attempt}
        self.metrics.submissions.inc()
        try:
            await self.ray_jobs.submit(
                dashboard,
                action.submission_id,
                contract.train_command(job, resume=action.resume),
                env=env,
                metadata=metadata,
            )
        except Exception as error:
            # Not submitted: keep the previous phase and say why; the next reconcile retries.
            self.metrics.submission_failures.inc()
            previous = job.status or RLHFJobStatus()
            plan.status.phase = previous.phase
            plan.status.submission_id = previous.submission_id
            plan.status.message = f"could not submit the trainer: {error}"
            plan.events[:] = [e for e in plan.events if e.reason != "Submitted"]
            _set_condition(plan.status, DASHBOARD_REACHABLE, "False", "SubmitFailed", str(error))
            plan.requeue_after = 5.0

    async def _write_status(
        self, job: RLHFJob, body: dict[str, Any], status: RLHFJobStatus
    ) -> None:
        new = status.wire()
        old = body.get("status") or {}
        if new != old:
            # A merge patch keeps keys it does not mention: null the ones that were cleared.
            cleared = {key: None for key in old if key not in new and key in STATUS_FIELDS}
            await self.kube.patch_job_status(
                job.metadata.namespace, job.metadata.name, {**cleared, **new}
            )

    async def _reject(self, body: dict[str, Any], error: InvalidJobError) -> None:
        """A job that slipped past the schema (older CRD, hand edit): Failed, with the reason."""
        metadata = body["metadata"]
        message = "invalid spec: " + "; ".join(error.problems)
        current = body.get("status") or {}
        if current.get("phase") == Phase.FAILED.value and current.get("message") == message:
            return
        log.warning("%s/%s: %s", metadata.get("namespace"), metadata["name"], message)
        await self.kube.patch_job_status(
            metadata.get("namespace", "default"),
            metadata["name"],
            {"phase": Phase.FAILED.value, "message": message[:32768]},
        )
        self.emit(body, Event("Warning", "InvalidSpec", message[:1024]))

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
            self.metrics.restarts.labels(reason=record.reason).inc()
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

    def _update_phase_gauge(self) -> None:
        counts: dict[str, int] = {}
        for phase in self._phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        self.metrics.set_phase_counts(counts)


def _newly_resumed(before: RLHFJobStatus, after: RLHFJobStatus) -> RestartRecord | None:
    """The restart whose first resumed step this reconcile noticed, if any."""
    if not after.restart_history or after.restart_history[-1].resumed_time is None:
        return None
    last = after.restart_history[-1]
    old = next((r for r in before.restart_history if r.time == last.time), None)
    return last if old is None or old.resumed_time is None else None


def _condition_true(status: RLHFJobStatus, type_: str) -> bool:
    return any(c.type == type_ and c.status == "True" for c in status.conditions)


def _set_condition(
    status: RLHFJobStatus,
    type_: str,
    value: Literal["True", "False", "Unknown"],
    reason: str,
    message: str,
) -> None:
    others = [c for c in status.conditions if c.type != type_]
    updated = Condition(
        type=type_,
        status=value,
        reason=reason,
        message=message[:32768],
        last_transition_time=datetime.now(UTC),
    )
    status.conditions = sorted([*others, updated], key=lambda c: c.type)
