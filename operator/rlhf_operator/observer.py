"""Observe: what the reconciler reads of one job's world, through its ports, as views.

The first of the reconciler's three steps (observe → decide → act), kept apart so that all the
reading, and what is remembered between reconciles to read less (a dashboard that did not
answer, the cordoned nodes), sits in one place: what is read depends on what the RayCluster
says, so a quiet reconcile of a healthy job costs a few calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from rlhf_operator import names, queueing
from rlhf_operator.builder import owner_reference
from rlhf_operator.lifecycle import Plan
from rlhf_operator.parsers import (
    NO_TOKEN,
    claim,
    cluster_view,
    cluster_warning,
    error_text,
    head_service_problem,
    heartbeat_from_lease,
    scheduling_problem,
    startup_problem,
    trainer_nodes,
)
from rlhf_operator.ports import DashboardUnavailableError, KubePort, RayJobsPort
from rlhf_operator.ray_auth import RayAuth
from rlhf_operator.views import (
    NOT_OWNED,
    ApplyRefusal,
    ClusterView,
    ClusterWarning,
    Observed,
    RayJobView,
)
from rlhfjob.api import RLHFJob, RLHFJobStatus
from rlhfjob.contract import kuberay as ray
from rlhfjob.contract.lease import parse_time

log = logging.getLogger("rlhf_operator")

CORDONED_NODES_TTL_SECONDS = 5.0
"""The cordoned nodes are listed once per this many seconds for all jobs (one cheap list: a
drain's checkpoint takes far longer than that)."""
SilenceKey = tuple[str, datetime, str, int | None]


@dataclass(frozen=True)
class _SilentDashboard:
    """A dashboard that did not answer, and when the policy wants it asked again
    (`Plan.dashboard_retry_at`); until then reconciles reuse `error` instead of asking."""

    cluster: SilenceKey
    """The RayCluster (name, creation), the dashboard's address and the job's generation it
    was asked for: a new cluster, address or spec is asked at once."""
    error: str
    retry_at: datetime


@dataclass
class _Reads:
    """What was read besides the RayCluster, as far as the RayCluster's state called for."""

    pods: list[Any] | None = None
    """None: not read this time (their views are unknown)."""
    lease: Any = None
    ray_job: RayJobView | None = None
    previous_ray_job: RayJobView | None = None
    dashboard_error: str | None = None
    trusted_dashboard: str | None = None
    """The dashboard address whose head Service was checked to be the cluster's own."""
    ray_job_read: bool = False
    scheduling_problem: str | None = None
    startup_problem: str | None = None
    cluster_warning: ClusterWarning | None = None
    workload: dict[str, Any] | None = None


class Observer:
    """Reads one job's world into an `Observed`, for `lifecycle.decide`."""

    def __init__(
        self,
        kube: KubePort,
        ray_jobs: RayJobsPort,
        ray_auth: RayAuth,
        clock: Callable[[], datetime],
        *,
        dashboard_from_annotation: bool = False,
    ) -> None:
        """`dashboard_from_annotation`: a test hook (`Reconciler`)."""
        self.kube = kube
        self.ray_jobs = ray_jobs
        self.ray_auth = ray_auth
        self.clock = clock
        self.dashboard_from_annotation = dashboard_from_annotation
        self.dashboard_asks = 0
        """How many times a dashboard was asked for a job's state (for tests and benchmarks)."""
        self._silent: dict[tuple[str, str], _SilentDashboard] = {}
        self._cordoned: tuple[float, frozenset[str]] | None = None
        self._nodes_forbidden_logged = False

    async def read_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.kube.get_job(namespace, name)

    async def observe(self, job: RLHFJob, body: dict[str, Any]) -> Observed:
        """Read what can matter to the policy: the RayCluster; then, from what it says, at once:
        its pods and KubeRay's Warnings while it is not ready, or its pods, the Ray job (through
        its dashboard) and the heartbeat Lease once it is. Between the asks of a dashboard that
        does not answer, for a job with nothing submitted, only the job and its RayCluster can
        change the plan (there is no trainer to hear from): nothing more is read."""
        now = self.clock()
        cluster_body, foreign = await self._own_cluster(job)
        # Ready, deleting and the dashboard come from the RayCluster alone.
        shell = cluster_view(
            job, cluster_body, [], now, dashboard_from_annotation=self.dashboard_from_annotation
        )
        queued = queueing.queue_name(job) is not None
        if shell is not None:
            reads = await self._read_around(job, shell, cluster_body, now)
        elif queued and foreign is None:
            reads = await self._read_leftovers(job)
        else:
            reads = _Reads()
        drained = await self._drained_nodes(job, shell, reads, now)
        if queued and shell is not None:
            workload = names.workload_name(job)
            reads.workload = await self.kube.get_workload(job.metadata.namespace, workload)
        return Observed(
            job=job,
            now=now,
            created=parse_time(body["metadata"].get("creationTimestamp")) or now,
            cluster=cluster_view(
                job,
                cluster_body,
                reads.pods or [],
                now,
                pods_read=reads.pods is not None,
                dashboard_from_annotation=self.dashboard_from_annotation,
            ),
            ray_job=reads.ray_job,
            ray_job_read=reads.ray_job_read,
            previous_ray_job=reads.previous_ray_job,
            dashboard_error=reads.dashboard_error,
            trusted_dashboard=reads.trusted_dashboard,
            heartbeat=heartbeat_from_lease(reads.lease),
            scheduling_problem=reads.scheduling_problem,
            startup_problem=reads.startup_problem,
            cluster_warning=reads.cluster_warning,
            drained_nodes=drained,
            workload=queueing.workload_view(reads.workload),
            pods_left=len(reads.pods or []) if shell is None else 0,
            apply_error=foreign,
        )

    async def _own_cluster(self, job: RLHFJob) -> tuple[dict[str, Any] | None, ApplyRefusal | None]:
        """The job's RayCluster; or, when one of its name is not the job's, none and why."""
        name = names.ray_cluster_name(job)
        body = await self.kube.get_ray_cluster(job.metadata.namespace, name)
        if body is None or (found := claim(body, owner_reference(job))) is None:
            return body, None
        # Not this job's cluster: never read through, submitted to, or deleted.
        reason = "Conflict" if found.earlier else NOT_OWNED
        return None, ApplyRefusal(ray.RAY_CLUSTER_KIND, name, 409, reason, found.message)

    async def _read_leftovers(self, job: RLHFJob) -> _Reads:
        """A queued job's Workload, and the pods left of a cluster that is gone: Kueue's quota
        goes back only once no pod is left (a deleted cluster's pods linger)."""
        namespace = job.metadata.namespace
        pods, workload = await asyncio.gather(
            self.kube.cluster_pods(namespace, names.ray_cluster_name(job)),
            self.kube.get_workload(namespace, names.workload_name(job)),
        )
        return _Reads(pods=pods, workload=workload)

    async def _read_around(
        self, job: RLHFJob, shell: ClusterView, cluster: dict[str, Any] | None, now: datetime
    ) -> _Reads:
        """The cluster's pods, and what its state makes worth reading with them."""
        namespace, name = job.metadata.namespace, names.ray_cluster_name(job)
        if shell.ready and not shell.deleting and shell.dashboard:
            return await self._read_running(job, shell, now)
        if not shell.ready and not shell.deleting:
            # Why the pods are not there yet; read only now, so a ready cluster costs nothing.
            pods, events = await asyncio.gather(
                self.kube.cluster_pods(namespace, name), self.kube.cluster_events(namespace, name)
            )
            return _Reads(
                pods=pods,
                scheduling_problem=scheduling_problem(pods),
                startup_problem=startup_problem(pods),
                cluster_warning=cluster_warning(events, cluster, pods, now),
            )
        return _Reads(pods=await self.kube.cluster_pods(namespace, name))

    async def _read_running(self, job: RLHFJob, shell: ClusterView, now: datetime) -> _Reads:
        """A ready cluster's pods, the trainer's Lease and the Ray job; only the last answer
        of a silent dashboard while nothing is submitted."""
        status = job.status or RLHFJobStatus()
        silent = self._silence(job, shell, now)
        if silent is not None and status.submission_id is None:
            return _Reads(dashboard_error=silent)
        namespace = job.metadata.namespace
        untrusted = await self._untrusted_head(job, shell)
        pods, lease, (ray_job, previous, error) = await asyncio.gather(
            self.kube.cluster_pods(namespace, names.ray_cluster_name(job)),
            self.kube.get_lease(namespace, names.heartbeat_lease_name(job)),
            self._ask_dashboard(job, shell, status.restart_count, now, untrusted),
        )
        return _Reads(
            pods=pods,
            lease=lease,
            ray_job=ray_job,
            previous_ray_job=previous,
            dashboard_error=error,
            trusted_dashboard=shell.dashboard if untrusted is None else None,
            ray_job_read=error is None,
        )

    async def _untrusted_head(self, job: RLHFJob, cluster: ClusterView) -> str | None:
        """Why the job's head Service is not to be given its token (someone else's Service
        of that name, or none yet); None when the job's RayCluster controls it."""
        namespace, name = job.metadata.namespace, names.head_service_name(job)
        try:
            service = await self.kube.get_service(namespace, name)
        except ApiException as error:
            if error.status != 403:
                raise
            return (
                f"the operator may not read the Service {name} (grant get on services): {NO_TOKEN}"
            )
        return head_service_problem(service, cluster)

    async def _drained_nodes(
        self, job: RLHFJob, shell: ClusterView | None, reads: _Reads, now: datetime
    ) -> tuple[str, ...]:
        """The cordoned nodes the head or a trainer pod runs on, in whatever state the job is:
        its cluster provisioning, its dashboard silent, its driver not yet submitted, pending,
        running, or failed and to be retried. Their PodDisruptionBudget holds the node's drain
        back until the job moves off, so a state that did not look would hold it as long as
        the state lasts (a head whose dashboard never answers: for ever). Not a cluster being
        deleted (its pods go), nor one whose driver Ray reports done (the job ends instead).

        A driver that failed on a cordoned node counts too: the drain evicts the rollout pods
        there at once, and a step without engines can fail before the stop request is heard.
        Moving off is no restart; its checkpoint is the last step it trained. The cordon came
        before that failure, so a list taken before the failure will not do."""
        ray_job = reads.ray_job
        if shell is None or shell.deleting:
            return ()
        if ray_job is not None and not (ray_job.active or ray_job.failed_retryably):
            return ()
        if reads.pods is not None and not trainer_nodes(reads.pods):
            return ()  # none scheduled yet: nothing on any node to hold a drain
        since = None if ray_job is None or ray_job.active else ray_job.ended or now
        cordoned = await self._cordoned_nodes(listed_after=since)
        if not cordoned:
            return ()
        pods = reads.pods
        if pods is None:  # not read between the asks of a silent dashboard: read them now
            pods = await self.kube.cluster_pods(job.metadata.namespace, shell.name)
        return tuple(sorted(trainer_nodes(pods) & cordoned))

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

    # -----------------------------------------------------------------------------------------
    # A dashboard that did not answer

    def _silence(self, job: RLHFJob, cluster: ClusterView, now: datetime) -> str | None:
        """The last answer of this cluster's dashboard while it is not due to be asked again
        (it did not answer, and the policy's retry time has not come); else None."""
        silent = self._silent.get((job.metadata.namespace, job.metadata.name))
        if silent is None or silent.cluster != _silence_key(job, cluster) or now >= silent.retry_at:
            return None
        return silent.error

    async def _ask_dashboard(
        self,
        job: RLHFJob,
        cluster: ClusterView,
        restart_count: int,
        now: datetime,
        untrusted: str | None = None,
    ) -> tuple[RayJobView | None, RayJobView | None, str | None]:
        """This attempt's Ray job (and the previous one's, when there is no current one), or
        why the dashboard did not answer (or, `untrusted`, why it is not asked). A dashboard
        that did not answer is not asked again before the policy's retry time: the last
        answer stands until then."""
        assert cluster.dashboard is not None
        if untrusted is not None:
            return None, None, untrusted
        if (silent := self._silence(job, cluster, now)) is not None:
            return None, None, silent
        dashboard = self.ray_auth.dashboard(job, cluster.dashboard)
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

    def remember_silence(self, job: RLHFJob, seen: Observed, plan: Plan) -> None:
        """Keep a dashboard that did not answer from being asked before the plan's retry time."""
        key = (job.metadata.namespace, job.metadata.name)
        cluster = seen.cluster
        if plan.dashboard_retry_at is None or seen.dashboard_error is None or cluster is None:
            self._silent.pop(key, None)
            return
        self._silent[key] = _SilentDashboard(
            _silence_key(job, cluster), seen.dashboard_error, plan.dashboard_retry_at
        )

    def forget(self, namespace: str, name: str) -> None:
        self._silent.pop((namespace, name), None)


def _silence_key(job: RLHFJob, cluster: ClusterView) -> SilenceKey:
    return (cluster.name, cluster.created, cluster.dashboard or "", job.metadata.generation)
