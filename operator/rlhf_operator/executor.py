"""Act: a lifecycle `Plan` carried out through the ports, and the status written.

The last of the reconciler's three steps (observe → decide → act), kept apart so that every
write the operator makes sits in one place. Each action is one idempotent call; one that fails
in a way the policy knows (an object the API server refused, a submission Ray refused) stops
the plan, and the world with that failure in it goes back to be decided again: a plan is never
edited here. Also the writes for a job that cannot be decided on (an invalid spec, or fields
this operator does not know).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rlhf_operator import builder, names, queueing
from rlhf_operator.lifecycle import (
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
)
from rlhf_operator.metrics import OperatorMetrics
from rlhf_operator.network import NetworkSettings
from rlhf_operator.parsers import apply_refusal, error_text
from rlhf_operator.ports import (
    ApplyRefusedError,
    Dashboard,
    DashboardUnavailableError,
    KubePort,
    RayJobsPort,
)
from rlhf_operator.ray_auth import RayAuth
from rlhf_operator.texts import EVENT_MESSAGE_LIMIT, STATUS_MESSAGE_MAX_LENGTH, trim
from rlhf_operator.views import ApplyRefusal, Observed
from rlhfjob import contract
from rlhfjob.api import Phase, RLHFJob, RLHFJobStatus
from rlhfjob.config import InvalidJobError, UnknownFieldsError
from rlhfjob.contract import EventReason, FailureReason, PodEnv, kueue
from rlhfjob.contract.lease import format_time

log = logging.getLogger("rlhf_operator")

EventSink = Callable[[dict[str, Any], Event], None]
STATUS_FIELDS = frozenset(field.alias or name for name, field in RLHFJobStatus.model_fields.items())
"""The status keys the operator owns (anything else there, it leaves alone)."""
CREATED_ONCE = frozenset({"Lease", kueue.WORKLOAD_KIND})
"""Kinds the operator creates and then leaves to others: the trainer renews the Lease, Kueue
forbids changing a Workload's pod sets."""


class PlanExecutor:
    """Carries out plans, and writes the status and Events the job shows."""

    def __init__(
        self,
        kube: KubePort,
        ray_jobs: RayJobsPort,
        ray_auth: RayAuth,
        metrics: OperatorMetrics,
        emit: EventSink,
        network: NetworkSettings,
    ) -> None:
        self.kube = kube
        self.ray_jobs = ray_jobs
        self.ray_auth = ray_auth
        self.metrics = metrics
        self.emit = emit
        self.network = network

    async def act(
        self, job: RLHFJob, body: dict[str, Any], seen: Observed, plan: Plan
    ) -> Observed | None:
        """Carry out the plan, then its Events.

        An action that fails in a way the policy knows (a refused object, a refused submission)
        stops it: the world with that failure in it is returned, to be decided again.
        """
        namespace, name = job.metadata.namespace, job.metadata.name
        url = seen.trusted_dashboard  # the token goes only to a head Service checked just now
        dashboard = self.ray_auth.dashboard(job, url) if url else None
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
                    await self._annotate_stop(job, format_time(at))
                case ClearStopRequest():
                    await self._annotate_stop(job, None)
        for event in plan.events:
            self.emit(
                body, Event(event.type, event.reason, trim(event.message, EVENT_MESSAGE_LIMIT))
            )
        return None

    async def write_status(self, job: RLHFJob, body: dict[str, Any], status: RLHFJobStatus) -> None:
        new = status.wire()
        old = body.get("status") or {}
        if new != old:
            # A merge patch keeps keys it does not mention: null the ones that were cleared.
            cleared = {key: None for key in old if key not in new and key in STATUS_FIELDS}
            await self.kube.patch_job_status(
                job.metadata.namespace, job.metadata.name, {**cleared, **new}
            )

    async def mark_outdated(self, body: dict[str, Any], error: UnknownFieldsError) -> None:
        """A job with fields the API server accepted and this operator does not know: its CRD
        is newer than the operator. Failing it would end a job that is fine (a running trainer
        goes on without the operator), so it is left alone, said so once, and looked at again
        in a while."""
        fields = ", ".join(line.split(":", 1)[0] for line in error.problems)
        message = f"this operator does not know {fields} (a newer CRD): upgrade the operator"
        if (body.get("status") or {}).get("message") == message[:STATUS_MESSAGE_MAX_LENGTH]:
            return
        await self._warn(body, {}, EventReason.OPERATOR_OUTDATED, message)

    async def reject(self, body: dict[str, Any], error: InvalidJobError) -> None:
        """A job that slipped past the schema (older CRD, hand edit): Failed, with the reason."""
        message = "invalid spec: " + "; ".join(error.problems)
        current = body.get("status") or {}
        if current.get("phase") == Phase.FAILED.value and current.get("message") == message:
            return
        await self._warn(body, {"phase": Phase.FAILED.value}, FailureReason.INVALID_SPEC, message)

    async def _warn(
        self, body: dict[str, Any], status: dict[str, Any], reason: str, message: str
    ) -> None:
        """Say `message` in the log, in the job's status (with `status`), and as a Warning."""
        metadata = body["metadata"]
        log.warning("%s/%s: %s", metadata.get("namespace"), metadata["name"], message)
        await self.kube.patch_job_status(
            metadata.get("namespace", "default"),
            metadata["name"],
            {**status, "message": message[:STATUS_MESSAGE_MAX_LENGTH]},
        )
        self.emit(body, Event("Warning", reason, message[:EVENT_MESSAGE_LIMIT]))

    async def _annotate_stop(self, job: RLHFJob, at: str | None) -> None:
        """Ask the trainer, on its Lease, to checkpoint and stop (None: no longer)."""
        await self.kube.annotate_lease(
            job.metadata.namespace,
            names.heartbeat_lease_name(job),
            contract.LEASE_STOP_REQUESTED_AT,
            at,
        )

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
        # Off the event loop, like the parse: the ConfigMap is the spec written as YAML.
        owned = await asyncio.to_thread(
            builder.build_owned_objects, job, self.ray_auth.token(job), self.network, placement
        )
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
