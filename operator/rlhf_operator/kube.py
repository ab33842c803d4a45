"""Kubernetes reads and writes of the operator, each a small blocking call run off the loop.

Everything the reconciler touches in the API server goes through `Kube`, so the RBAC in the Helm
chart can be read off this file: rlhfjobs (get, list, watch, patch status, delete), rayclusters
(get, create, patch, delete), pods (list), configmaps / serviceaccounts / roles / rolebindings /
networkpolicies / poddisruptionbudgets (get, create, patch: created, or applied over the job's
own, never adopted), secrets (create only: never read, never changed), leases (get, create,
patch: a drain's stop request), events (create: kopf posts the job's own Events; list: the
Warnings KubeRay records on a RayCluster not ready), nodes (list: the cordoned ones, where
trainer pods run); with Kueue: workloads (get, list, watch, create, patch; status: patch),
resourceflavors and workloadpriorityclasses (get), priorityclasses (get). Every write carries
the job's labels (`names.job_labels`): the chart's operator policy refuses any other.

The API server's refusal of an object (HTTP 400, 403, 409, 422) is `ports.ApplyRefusedError`,
quoting only the Status message; every other error stays the client's `ApiException`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from functools import partial
from typing import Any, TypeVar

from kubernetes import client, config, dynamic
from kubernetes.client.exceptions import ApiException

from rlhf_operator.names import FIELD_MANAGER
from rlhf_operator.parsers import api_status, claim, controller_of
from rlhf_operator.ports import ApplyRefusedError
from rlhf_operator.views import NOT_OWNED, PERMANENT_REFUSALS, RETRIED_REFUSALS
from rlhfjob import api
from rlhfjob.contract import kuberay as ray
from rlhfjob.contract import kueue

T = TypeVar("T")
log = logging.getLogger("rlhf_operator")
REFUSALS = PERMANENT_REFUSALS | RETRIED_REFUSALS


def refused(error: ApiException) -> ApplyRefusedError | None:
    """The API server's refusal of an object, as the port reports it; None: another error."""
    if error.status not in REFUSALS:
        return None
    reason, message = api_status(error.body)
    return ApplyRefusedError(int(error.status), reason or str(error.reason or ""), message)


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """The API server's refusals inside, as `ApplyRefusedError` (Status words only: the body
    and headers stay out of the traceback); other errors unchanged."""
    try:
        yield
    except ApiException as error:
        if (refusal := refused(error)) is not None:
            raise refusal from None
        raise


def _check_claim(manifest: dict[str, Any], existing: dict[str, Any]) -> None:
    """Raise unless the manifest's controller (the job) controls `existing`."""
    found = claim(existing, controller_of(manifest) or {})
    if found is not None:  # an earlier job's object is being collected: wait, else refuse
        raise ApplyRefusedError(409, "Conflict" if found.earlier else NOT_OWNED, found.message)


