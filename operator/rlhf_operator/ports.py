"""The two clients the reconciler talks through, as small Protocols.

`kube.Kube` and `rayjobs.RayJobClient` implement them for real; the unit tests drive the
reconciler with in-memory fakes. Each port says which errors it raises on purpose: the
reconciler handles exactly those, and anything else is a bug that shows as one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from rlhf_operator.views import RayJobView


class DashboardUnavailableError(Exception):
    """The dashboard could not be reached, or answered with an error or nonsense.

    The reconciler turns it into a condition and a retry, never a failure of the job.
    """


class ApplyRefusedError(Exception):
    """The API server refused to create or change an object (HTTP 400, 403, 409 or 422).

    Carries only the Status `reason` and `message`, never the response body or headers: the
    reconciler shows the message on the job (after redacting Secret values).
    """

    def __init__(self, code: int, reason: str = "", message: str = "") -> None:
        super().__init__(f"HTTP {code} {reason}: {message}".strip())
        self.code = code
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Dashboard:
    """A job's Ray dashboard: where it answers, and the token it asks for (`ray_auth`)."""

    url: str
    token: str | None = field(default=None, repr=False)  # never in a log line


class KubePort(Protocol):
    """The API-server calls of the operator (the Helm chart's RBAC grants exactly these).

    Errors are the Kubernetes client's `ApiException`: the reconcile fails and the timer retries;
    except that `apply`, `create_if_missing` and `create_secret` raise `ApplyRefusedError` when
    the API server refuses the object itself (4xx), or it is not the job's, which the lifecycle
    policy decides on.
    """

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def patch_job_status(self, namespace: str, name: str, status: dict[str, Any]) -> None: ...

    async def delete_job(self, namespace: str, name: str) -> None: ...

    async def get_ray_cluster(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def delete_ray_cluster(self, namespace: str, name: str, uid: str) -> None:
        """Delete that RayCluster if it is still the one of this uid."""
        ...

    async def apply(self, manifest: dict[str, Any]) -> None:
        """Create, or server-side apply over an object the manifest's controller owns; raises
        `ApplyRefusedError` when the object is refused, or is someone else's (reason
        `views.NOT_OWNED`)."""
        ...

    async def create_if_missing(self, manifest: dict[str, Any]) -> None:
        """Create unless the manifest's controller owns one already; `ApplyRefusedError` as
        for `apply`."""
        ...

    async def create_secret(self, manifest: dict[str, Any]) -> None:
        """Create a Secret whose name derives from its content; an existing one is kept
        unread. Raises `ApplyRefusedError` when the API server refuses it."""
        ...

    async def cluster_pods(self, namespace: str, cluster: str) -> list[Any]:
        """The pods (`V1Pod`) of one RayCluster."""
        ...

    async def get_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A Service as a dict (the head Service, whose controller is checked before the job's
        token is sent to it), or None when there is none."""
        ...

    async def cluster_events(self, namespace: str, cluster: str) -> list[Any]:
        """The Warning Events (`CoreV1Event`) recorded on one RayCluster, e.g. KubeRay's
        FailedToCreateWorkerPod. Read only while the cluster is not ready."""
        ...

    async def get_lease(self, namespace: str, name: str) -> Any | None:
        """The `V1Lease`, or None when there is none."""
        ...

    async def cordoned_nodes(self) -> set[str]:
        """The names of the nodes marked unschedulable (being drained)."""
        ...

    async def annotate_lease(self, namespace: str, name: str, key: str, value: str | None) -> None:
        """Set (None: remove) one annotation of the Lease; a missing Lease is no error."""
        ...

    async def get_workload(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A queued job's Kueue Workload, or None."""
        ...

    async def patch_workload(
        self, namespace: str, name: str, patch: dict[str, Any], *, status: bool = False
    ) -> bool:
        """Merge-patch the Workload (its status with `status`); False on a stale
        resourceVersion or a missing Workload."""
        ...

    async def get_cluster_object(
        self, group: str, version: str, plural: str, name: str
    ) -> dict[str, Any] | None:
        """A cluster-scoped object (ResourceFlavor, priority classes), or None."""
        ...


class RayJobsPort(Protocol):
    """Ray's Job Submission API on one dashboard; raises `DashboardUnavailableError`."""

    async def status(self, dashboard: Dashboard, submission_id: str) -> RayJobView | None:
        """None: Ray knows no job by that id."""
        ...

    async def submit(
        self,
        dashboard: Dashboard,
        submission_id: str,
        entrypoint: str,
        *,
        env: dict[str, str],
        metadata: dict[str, str],
    ) -> None:
        """Idempotent by submission id."""
        ...

    async def stop(self, dashboard: Dashboard, submission_id: str) -> None: ...
