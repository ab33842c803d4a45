"""Observe → decide → act for one RLHFJob (design decision 2).

`Reconciler.reconcile` reads the world (the job, its RayCluster, the current Ray job, the
heartbeat Lease) through its two ports, asks the pure lifecycle policy what to do, does it, and
writes the status. It is safe to call at any time and any number of times: kopf's handlers and
timer only ever "kick" it. When an action fails in a way the policy knows about (a submission
that Ray refused, an object the API server refused), that is observed and decided again; the
reconciler never edits a plan.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from rlhf_operator import builder, names, queueing
from rlhf_operator.builder import owner_reference
from rlhf_operator.lifecycle import (
    CLUSTER_READY,
    ApplyCluster,
    ApplyWorkload,
    ClearStopRequest,
    DeleteCluster,
    DeleteJob,
    Event,
    FinishWorkload,
    Plan,
    ReleaseQuota,
    RequestStop,
    SetPodsReady,
    SetWorkloadActive,
    StopRayJob,
    SubmitRayJob,
    decide,
)
from rlhf_operator.metrics import OperatorMetrics
from rlhf_operator.network import NetworkSettings
from rlhf_operator.policy import JobPolicy
from rlhf_operator.ports import (
    ApplyRefusedError,
    Dashboard,
    DashboardUnavailableError,
    KubePort,
    RayJobsPort,
)
from rlhf_operator.ray_auth import RayAuth
from rlhf_operator.texts import EVENT_MESSAGE_LIMIT, trim
from rlhf_operator.views import (
    NOT_OWNED,
    ApplyRefusal,
    ClusterView,
    Observed,
    RayJobView,
    apply_refusal,
    claim,
    cluster_view,
    cluster_warning,
    error_text,
    heartbeat_from_lease,
    parse_time,
    scheduling_problem,
    startup_problem,
    trainer_nodes,
)
from rlhfjob import contract
from rlhfjob.api import Phase, RestartRecord, RLHFJob, RLHFJobStatus
from rlhfjob.config import InvalidJobError, UnknownFieldsError, parse_job
from rlhfjob.contract import EventReason, FailureReason, PodEnv, kueue
from rlhfjob.contract import kuberay as ray
from rlhfjob.contract.lease import format_time

log = logging.getLogger("rlhf_operator")


EventSink = Callable[[dict[str, Any], Event], None]
STATUS_FIELDS = frozenset(field.alias or name for name, field in RLHFJobStatus.model_fields.items())
"""The status keys the operator owns (anything else there, it leaves alone)."""
CORDONED_NODES_TTL_SECONDS = 5.0
"""The cordoned nodes are listed once per this many seconds for all jobs (one cheap list: a
drain's checkpoint takes far longer than that)."""
"""The API server rejects longer Event messages."""
CREATED_ONCE = frozenset({"Lease", kueue.WORKLOAD_KIND})
"""Kinds the operator creates and then leaves to others: the trainer renews the Lease, Kueue
forbids changing a Workload's pod sets."""
MAX_DECISIONS = 3
"""Decisions per reconcile: the first, and one per action that failed in a known way (each
decision knows the failures before it, so the policy never plans the same failed action)."""
OUTDATED_RETRY_SECONDS = 60.0
"""How often a job with fields this operator does not know is looked at again (an upgraded
operator is a new process, so this only bounds a stale watch)."""


@dataclass(frozen=True)
class _SilentDashboard:
    """A dashboard that did not answer, and when the policy wants it asked again
    (`Plan.dashboard_retry_at`); until then reconciles reuse `error` instead of asking."""

    cluster: tuple[str, datetime, str, int | None]
    """The RayCluster (name, creation), the dashboard's address and the job's generation it
    was asked for: a new cluster, address or spec is asked at once."""
    error: str
    retry_at: datetime


class Reconciler:
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
        self.kube = kube
        self.dashboard_from_annotation = dashboard_from_annotation
        self.ray_jobs = ray_jobs
        self.ray_auth = ray_auth
        self.policy = policy or JobPolicy()
        self.network = network or NetworkSettings(operator_namespace=self.policy.operator_namespace)
        self.metrics = metrics
        self.emit = emit
        self.clock = clock
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._phases: dict[tuple[str, str], str] = {}
        self._silent: dict[tuple[str, str], _SilentDashboard] = {}
        self._parsed: dict[tuple[str, str], tuple[tuple[Any, Any], RLHFJob]] = {}
        """Each job as last parsed, by the uid and resourceVersion it was parsed at: a job the
        timer finds unchanged is not validated again (most of a quiet reconcile's CPU)."""
        self.dashboard_asks = 0
        """How many times a dashboard was asked for a job's state (for tests and benchmarks)."""
        self._cordoned: tuple[float, frozenset[str]] | None = None
        self._nodes_forbidden_logged = False

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
        self._parsed.pop((namespace, name), None)
        self._phases.pop((namespace, name), None)
        self._silent.pop((namespace, name), None)
        self._update_phase_gauge()
        self.metrics.forget_job(namespace, name)

    async def _reconcile(self, namespace: str, name: str) -> float | None:
        body = await self.kube.get_job(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return None
        try:
            job = self._parse(body, f"{namespace}/{name}")
        except UnknownFieldsError as error:
            await self._outdated(body, error)
            return OUTDATED_RETRY_SECONDS
        except InvalidJobError as error:
            await self._reject(body, error)
            return None
        pending = job.status is None or job.status.phase == Phase.PENDING
        problems = self.policy.problems(job)
        # Before any cluster exists: a job that breaks the policy never gets one. Later, the
        # lifecycle fails it and deletes its cluster (`ending.fail_policy`).
        if pending and problems:
            await self._reject(body, InvalidJobError(f"{namespace}/{name}", problems))
            return None
        seen = replace(await self.observe(job, body), policy_problems=tuple(problems))
        plan = decide(seen)
        for decision in range(1, MAX_DECISIONS + 1):
            news = await self.act(job, body, seen, plan)
            if news is None:
                break
            if decision == MAX_DECISIONS:  # the policy planned an action it knew had failed
                log.error("%s/%s: an action failed again after %d decisions",
                          namespace, name, decision)  # fmt: skip
                break
            seen, plan = news, decide(news)  # it did not happen after all: news for the policy
        await self._write_status(job, body, plan.status)
        self._record_metrics(job, seen, plan)
        self._remember_silence(job, seen, plan)
        return plan.requeue_after

    def _parse(self, body: dict[str, Any], source: str) -> RLHFJob:
        """`parse_job`, once per version of the object (the API server gives every change a
        new resourceVersion); the parsed job is only read, never changed."""
        metadata = body["metadata"]
        key = (metadata.get("namespace", "default"), metadata["name"])
        version = (metadata.get("uid"), metadata.get("resourceVersion"))
        cached = self._parsed.get(key)
        if cached is not None and version[1] is not None and cached[0] == version:
            return cached[1]
        job = parse_job(body, source)
        self._parsed[key] = (version, job)
        return job

    async def observe(self, job: RLHFJob, body: dict[str, Any]) -> Observed:
        """Read what can matter to the policy: the RayCluster; then, from what it says, at once:
        its pods and KubeRay's Warnings while it is not ready, or its pods, the Ray job (through
        its dashboard) and the heartbeat Lease once it is. Between the asks of a dashboard that
        does not answer, for a job with nothing submitted, only the job and its RayCluster can
        change the plan (there is no trainer to hear from): nothing more is read."""
        namespace = job.metadata.namespace
        now = self.clock()
        created = parse_time(body["metadata"].get("creationTimestamp")) or now
        status = job.status or RLHFJobStatus()
        name = names.ray_cluster_name(job)
        cluster_body = await self.kube.get_ray_cluster(namespace, name)
        foreign = None
        if cluster_body is not None and (found := claim(cluster_body, owner_reference(job))):
            # Not this job's cluster: never read through, submitted to, or deleted.
            reason = "Conflict" if found.earlier else NOT_OWNED
            foreign = ApplyRefusal(ray.RAY_CLUSTER_KIND, name, 409, reason, found.message)
            cluster_body = None
        ray_job = previous_ray_job = dashboard_error = problem = not_starting = warning = None
        ray_job_read = False
        lease = None
        pods: list[Any] | None = None  # None: not read this time (its views are unknown)
        # Ready, deleting and the dashboard come from the RayCluster alone.
        shell = cluster_view(
            job, cluster_body, [], now, dashboard_from_annotation=self.dashboard_from_annotation
        )
        queued = queueing.queue_name(job) is not None
        workload_body = None
        if shell is None and queued and foreign is None:
            # Kueue's quota goes back only once no pod is left (a deleted cluster's pods linger).
            pods, workload_body = await asyncio.gather(
                self.kube.cluster_pods(namespace, name),
                self.kube.get_workload(namespace, names.workload_name(job)),
            )
        elif shell is None:
            pass
        elif shell.ready and not shell.deleting and shell.dashboard:
            silent = self._silence(job, shell, now)
            if silent is not None and status.submission_id is None:
                dashboard_error = silent
            else:
                pods, lease, (ray_job, previous_ray_job, dashboard_error) = await asyncio.gather(
                    self.kube.cluster_pods(namespace, name),
                    self.kube.get_lease(namespace, names.heartbeat_lease_name(job)),
                    self._ask_dashboard(job, shell, status.restart_count, now),
                )
                ray_job_read = dashboard_error is None
        elif not shell.ready and not shell.deleting:
            # Why the pods are not there yet; read only now, so a ready cluster costs nothing.
            read, events = await asyncio.gather(
                self.kube.cluster_pods(namespace, name), self.kube.cluster_events(namespace, name)
            )
            problem, not_starting = scheduling_problem(read), startup_problem(read)
            warning = cluster_warning(events, cluster_body, read, now)
            pods = read
        else:
            pods = await self.kube.cluster_pods(namespace, name)
        drained: tuple[str, ...] = ()
        # A driver that failed on a cordoned node counts too: the drain evicts the rollout
        # pods there at once, and a step without engines can fail before the stop request is
        # heard. Moving off is no restart; its checkpoint is the last step it trained. The
        # cordon came before that failure, so a list taken before the failure will not do.
        on = trainer_nodes(pods or [])
        if on and ray_job is not None and (ray_job.active or ray_job.failed_retryably):
            since = None if ray_job.active else ray_job.ended or now
            drained = tuple(sorted(on & await self._cordoned_nodes(listed_after=since)))
        if queued and shell is not None:
            workload_body = await self.kube.get_workload(namespace, names.workload_name(job))
        return Observed(
            job=job,
            now=now,
            created=created,
            cluster=cluster_view(
                job,
                cluster_body,
                pods or [],
                now,
                pods_read=pods is not None,
                dashboard_from_annotation=self.dashboard_from_annotation,
            ),
            ray_job=ray_job,
            ray_job_read=ray_job_read,
            previous_ray_job=previous_ray_job,
            dashboard_error=dashboard_error,
            heartbeat=heartbeat_from_lease(lease),
            scheduling_problem=problem,
            startup_problem=not_starting,
            cluster_warning=warning,
            drained_nodes=drained,
            workload=queueing.workload_view(workload_body),
            pods_left=len(pods or []) if shell is None else 0,
            apply_error=foreign,
        )

    async def _cordoned_nodes(self, listed_after: datetime | None = None) -> frozenset[str]:
        """The cordoned nodes, shared by every job for a few seconds (and listed after
        `listed_after`, if given); none when the operator may not list nodes (node drains are
        then not seen, which it says once)."""
        now = self.clock().timestamp()
        cached = self._cordoned
        after = listed_after.timestamp() if listed_after is not None else float("-inf")
        if cached is not None and after < cached[0] <= now < cached[0] + CORDONED_NODES_TTL_SECONDS:
            return cached[1]
        try:
            found = frozenset(await self.kube.cordoned_nodes())
        except ApiException as error:
            if error.status != 403:
                raise
            if not self._nodes_forbidden_logged:
                self._nodes_forbidden_logged = True
                log.warning("cannot list nodes (grant list on nodes): node drains go unseen")
            found = frozenset()
        self._cordoned = (now, found)
        return found

    def _silence(self, job: RLHFJob, cluster: ClusterView, now: datetime) -> str | None:
        """The last answer of this cluster's dashboard while it is not due to be asked again
        (it did not answer, and the policy's retry time has not come); else None."""
        silent = self._silent.get((job.metadata.namespace, job.metadata.name))
        if silent is None or silent.cluster != _silence_key(job, cluster) or now >= silent.retry_at:
            return None
        return silent.error

    async def _ask_dashboard(
        self, job: RLHFJob, cluster: ClusterView, restart_count: int, now: datetime
    ) -> tuple[RayJobView | None, RayJobView | None, str | None]:
        """This attempt's Ray job (and the previous one's, when there is no current one), or
        why the dashboard did not answer. A dashboard that did not answer is not asked again
        before the policy's retry time: the last answer stands until then."""
        assert cluster.dashboard is not None
        if (silent := self._silence(job, cluster, now)) is not None:
            return None, None, silent
        dashboard = self._dashboard(job, cluster.dashboard)
        self.dashboard_asks += 1
        try:
            ray_job = await self.ray_jobs.status(dashboard, names.submission_id(job, restart_count))
            previous = None
            if ray_job is None and restart_count > 0:
                previous_id = names.submission_id(job, restart_count - 1)
                previous = await self.ray_jobs.status(dashboard, previous_id)
        except DashboardUnavailableError as error:
            return None, None, error_text(error)
        return ray_job, previous, None

    def _remember_silence(self, job: RLHFJob, seen: Observed, plan: Plan) -> None:
        key = (job.metadata.namespace, job.metadata.name)
        cluster = seen.cluster
        if plan.dashboard_retry_at is None or seen.dashboard_error is None or cluster is None:
            self._silent.pop(key, None)
            return
        self._silent[key] = _SilentDashboard(
            _silence_key(job, cluster), seen.dashboard_error, plan.dashboard_retry_at
        )

    async def act(
        self, job: RLHFJob, body: dict[str, Any], seen: Observed, plan: Plan
    ) -> Observed | None:
        """Carry out the plan, then its Events.

        An action that fails in a way the policy knows (a refused object, a refused submission)
        stops it: the world with that failure in it is returned, to be decided again.
        """
        namespace, name = job.metadata.namespace, job.metadata.name
        url = seen.cluster.dashboard if seen.cluster else None
        dashboard = self._dashboard(job, url) if url else None
        for action in plan.actions:
            match action:
                case ApplyCluster():
                    placement = await self._placement(seen.workload)
                    if (refusal := await self._apply(job, placement)) is not None:
                        return replace(seen, apply_error=refusal)
                case ApplyWorkload():
                    if (refusal := await self._apply_workload(job)) is not None:
                        return replace(seen, workload_error=refusal)
                case SetWorkloadActive(active=active):
                    await self.kube.patch_workload(
                        namespace, names.workload_name(job), {"spec": {"active": active}}
                    )
                case ReleaseQuota() if (workload := seen.workload) is not None:
                    log.info("%s/%s: every pod is gone, giving the quota back", namespace, name)
                    patch = queueing.release_patch(workload, seen.now)
                    await self.kube.patch_workload(namespace, workload.name, patch, status=True)
                case SetPodsReady(ready=ready) if (workload := seen.workload) is not None:
                    patch = queueing.pods_ready_patch(workload, ready, seen.now)
                    await self.kube.patch_workload(namespace, workload.name, patch, status=True)
                case FinishWorkload(succeeded=ok, message=message) if workload := seen.workload:
                    patch = queueing.finish_patch(workload, ok, message, seen.now)
                    await self.kube.patch_workload(namespace, workload.name, patch, status=True)
                case DeleteCluster(reason=reason) if seen.cluster and seen.cluster.uid:
                    log.info("%s/%s: deleting RayCluster (%s)", namespace, name, reason)
                    await self.kube.delete_ray_cluster(
                        namespace, seen.cluster.name, seen.cluster.uid
                    )
                case SubmitRayJob():
                    assert dashboard is not None
                    if (error := await self._submit(job, dashboard, action)) is not None:
                        return replace(seen, submit_error=error)
                case StopRayJob(submission_id=stopped) if dashboard:
                    try:
                        await self.ray_jobs.stop(dashboard, stopped)
                    except DashboardUnavailableError as error:
                        log.warning("%s/%s: could not stop %s: %s", namespace, name, stopped, error)
                case DeleteJob():
                    log.info("%s/%s: ttlSecondsAfterFinished passed, deleting", namespace, name)
                    await self.kube.delete_job(namespace, name)
                case RequestStop(at=at):
                    log.info("%s/%s: asking the trainer to checkpoint and stop", namespace, name)
                    await self.kube.annotate_lease(
                        namespace, names.heartbeat_lease_name(job),
                        contract.LEASE_STOP_REQUESTED_AT, format_time(at),
                    )  # fmt: skip
                case ClearStopRequest():
                    await self.kube.annotate_lease(
                        namespace, names.heartbeat_lease_name(job),
                        contract.LEASE_STOP_REQUESTED_AT, None,
                    )  # fmt: skip
        for event in plan.events:
            self.emit(
                body, Event(event.type, event.reason, trim(event.message, EVENT_MESSAGE_LIMIT))
            )
        return None

    async def _placement(
        self, workload: queueing.WorkloadView | None
    ) -> dict[str, queueing.PodSetPlacement] | None:
        """Where Kueue's admission puts each group: its ResourceFlavors' node labels and
        tolerations (read when the cluster is applied; a flavor is a handful of fields)."""
        if workload is None:
            return None
        wanted = sorted({flavor for flavors in workload.flavors.values() for flavor in flavors})
        bodies = await asyncio.gather(
            *(
                self.kube.get_cluster_object(
                    kueue.KUEUE_GROUP, kueue.KUEUE_VERSION, kueue.RESOURCE_FLAVORS, flavor
                )
                for flavor in wanted
            )
        )
        return queueing.placement(
            workload, {f: body for f, body in zip(wanted, bodies, strict=True) if body}
        )

    async def _apply_workload(self, job: RLHFJob) -> ApplyRefusal | None:
        """Create the job's Workload (Kueue forbids changing its pod sets later), with the
        priority its class gives; a missing class is a refusal the job shows and retries."""
        priority = None
        if (ref := queueing.priority_class(job)) is not None:
            group, kind, name = ref
            if group == kueue.KUEUE_GROUP:
                where = (kueue.KUEUE_GROUP, kueue.KUEUE_VERSION, kueue.WORKLOAD_PRIORITY_CLASSES)
            else:
                where = ("scheduling.k8s.io", "v1", "priorityclasses")
            found = await self.kube.get_cluster_object(*where, name)
            if found is None:
                return ApplyRefusal(kind, name, 404, "NotFound", f"{kind} {name!r} does not exist")
            priority = int(found.get("value", 0))
        return await self._apply_one(job, builder.build_workload(job, priority))

    async def _apply(
        self, job: RLHFJob, placement: dict[str, queueing.PodSetPlacement] | None = None
    ) -> ApplyRefusal | None:
        """Apply the job's objects, those that need nothing of each other at once: first what
        the RayCluster's pods need (ServiceAccount, Role, Secret, NetworkPolicy, ConfigMap) and
        the heartbeat Lease, then the RoleBinding (the API server checks the Role it binds), then
        the RayCluster. Returns the first refusal in the builder's order; after one, the later
        stages are not applied."""
        owned = builder.build_owned_objects(job, self.ray_auth.token(job), self.network, placement)
        lease = builder.build_heartbeat_lease(job)
        later = ("RoleBinding", "RayCluster")
        assert [m["kind"] for m in owned if m["kind"] in later] == list(later)
        stages = [
            [*(m for m in owned if m["kind"] not in later), lease],
            *([m for m in owned if m["kind"] == kind] for kind in later),
        ]
        for stage in stages:
            refusals = await asyncio.gather(*(self._apply_one(job, m) for m in stage))
            if (refusal := next((r for r in refusals if r is not None), None)) is not None:
                return refusal
        return None

    async def _apply_one(self, job: RLHFJob, manifest: dict[str, Any]) -> ApplyRefusal | None:
        """Apply one object as its kind needs: the Secret is only ever created (never read), the
        Lease and the Workload are created once (the trainer and Kueue write them after),
        everything else is applied over the job's own."""
        kind = manifest["kind"]
        try:
            if kind == "Secret":
                await self.kube.create_secret(manifest)
            elif kind in CREATED_ONCE:
                await self.kube.create_if_missing(manifest)
            else:
                await self.kube.apply(manifest)
        except ApplyRefusedError as error:
            # Only the Status words, with the manifest's Secret values taken out.
            refusal = apply_refusal(manifest, error.code, error.reason, error.message)
            log.warning("%s/%s: %s", job.metadata.namespace, job.metadata.name, refusal.text)
            return refusal
        return None

    def _dashboard(self, job: RLHFJob, url: str) -> Dashboard:
        return Dashboard(url, self.ray_auth.token(job))

    async def _submit(self, job: RLHFJob, dashboard: Dashboard, action: SubmitRayJob) -> str | None:
        """Submit the Ray job; the error when Ray did not take it."""
        attempt = str(job.status.restart_count if job.status else 0)
        env = PodEnv(
            job_name=job.metadata.name,
            job_namespace=job.metadata.namespace,
            attempt=int(attempt),
            trainer_replicas=action.trainer_replicas,
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
        except DashboardUnavailableError as error:
            self.metrics.submission_failures.inc()
            log.warning("%s/%s: could not submit %s: %s", job.metadata.namespace,
                        job.metadata.name, action.submission_id, error)  # fmt: skip
            return error_text(error)
        return None

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

    async def _outdated(self, body: dict[str, Any], error: UnknownFieldsError) -> None:
        """A job with fields the API server accepted and this operator does not know: its CRD
        is newer than the operator. Failing it would end a job that is fine (a running trainer
        goes on without the operator), so it is left alone, said so once, and looked at again
        in a while."""
        metadata = body["metadata"]
        fields = ", ".join(line.split(":", 1)[0] for line in error.problems)
        message = f"this operator does not know {fields} (a newer CRD): upgrade the operator"
        if (body.get("status") or {}).get("message") == message[:32768]:
            return
        log.warning("%s/%s: %s", metadata.get("namespace"), metadata["name"], message)
        await self.kube.patch_job_status(
            metadata.get("namespace", "default"), metadata["name"], {"message": message[:32768]}
        )
        self.emit(
            body, Event("Warning", EventReason.OPERATOR_OUTDATED, message[:EVENT_MESSAGE_LIMIT])
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
        self.emit(body, Event("Warning", FailureReason.INVALID_SPEC, message[:EVENT_MESSAGE_LIMIT]))

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


def _silence_key(job: RLHFJob, cluster: ClusterView) -> tuple[str, datetime, str, int | None]:
    return (cluster.name, cluster.created, cluster.dashboard or "", job.metadata.generation)


def _newly_resumed(before: RLHFJobStatus, after: RLHFJobStatus) -> RestartRecord | None:
    """The restart whose first resumed step this reconcile noticed, if any."""
    if not after.restart_history or after.restart_history[-1].resumed_time is None:
        return None
    last = after.restart_history[-1]
    old = next((r for r in before.restart_history if r.time == last.time), None)
    return last if old is None or old.resumed_time is None else None


def _condition_true(status: RLHFJobStatus, type_: str) -> bool:
    return any(c.type == type_ and c.status == "True" for c in status.conditions)
