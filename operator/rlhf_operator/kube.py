"""Kubernetes reads and writes of the operator, each a small blocking call run off the loop.

Everything the reconciler touches in the API server goes through `Kube`, so the RBAC in the Helm
chart can be read off this file: rlhfjobs (get, list, watch, patch status, delete), rayclusters
(get, apply, delete), pods (list), configmaps / serviceaccounts / roles / rolebindings (apply),
leases (get, create), events (create).
"""

from __future__ import annotations

import asyncio
import contextlib
from functools import partial
from typing import Any, TypeVar

from kubernetes import client, config, dynamic
from kubernetes.client.exceptions import ApiException

from rlhf_operator.names import FIELD_MANAGER
from rlhfjob import api
from rlhfjob.contract import kuberay as ray

T = TypeVar("T")


def load_kube_config() -> client.ApiClient:
    """In-cluster service account when running in a pod, else the kubeconfig."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class Kube:
    """`ports.KubePort` over the Kubernetes client, each call on a worker thread."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self._dynamic: dynamic.DynamicClient | None = None

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(partial(fn, *args, **kwargs))

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

    async def delete_ray_cluster(self, namespace: str, name: str) -> None:
        await self._ignore_missing(
            self.custom.delete_namespaced_custom_object,
            ray.RAY_GROUP, ray.RAY_VERSION, namespace, ray.RAY_CLUSTERS, name,
            propagation_policy="Foreground",
        )  # fmt: skip

    async def apply(self, manifest: dict[str, Any]) -> None:
        """Server-side apply: unchanged manifests change nothing, and others' fields survive."""
        resource = await self._run(
            self.dynamic.resources.get, api_version=manifest["apiVersion"], kind=manifest["kind"]
        )
        await self._run(
            self.dynamic.server_side_apply,
            resource,
            body=manifest,
            namespace=manifest["metadata"]["namespace"],
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        )

    async def create_if_missing(self, manifest: dict[str, Any]) -> None:
        resource = await self._run(
            self.dynamic.resources.get, api_version=manifest["apiVersion"], kind=manifest["kind"]
        )
        with contextlib.suppress(dynamic.exceptions.ConflictError):  # it exists: keep it
            await self._run(
                resource.create, body=manifest, namespace=manifest["metadata"]["namespace"]
            )

    async def cluster_pods(self, namespace: str, cluster: str) -> list[Any]:
        """The Ray pods of one RayCluster (head and workers)."""
        pods = await self._run(
            self.core.list_namespaced_pod,
            namespace,
            label_selector=f"{ray.LABEL_CLUSTER}={cluster}",
        )
        return list(pods.items)

    async def get_lease(self, namespace: str, name: str) -> Any | None:
        try:
            return await self._run(self.coordination.read_namespaced_lease, name, namespace)
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
