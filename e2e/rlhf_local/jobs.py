"""Small RLHFJobs for the local cluster: roles on the fake GPU pools, head on the CPU pool.

Used by the operator's e2e tests and its latency benchmark. Their driver is a Python one-liner
(`spec.entrypoint`) rather than the trainer, so they test the operator's lifecycle quickly.
`Jobs` reads and writes RLHFJobs (and looks at their RayClusters and pods) for tests.
"""

from __future__ import annotations

import base64
import json
import shlex
import sys
import urllib.request
from typing import TYPE_CHECKING, Any

from rlhf_local import pools
from rlhf_local.harness import LocalCluster, events_for, wait_for
from rlhfjob import api, contract
from rlhfjob.contract.kuberay import RAY_CLUSTERS, RAY_GROUP, RAY_VERSION
from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import valid_job

if TYPE_CHECKING:
    from rlhf_local.operator_process import OperatorProcess


def ray_get(dashboard: str, path: str, token: str | None) -> Any:
    """GET a path of a Ray dashboard with the job's token (token auth is on for every job)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"{dashboard}{path}", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def ray_token(lc: LocalCluster, namespace: str, cluster: dict[str, Any]) -> str | None:
    """The token a RayCluster's Ray asks for: the Secret its `authOptions` name (as a pod sees)."""
    secret_name = ((cluster.get("spec") or {}).get("authOptions") or {}).get("secretName")
    if not secret_name:
        return None
    secret = lc.core.read_namespaced_secret(secret_name, namespace)
    return base64.b64decode((secret.data or {})["auth_token"]).decode()


GPU_TOLERATION = {"key": pools.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def driver(code: str) -> str:
    """An entrypoint that runs `code` with this interpreter (the stand-in Ray's Python)."""
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


SLEEP_FOREVER = driver("import time\nwhile True: time.sleep(1)")
FINISH_AT_ONCE = driver("print('trained')")


def job_manifest(name: str, namespace: str, entrypoint: str, **spec: Any) -> dict[str, Any]:
    """A job with one trainer and one rollout replica, each asking for one fake GPU."""
    small = {"cpu": "1", "memory": "1Gi"}

    def on_pool(pool: str) -> dict[str, Any]:
        return {
            **small,
            "gpus": 1,
            "nodeSelector": {pools.POOL_LABEL: pool},
            "tolerations": [GPU_TOLERATION],
        }

    document = merge_patch(
        valid_job(name),
        {
            "metadata": {"namespace": namespace},
            "spec": {
                "entrypoint": entrypoint,
                "head": {**small, "nodeSelector": {pools.POOL_LABEL: "cpu"}},
                "roles": {"trainer": on_pool("gpu-train"), "rollout": on_pool("gpu-rollout")},
                "liveness": {"progressTimeoutSeconds": 3600},
            },
        },
    )
    return merge_patch(document, {"spec": spec})


def condition_of(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    """The condition of `type_` in a job's status (one read), or None."""
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


class Jobs:
    """Reads and writes RLHFJobs in one namespace."""

    def __init__(self, lc: LocalCluster, namespace: str) -> None:
        self.lc, self.namespace = lc, namespace

    def create(self, manifest: dict[str, Any]) -> None:
        self.lc.custom.create_namespaced_custom_object(
            api.GROUP, api.VERSION, self.namespace, api.PLURAL, manifest
        )

    def delete(self, name: str) -> None:
        self.lc.custom.delete_namespaced_custom_object(
            api.GROUP, api.VERSION, self.namespace, api.PLURAL, name
        )

    def get(self, name: str) -> dict[str, Any]:
        job: dict[str, Any] = self.lc.custom.get_namespaced_custom_object(
            api.GROUP, api.VERSION, self.namespace, api.PLURAL, name
        )  # type: ignore[assignment]
        return job

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.get(name).get("status") or {})

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.lc.custom.patch_namespaced_custom_object(
            api.GROUP, api.VERSION, self.namespace, api.PLURAL, name, {"spec": spec}
        )

    def phase(self, name: str) -> str | None:
        return self.status(name).get("phase")

    def condition(self, name: str, type_: str) -> dict[str, Any] | None:
        return condition_of(self.status(name), type_)

    def wait_phase(
        self, name: str, phase: str, timeout: float, operator: OperatorProcess | None = None
    ) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            job = self.get(name)
            return job if (job.get("status") or {}).get("phase") == phase else None

        def explain() -> str:
            text = json.dumps(self.get(name).get("status"), indent=1)
            return text + ("\n" + operator.log_tail(60) if operator else "")

        return wait_for(reached, timeout, f"{name} to be {phase}", interval=0.5, details=explain)

    def ray_cluster(self, name: str) -> dict[str, Any] | None:
        listed: Any = self.lc.custom.list_namespaced_custom_object(
            RAY_GROUP, RAY_VERSION, self.namespace, RAY_CLUSTERS
        )
        items: list[dict[str, Any]] = listed["items"]
        return next((rc for rc in items if rc["metadata"]["name"] == name), None)

    def dashboard(self, name: str) -> str:
        """The job's dashboard address, once announced on its RayCluster (a cluster recreated a
        moment ago has none yet)."""

        def announced() -> str | None:
            cluster = self.ray_cluster(name)
            annotations = (cluster or {}).get("metadata", {}).get("annotations") or {}
            return annotations.get(contract.DASHBOARD_ANNOTATION)

        return str(wait_for(announced, 60, f"{name}'s dashboard on its RayCluster"))

    def ray_token(self, name: str) -> str | None:
        cluster = self.ray_cluster(name)
        assert cluster is not None, f"{name} has no RayCluster"
        return ray_token(self.lc, self.namespace, cluster)

    def ray_get(self, name: str, path: str) -> Any:
        """GET from the job's Ray dashboard, authenticated as the job's own pods are."""
        return ray_get(self.dashboard(name), path, self.ray_token(name))

    def ray_submissions(self, name: str) -> list[dict[str, Any]]:
        listed: list[dict[str, Any]] = self.ray_get(name, "/api/jobs/")
        return listed

    def events(self, name: str) -> list[Any]:
        return events_for(self.lc, self.namespace, name)

    def event_reasons(self, name: str) -> list[str]:
        return [e.reason for e in self.events(name)]

    def pods(self, cluster: str, group: str) -> list[Any]:
        """The Ray pods of one group (``head`` for the head) that are not being deleted."""
        selector = f"ray.io/cluster={cluster}," + (
            "ray.io/node-type=head" if group == "head" else f"ray.io/group={group}"
        )
        listed: list[Any] = self.lc.core.list_namespaced_pod(
            self.namespace, label_selector=selector
        ).items
        return [p for p in listed if p.metadata.deletion_timestamp is None]