def load_kube_config() -> client.ApiClient:
    """In-cluster service account when running in a pod, else the kubeconfig."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


REQUEST_TIMEOUT = (5, 30)
"""Seconds to connect and to read, for every call to the API server."""
APPLY_ROUNDS = 3
"""Reads and writes of one apply when the object changes between them (made, or replaced)."""


class Kube:
    """`ports.KubePort` over the Kubernetes client, each call on a worker thread."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self._dynamic: dynamic.DynamicClient | None = None
        self._events_forbidden_logged = False

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # Every API call times out: an API server waiting on a lost etcd would otherwise hold a
        # worker thread (and the job's reconcile) for as long as it waits.
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
        return await asyncio.to_thread(partial(fn, *args, **kwargs))

    async def _discover(self, manifest: dict[str, Any]) -> Any:
        """The dynamic client's resource for a manifest (discovery, cached after the first)."""
        return await asyncio.to_thread(
            self.dynamic.resources.get, api_version=manifest["apiVersion"], kind=manifest["kind"]
        )

    @property
    def dynamic(self) -> dynamic.DynamicClient:
        if self._dynamic is None:  # discovery is slow: do it once, on first use
            self._dynamic = dynamic.DynamicClient(self.api_client)
        return self._dynamic

    # -- RLHFJobs ----------------------------------------------------------------------------

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._run(
                self.custom.get_namespaced_custom_object,
                api.GROUP, api.VERSION, namespace, api.PLURAL, name,
            )  # fmt: skip
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    async def patch_job_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await self._run(
            self.custom.patch_namespaced_custom_object_status,
            api.GROUP, api.VERSION, namespace, api.PLURAL, name, {"status": status},
        )  # fmt: skip

    async def delete_job(self, namespace: str, name: str) -> None:
        await self._ignore_missing(
            self.custom.delete_namespaced_custom_object,
            api.GROUP, api.VERSION, namespace, api.PLURAL, name,
        )  # fmt: skip

    # -- RayClusters and owned objects -------------------------------------------------------

    async def get_ray_cluster(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._run(
                self.custom.get_namespaced_custom_object,
                ray.RAY_GROUP, ray.RAY_VERSION, namespace, ray.RAY_CLUSTERS, name,
            )  # fmt: skip
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    async def delete_ray_cluster(self, namespace: str, name: str, uid: str) -> None:
        """Delete the RayCluster the operator saw (`uid`): never one made since, of that name."""
        await self._ignore_missing(
            self.custom.delete_namespaced_custom_object,
            ray.RAY_GROUP, ray.RAY_VERSION, namespace, ray.RAY_CLUSTERS, name,
            body=client.V1DeleteOptions(
                propagation_policy="Foreground", preconditions=client.V1Preconditions(uid=uid)
            ),
        )  # fmt: skip

    async def apply(self, manifest: dict[str, Any]) -> None:
        """Create the object, or server-side apply it over one this job controls.

        Never adopts: an object of that name that the job's owner reference does not control
        is refused (reason `NOT_OWNED`). The apply carries the uid it checked as a
        precondition, so an object deleted and made again by someone else between the read
        and the write is refused too (409: read again, up to `APPLY_ROUNDS`)."""
        resource = await self._discover(manifest)
        namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
        with _refusals():
            for _ in range(APPLY_ROUNDS):
                existing = await self._read(resource, namespace, name)
                try:
                    if existing is None:
                        await self._run(resource.create, body=manifest, namespace=namespace)
                        return
                    _check_claim(manifest, existing)
                    uid = existing["metadata"]["uid"]
                    checked = {**manifest, "metadata": {**manifest["metadata"], "uid": uid}}
                    await self._run(
                        self.dynamic.server_side_apply,
                        resource,
                        body=checked,
                        namespace=namespace,
                        field_manager=FIELD_MANAGER,
                        force_conflicts=True,
                    )
                    return
                except dynamic.exceptions.ConflictError:
                    continue  # made meanwhile, or replaced since the read: read it again
        raise ApplyRefusedError(409, "Conflict", f"{name} changed under every apply; retrying")

    async def create_if_missing(self, manifest: dict[str, Any]) -> None:
        """Create the object; one of that name is kept when this job controls it, and is
        refused (reason `NOT_OWNED`) otherwise."""
        resource = await self._discover(manifest)
        namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
        with _refusals():
            try:
                await self._run(resource.create, body=manifest, namespace=namespace)
                return
            except dynamic.exceptions.ConflictError:
                existing = await self._read(resource, namespace, name)
            if existing is not None:  # gone again: the next reconcile creates it
                _check_claim(manifest, existing)

    async def create_secret(self, manifest: dict[str, Any]) -> None:
        """Create a Secret named after its content (`names.ray_auth_secret_name`); one of that
        name is that Secret, kept unread: the operator may create Secrets, never read one."""
        resource = await self._discover(manifest)
        with _refusals(), contextlib.suppress(dynamic.exceptions.ConflictError):
            await self._run(
                resource.create, body=manifest, namespace=manifest["metadata"]["namespace"]
            )

    async def _read(self, resource: Any, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            found = await self._run(resource.get, name=name, namespace=namespace)
        except dynamic.exceptions.NotFoundError:
            return None
        return dict(found.to_dict())

    async def cluster_pods(self, namespace: str, cluster: str) -> list[Any]:
        """The Ray pods of one RayCluster (head and workers)."""
        pods = await self._run(
            self.core.list_namespaced_pod,
            namespace,
            label_selector=f"{ray.LABEL_CLUSTER}={cluster}",
        )
        return list(pods.items)

    async def get_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            found = await self._run(self.core.read_namespaced_service, name, namespace)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return dict(self.api_client.sanitize_for_serialization(found))

    async def cluster_events(self, namespace: str, cluster: str) -> list[Any]:
        """KubeRay's Warning Events on one RayCluster (why its pods are not there).

        Without `list` on events (an older chart) there are none to show: logged once, never a
        failed reconcile, since they only explain a wait.
        """
        selector = (
            f"involvedObject.kind={ray.RAY_CLUSTER_KIND},involvedObject.name={cluster},type=Warning"
        )
        try:
            events = await self._run(
                self.core.list_namespaced_event, namespace, field_selector=selector
            )
        except ApiException as error:
            if error.status != 403:
                raise
            if not self._events_forbidden_logged:
                self._events_forbidden_logged = True
                log.warning("cannot list Events (grant list on events): %s", error.reason)
            return []
        return list(events.items)

    async def get_lease(self, namespace: str, name: str) -> Any | None:
        try:
            return await self._run(self.coordination.read_namespaced_lease, name, namespace)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    async def cordoned_nodes(self) -> set[str]:
        """Nodes marked unschedulable: the first step of every drain (`kubectl drain`, node
        upgrades, the autoscaler's scale-down)."""
        nodes = await self._run(self.core.list_node, field_selector="spec.unschedulable=true")
        return {node.metadata.name for node in nodes.items}

    async def annotate_lease(self, namespace: str, name: str, key: str, value: str | None) -> None:
        patch = {"metadata": {"annotations": {key: value}}}
        await self._ignore_missing(self.coordination.patch_namespaced_lease, name, namespace, patch)

    # -- Kueue (queued jobs only) -----------------------------------------------------------

    async def get_workload(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._get_or_none(
            self.custom.get_namespaced_custom_object,
            kueue.KUEUE_GROUP, kueue.KUEUE_VERSION, namespace, kueue.WORKLOADS, name,
        )  # fmt: skip

    async def patch_workload(
        self, namespace: str, name: str, patch: dict[str, Any], *, status: bool = False
    ) -> bool:
        """A merge patch of the Workload (of its status with `status`); False when it carried
        a resourceVersion Kueue has moved past, or the Workload is gone: re-read, decide again."""
        fn = (
            self.custom.patch_namespaced_custom_object_status
            if status
            else self.custom.patch_namespaced_custom_object
        )
        try:
            await self._run(
                fn, kueue.KUEUE_GROUP, kueue.KUEUE_VERSION, namespace, kueue.WORKLOADS, name, patch
            )
        except ApiException as error:
            if error.status in (404, 409):
                return False
            raise
        return True

    async def get_cluster_object(
        self, group: str, version: str, plural: str, name: str
    ) -> dict[str, Any] | None:
        """A cluster-scoped object Kueue's admission names: a ResourceFlavor, a
        WorkloadPriorityClass, or a PriorityClass (`scheduling.k8s.io`)."""
        return await self._get_or_none(
            self.custom.get_cluster_custom_object, group, version, plural, name
        )

    async def _get_or_none(self, fn: Any, *args: Any) -> Any:
        try:
            return await self._run(fn, *args)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    async def _ignore_missing(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            await self._run(fn, *args, **kwargs)
        except ApiException as error:
            if error.status != 404:
                raise
