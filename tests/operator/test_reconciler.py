"""The reconciler through observe → decide → act, with in-memory fakes of its two ports.

The fakes keep what the operator wrote (applied manifests, status patches, submissions) the way
an API server and a Ray dashboard would, so each test reconciles a world, changes it the way
KubeRay or Ray would, and reconciles again. Each port can be made to fail.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client, dynamic
from kubernetes.client import (
    CoreV1Event,
    CoreV1EventList,
    V1Lease,
    V1LeaseSpec,
    V1ObjectMeta,
    V1ObjectReference,
    V1Pod,
    V1PodCondition,
    V1PodSpec,
    V1PodStatus,
)
from kubernetes.client.exceptions import ApiException

from rlhf_operator import builder, names
from rlhf_operator import reconciler as reconciler_module
from rlhf_operator.kube import Kube
from rlhf_operator.lifecycle import Event
from rlhf_operator.metrics import OperatorMetrics
from rlhf_operator.network import NetworkSettings
from rlhf_operator.parsers import claim, controller_of
from rlhf_operator.policy import JobPolicy
from rlhf_operator.ports import ApplyRefusedError, Dashboard, DashboardUnavailableError
from rlhf_operator.ray_auth import RayAuth
from rlhf_operator.reconciler import ParseCache, Reconciler
from rlhf_operator.views import NOT_OWNED, RayJobView
from rlhfjob import contract
from rlhfjob.config import parse_job
from rlhfjob.contract import ExitCode, LeaseReport, kueue
from rlhfjob.contract import kuberay as ray
from rlhfjob.contract.lease import parse_time
from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import valid_job

NAMESPACE, NAME = "ns", "job"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
DASHBOARD = "http://127.0.0.1:8265"
FIRST_ATTEMPT = f"{NAME}-12345678-0"
RAY_AUTH = RayAuth(b"k" * 32)


class FakeKube:
    """An API server of one namespace: objects by kind and name, status patches merged."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.clusters: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, list[V1Pod]] = {}
        self.leases: dict[str, V1Lease] = {}
        self.applied: list[dict[str, Any]] = []
        self.status_patches: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.failing: dict[str, Exception] = {}
        """Method name → what it raises."""
        self.refusing: dict[str, ApplyRefusedError] = {}
        """Kind → how the API server refuses an object of that kind."""
        self.events: dict[str, list[Any]] = {}
        """RayCluster name → the Warning Events on it (KubeRay's)."""
        self.event_reads = 0
        self.cordoned: set[str] = set()
        """Nodes marked unschedulable (a drain under way)."""
        self.calls: dict[str, int] = {}
        """Method name → how many times it was called (what the reconciler read)."""
        self.workloads: dict[str, dict[str, Any]] = {}
        """Kueue Workloads by name, as created and patched."""
        self.cluster_objects: dict[tuple[str, str], dict[str, Any]] = {}
        """(plural, name) → a cluster-scoped object (ResourceFlavor, priority classes)."""
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        """(kind, name) → every object applied or created (whose owner references count)."""
        self.secrets: dict[str, dict[str, Any]] = {}
        """Secrets by name, as created (the operator never reads one back)."""
        self.services: dict[str, dict[str, Any] | None] = {}
        """Services by name that a test put in place of KubeRay's head Service (None: none)."""
        self.created = 0

    def _call(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if method in self.failing:
            raise self.failing[method]

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._call("get_job")
        job = self.jobs.get(name)
        return merge_patch(job, {}) if job is not None else None

    async def patch_job_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self._call("patch_job_status")
        self.status_patches.append(status)
        job = self.jobs[name]
        job["status"] = merge_patch(job.get("status") or {}, status)

    async def delete_job(self, namespace: str, name: str) -> None:
        self._call("delete_job")
        self.jobs.pop(name, None)
        self.deleted.append(f"RLHFJob/{name}")

    async def get_ray_cluster(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._call("get_ray_cluster")
        return self.clusters.get(name)

    async def delete_ray_cluster(self, namespace: str, name: str, uid: str) -> None:
        self._call("delete_ray_cluster")
        if self.clusters.get(name, {}).get("metadata", {}).get("uid") != uid:
            return  # the uid precondition: another cluster of that name stays
        self.clusters.pop(name, None)
        self.objects.pop((ray.RAY_CLUSTER_KIND, name), None)
        self.deleted.append(f"RayCluster/{name}")

    def _claimed(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """The existing object of the manifest's kind and name; ApplyRefusedError when the
        manifest's controller does not control it (the port's contract: never adopt)."""
        if manifest["kind"] in self.refusing:
            raise self.refusing[manifest["kind"]]
        key = (manifest["kind"], manifest["metadata"]["name"])
        existing = self.objects.get(key)
        if existing is not None and (found := claim(existing, controller_of(manifest) or {})):
            raise ApplyRefusedError(409, "Conflict" if found.earlier else NOT_OWNED, found.message)
        return existing

    def _store(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.created += 1
        stored = {**manifest, "metadata": {**manifest["metadata"], "uid": f"uid-{self.created}"}}
        self.objects[(manifest["kind"], manifest["metadata"]["name"])] = stored
        return stored

    async def apply(self, manifest: dict[str, Any]) -> None:
        self._call("apply")
        existing = self._claimed(manifest)
        self.applied.append(manifest)
        stored = existing or self._store(manifest)
        if manifest["kind"] == ray.RAY_CLUSTER_KIND:
            name = manifest["metadata"]["name"]
            current = self.clusters.get(name, {})
            self.clusters[name] = {
                **manifest,
                "metadata": {
                    **manifest["metadata"],
                    "creationTimestamp": T0.isoformat(),
                    "uid": stored["metadata"]["uid"],
                },
                "status": current.get("status", {}),
            }

    async def create_if_missing(self, manifest: dict[str, Any]) -> None:
        self._call("create_if_missing")
        if self._claimed(manifest) is not None:
            return
        self._store(manifest)
        if manifest["kind"] == "Lease":
            name = manifest["metadata"]["name"]
            self.leases.setdefault(name, V1Lease(metadata=V1ObjectMeta(name=name)))
        if manifest["kind"] == "Workload":
            name = manifest["metadata"]["name"]
            created = {**manifest, "metadata": {**manifest["metadata"], "resourceVersion": "1"}}
            self.workloads.setdefault(name, created)

    async def create_secret(self, manifest: dict[str, Any]) -> None:
        self._call("create_secret")
        if manifest["kind"] in self.refusing:
            raise self.refusing[manifest["kind"]]
        self.secrets.setdefault(manifest["metadata"]["name"], manifest)

    async def cluster_pods(self, namespace: str, cluster: str) -> list[Any]:
        self._call("cluster_pods")
        return list(self.pods.get(cluster, []))

    async def get_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        """KubeRay's head Service of the RayCluster there is (it controls it), unless a test
        put another in `services`."""
        self._call("get_service")
        if name in self.services:
            return self.services[name]
        cluster = self.clusters.get(name.removesuffix("-head-svc"))
        if cluster is None:
            return None
        owner = {
            "apiVersion": ray.RAY_API_VERSION,
            "kind": ray.RAY_CLUSTER_KIND,
            "name": cluster["metadata"]["name"],
            "uid": cluster["metadata"]["uid"],
            "controller": True,
        }
        return {"kind": "Service", "metadata": {"name": name, "ownerReferences": [owner]}}

    async def cluster_events(self, namespace: str, cluster: str) -> list[Any]:
        self._call("cluster_events")
        self.event_reads += 1
        return list(self.events.get(cluster, []))

    async def get_lease(self, namespace: str, name: str) -> Any | None:
        self._call("get_lease")
        return self.leases.get(name)

    async def cordoned_nodes(self) -> set[str]:
        self._call("cordoned_nodes")
        return set(self.cordoned)

    async def annotate_lease(self, namespace: str, name: str, key: str, value: str | None) -> None:
        self._call("annotate_lease")
        lease = self.leases.get(name)
        if lease is not None:
            annotations = dict(lease.metadata.annotations or {})
            if value is None:
                annotations.pop(key, None)
            else:
                annotations[key] = value
            lease.metadata.annotations = annotations

    async def get_workload(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._call("get_workload")
        found = self.workloads.get(name)
        return merge_patch(found, {}) if found is not None else None

    async def patch_workload(
        self, namespace: str, name: str, patch: dict[str, Any], *, status: bool = False
    ) -> bool:
        self._call("patch_workload_status" if status else "patch_workload")
        found = self.workloads.get(name)
        wanted = patch.get("metadata", {}).get("resourceVersion")
        if found is None or (wanted and wanted != found["metadata"]["resourceVersion"]):
            return False
        body = {k: v for k, v in patch.items() if k != "metadata"}
        updated = merge_patch(found, body)
        updated["metadata"]["resourceVersion"] = str(int(found["metadata"]["resourceVersion"]) + 1)
        self.workloads[name] = updated
        return True

    async def get_cluster_object(
        self, group: str, version: str, plural: str, name: str
    ) -> dict[str, Any] | None:
        self._call("get_cluster_object")
        return self.cluster_objects.get((plural, name))

    # -- what KubeRay, the stand-in and the trainer would do ---------------------------------

    def make_cluster_ready(self) -> None:
        """KubeRay: every pod Ready; the stand-in: the dashboard published."""
        cluster = self.clusters[NAME]
        cluster["status"] = {"state": ray.STATE_READY}
        cluster["metadata"]["annotations"] = {contract.DASHBOARD_ANNOTATION: DASHBOARD}
        self.pods[NAME] = [
            _pod(f"{group['groupName']}-{i}", ray.NODE_WORKER, group["groupName"])
            for group in cluster["spec"]["workerGroupSpecs"]
            for i in range(group["replicas"])
        ] + [_pod("head", ray.NODE_HEAD, "headgroup")]

    def beat(self, renewed: datetime, report: LeaseReport) -> None:
        """The trainer renews its Lease."""
        self.leases[NAME] = V1Lease(
            metadata=V1ObjectMeta(name=NAME, annotations=report.to_annotations()),
            spec=V1LeaseSpec(renew_time=renewed),
        )


def _pod(name: str, node_type: str, group: str) -> V1Pod:
    labels = {ray.LABEL_CLUSTER: NAME, ray.LABEL_NODE_TYPE: node_type, ray.LABEL_GROUP: group}
    return V1Pod(
        metadata=V1ObjectMeta(name=name, labels=labels, creation_timestamp=T0),
        status=V1PodStatus(conditions=[V1PodCondition(type="Ready", status="True")]),
    )


class FakeRayJobs:
    """A Ray dashboard: jobs by submission id."""

    def __init__(self) -> None:
        self.jobs: dict[str, RayJobView] = {}
        self.submitted: list[dict[str, Any]] = []
        self.stopped: list[str] = []
        self.failing: dict[str, Exception] = {}
        self.tokens: set[str | None] = set()
        """The Ray tokens the calls carried."""

    def _call(self, method: str, dashboard: Dashboard) -> None:
        self.tokens.add(dashboard.token)
        if method in self.failing:
            raise self.failing[method]

    async def status(self, dashboard: Dashboard, submission_id: str) -> RayJobView | None:
        self._call("status", dashboard)
        return self.jobs.get(submission_id)

    async def submit(
        self,
        dashboard: Dashboard,
        submission_id: str,
        entrypoint: str,
        *,
        env: dict[str, str],
        metadata: dict[str, str],
    ) -> None:
        self._call("submit", dashboard)
        self.submitted.append(
            {"id": submission_id, "entrypoint": entrypoint, "env": env, "metadata": metadata}
        )
        self.jobs.setdefault(submission_id, RayJobView(submission_id, "PENDING"))

    async def stop(self, dashboard: Dashboard, submission_id: str) -> None:
        self._call("stop", dashboard)
        self.stopped.append(submission_id)


class World:
    """The reconciler wired to the fakes, with a clock the test moves."""

    def __init__(
        self, policy: JobPolicy | None = None, kube: FakeKube | None = None, **spec: Any
    ) -> None:
        self.kube = kube or FakeKube()
        self.ray = FakeRayJobs()
        self.metrics = OperatorMetrics()
        self.events: list[Event] = []
        self.now = T0
        self.reconciler = Reconciler(
            self.kube,
            self.ray,
            self.metrics,
            emit=lambda body, event: self.events.append(event),
            ray_auth=RAY_AUTH,
            policy=policy,
            clock=lambda: self.now,
            dashboard_from_annotation=True,
        )
        document = merge_patch(valid_job(NAME), {"spec": spec})
        document["metadata"].update(
            namespace=NAMESPACE,
            uid="12345678-abcd",
            generation=1,
            creationTimestamp=T0.isoformat(),
        )
        self.kube.jobs[NAME] = document

    def reconcile(self, after: float = 0) -> float | None:
        self.now = T0 + timedelta(seconds=after)
        return asyncio.run(self.reconciler.reconcile(NAMESPACE, NAME))

    @property
    def status(self) -> dict[str, Any]:
        return dict(self.kube.jobs[NAME].get("status") or {})

    def condition(self, type_: str) -> dict[str, Any]:
        return next(c for c in self.status["conditions"] if c["type"] == type_)

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]

    def sample(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)

    def running(self) -> None:
        """Provisioned, submitted and RUNNING in Ray."""
        self.reconcile(0)
        self.kube.make_cluster_ready()
        self.reconcile(1)
        self.ray.jobs[FIRST_ATTEMPT] = RayJobView(FIRST_ATTEMPT, "RUNNING")
        self.reconcile(2)


# -- the happy path ---------------------------------------------------------------------------


def test_every_dashboard_call_carries_the_token_of_the_jobs_secret() -> None:
    world = World()
    world.running()
    job = parse_job(world.kube.jobs[NAME])
    secret = next(iter(world.kube.secrets.values()))
    token = base64.b64decode(secret["data"]["auth_token"]).decode()
    assert token == RAY_AUTH.token(job) and len(token) == 64
    assert world.ray.tokens == {token}
    cluster = next(m for m in world.kube.applied if m["kind"] == "RayCluster")
    secret_name = secret["metadata"]["name"]
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": secret_name}
    assert token not in str(world.status) and all(token not in e.message for e in world.events)


HEAD_SERVICE = f"{NAME}-head-svc"
FOREIGN_SERVICES: dict[str, dict[str, Any] | None] = {
    "another-controller": {
        "kind": "Service",
        "metadata": {
            "name": HEAD_SERVICE,
            "ownerReferences": [
                {"kind": ray.RAY_CLUSTER_KIND, "name": NAME, "uid": "forged", "controller": True}
            ],
        },
    },
    "no-controller": {"kind": "Service", "metadata": {"name": HEAD_SERVICE}},
    "missing": None,
}


@pytest.mark.parametrize("service", list(FOREIGN_SERVICES))
@pytest.mark.attack(
    "a Service named like the job's head Service that its RayCluster does not control (made "
    "first by someone else) receives the job's Ray token and answers for the head",
    "the head Service's controller is checked to be the job's RayCluster (by uid) before any "
    "call carries the token (rlhf_operator.parsers.head_service_problem)",
)
def test_a_head_service_the_cluster_does_not_control_never_gets_the_token(service: str) -> None:
    world = World()
    world.reconcile(0)
    world.kube.make_cluster_ready()
    world.kube.services[HEAD_SERVICE] = FOREIGN_SERVICES[service]
    world.reconcile(1)
    assert world.reconciler.dashboard_asks == 0 and world.ray.tokens == set()
    assert world.ray.submitted == []
    condition = world.condition("DashboardReachable")
    assert condition["status"] == "False"
    assert "the job's token is not sent" in condition["message"]
    # KubeRay's own Service (controlled by the cluster, by uid): asked, and the trainer starts.
    del world.kube.services[HEAD_SERVICE]
    world.reconcile(10)
    assert world.ray.tokens == {RAY_AUTH.token(parse_job(world.kube.jobs[NAME]))}
    assert [s["id"] for s in world.ray.submitted] == [FIRST_ATTEMPT]


def test_an_operator_that_may_not_read_the_head_service_sends_no_token() -> None:
    world = World()
    world.reconcile(0)
    world.kube.make_cluster_ready()
    world.kube.failing["get_service"] = ApiException(status=403, reason="Forbidden")
    world.reconcile(1)
    assert world.ray.tokens == set()
    assert "grant get on services" in world.condition("DashboardReachable")["message"]


def test_a_head_service_replaced_under_a_running_job_is_asked_nothing_more() -> None:
    world = World()
    world.running()
    asked = world.reconciler.dashboard_asks
    world.kube.services[HEAD_SERVICE] = FOREIGN_SERVICES["another-controller"]
    world.reconcile(3)
    world.reconcile(4)
    assert world.reconciler.dashboard_asks == asked
    assert world.condition("DashboardReachable")["status"] == "False"


def test_tokens_differ_by_job_and_by_key() -> None:
    job = parse_job(World().kube.jobs[NAME])
    other = job.model_copy(update={"metadata": job.metadata.model_copy(update={"uid": "other"})})
    assert RAY_AUTH.token(job) != RAY_AUTH.token(other)
    assert RAY_AUTH.token(job) != RayAuth(b"j" * 32).token(job)
    assert "k" * 32 not in repr(RAY_AUTH) + repr(Dashboard("http://head", RAY_AUTH.token(job)))


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"checkpoint": {"volume": {"hostPath": {"path": "/"}}}}, "spec.checkpoint.volume"),
        ({"serviceAccountName": "someone-elses"}, "spec.serviceAccountName"),
        (
            {
                "roles": {
                    "trainer": {"pod": {"volumes": [{"name": "n", "hostPath": {"path": "/"}}]}}
                }
            },
            "spec.roles.trainer.pod.volumes[0]",
        ),
        (  # nothing approved: a job may name no destination (rlhf_operator.policy_egress)
            {"reward": {"type": "remote", "function": None, "remote": {"url": "http://x:80/"}}},
            "spec.reward.remote.url: 'http://x:80/' is not an approved egress destination",
        ),
    ],
)
def test_a_job_that_borrows_power_fails_before_any_cluster_exists(
    spec: dict[str, Any], field: str
) -> None:
    world = World(**spec)
    world.reconcile()
    assert world.kube.applied == [] and world.ray.submitted == []
    assert world.status["phase"] == "Failed"
    assert field in world.status["message"]
    assert world.reasons() == ["InvalidSpec"]
    world.reconcile(5)  # and it stays that way, without a second Event
    assert world.reasons() == ["InvalidSpec"] and world.kube.applied == []


def test_the_policy_admits_what_it_lists() -> None:
    policy = JobPolicy(
        allowed_volume_types=("hostPath",), allowed_service_accounts=("trainer-with-s3",)
    )
    world = World(
        policy=policy,
        serviceAccountName="trainer-with-s3",
        checkpoint={"volume": {"hostPath": {"path": "/data"}}},
    )
    world.reconcile()
    assert world.status["phase"] == "Provisioning"


@pytest.mark.attack(
    "a running job patched to break the job policy keeps running",
    "the operator's policy check at every reconcile: Failed, cluster deleted",
)
def test_a_running_job_that_comes_to_break_the_policy_fails_and_loses_its_cluster() -> None:
    """Checked at every reconcile, not only before the cluster: here a field changed past an
    admission policy (or one switched off), on a job that runs."""
    world = World()
    world.running()
    assert world.status["phase"] == "Running"
    tolerate_all = {"roles": {"trainer": {"tolerations": [{"operator": "Exists"}]}}}
    world.kube.jobs[NAME] = merge_patch(world.kube.jobs[NAME], {"spec": tolerate_all})
    world.reconcile(10)
    assert world.status["phase"] == "Failed"
    assert "spec.roles.trainer.tolerations[0]" in world.status["message"]
    assert "InvalidSpec" in world.reasons()
    assert f"RayCluster/{NAME}" in world.kube.deleted, "its pods keep running otherwise"
    assert world.ray.stopped, "the trainer is stopped"


def test_a_new_job_gets_its_objects_applied_and_its_lease_created() -> None:
    world = World()
    world.reconcile()
    kinds = [m["kind"] for m in world.kube.applied]
    assert kinds == [
        "ServiceAccount",
        "Role",
        "NetworkPolicy",
        "NetworkPolicy",  # the head's, to the API server
        "PodDisruptionBudget",
        "ConfigMap",
        "RoleBinding",  # after the Role it binds
        "RayCluster",  # after everything its pods need
    ]
    job = parse_job(world.kube.jobs[NAME])
    (secret,) = world.kube.secrets  # created, never applied (the operator cannot read it back)
    assert secret == names.ray_auth_secret_name(job, RAY_AUTH.token(job))
    cluster = world.kube.clusters[NAME]
    assert cluster["spec"]["authOptions"]["secretName"] == secret
    assert names.heartbeat_lease_name(job) in world.kube.leases
    assert world.status["phase"] == "Provisioning"
    assert world.reasons() == ["Provisioning"]
    assert world.sample("rlhf_operator_reconciles_total", result="ok") == 1


def test_a_ready_cluster_gets_the_trainer_submitted_with_the_contracts_environment() -> None:
    world = World()
    world.reconcile(0)
    world.kube.make_cluster_ready()
    world.reconcile(1)
    assert world.ray.submitted == [
        {
            "id": FIRST_ATTEMPT,
            "entrypoint": "rlhfjob train",
            "env": contract.PodEnv(job_name=NAME, job_namespace=NAMESPACE, attempt=0).to_env(),
            "metadata": {"rlhfjob": NAME, "attempt": "0"},
        }
    ]
    assert world.status["phase"] == "Running"
    assert world.status["submissionId"] == FIRST_ATTEMPT
    assert world.reasons() == ["Provisioning", "Submitted"]
    assert world.sample("rlhf_operator_ray_job_submissions_total") == 1


def test_reconciling_an_unchanged_world_writes_nothing() -> None:
    world = World()
    world.running()
    patches, applied = len(world.kube.status_patches), len(world.kube.applied)
    world.reconcile(2)
    assert len(world.kube.status_patches) == patches
    assert len(world.kube.applied) == applied
    assert len(world.ray.submitted) == 1


def test_the_lease_report_reaches_the_status() -> None:
    world = World()
    world.running()
    engines = contract.EngineCount(1, 1)
    report = LeaseReport(step=7, step_changed=T0, attempt=0, checkpoint_step=5,
                         checkpoint_path="/ckpt/5", rollout_engines=engines)  # fmt: skip
    world.kube.beat(T0 + timedelta(seconds=3), report)
    world.reconcile(4)
    assert world.status["currentStep"] == 7
    assert world.status["lastCheckpoint"]["step"] == 5
    assert world.condition("Healthy")["status"] == "True"


def test_a_failed_trainer_is_restarted_and_counted_by_reason() -> None:
    world = World()
    world.running()
    # Exported from zero before the first restart: rate() sees the first one as an increase.
    assert world.sample("rlhf_operator_restarts_total", reason="TrainerFailed") == 0
    assert world.sample("rlhf_operator_recovery_seconds_count", reason="TrainerHung") == 0
    world.ray.jobs[FIRST_ATTEMPT] = RayJobView(FIRST_ATTEMPT, "FAILED", "boom", exit_code=1)
    world.reconcile(5)
    assert world.status["phase"] == "Recovering"
    assert world.status["restartHistory"][-1]["reason"] == "TrainerFailed"
    assert world.sample("rlhf_operator_restarts_total", reason="TrainerFailed") == 1
    job = {"namespace": NAMESPACE, "rlhfjob": NAME}
    assert world.sample("rlhf_operator_job_restarts_total", **job, reason="TrainerFailed") == 1
    assert world.sample("rlhf_operator_job_restarts_total", **job, reason="TrainerHung") == 0
    assert world.sample("rlhf_operator_job_restart_count", **job) == 1
    assert world.sample("rlhf_operator_job_max_restarts", **job) == 3
    assert world.sample("rlhf_operator_job_phase", **job, phase="Recovering") == 1
    assert world.sample("rlhf_operator_job_phase", **job, phase="Running") is None, "one phase"


def test_each_job_has_series_of_its_progress_and_conditions_until_it_goes() -> None:
    world = World()
    world.running()
    job = {"namespace": NAMESPACE, "rlhfjob": NAME}
    world.kube.beat(T0 + timedelta(seconds=3), LeaseReport(step=2, step_changed=T0, attempt=0))
    world.reconcile(3)
    later = T0 + timedelta(seconds=4)
    world.kube.beat(later, LeaseReport(step=6, step_changed=later, total_steps=10, attempt=0))
    world.reconcile(4)
    assert world.sample("rlhf_operator_job_step", **job) == 6
    assert world.sample("rlhf_operator_job_total_steps", **job) == 10
    assert world.sample("rlhf_operator_job_steps_per_second", **job) == 1.0
    eta = world.sample("rlhf_operator_job_eta_timestamp_seconds", **job)
    assert eta == (later + timedelta(seconds=4)).timestamp()
    assert world.status["progress"]["stepsPerSecond"] == 1.0
    assert world.sample("rlhf_operator_job_condition", **job, condition="Healthy") == 1
    assert world.sample("rlhf_operator_job_condition", **job, condition="ClusterReady") == 1
    del world.kube.jobs[NAME]
    world.reconcile(5)
    names = {s.name for family in world.metrics.registry.collect() for s in family.samples
             if s.labels.get("rlhfjob") == NAME}  # fmt: skip
    assert names == set(), "a deleted job leaves no series behind"


def test_cleared_status_fields_are_written_as_null() -> None:
    world = World(suspend=False)
    world.running()
    world.kube.jobs[NAME]["spec"]["suspend"] = True
    world.reconcile(3)
    assert world.kube.status_patches[-1]["submissionId"] is None
    assert "submissionId" not in world.status
    assert world.ray.stopped == [FIRST_ATTEMPT]


def test_an_invalid_job_fails_with_the_reason() -> None:
    world = World()
    world.kube.jobs[NAME]["spec"]["algorithm"]["totalSteps"] = -1
    assert world.reconcile() is None
    assert world.status["phase"] == "Failed"
    assert "spec.algorithm.totalSteps" in world.status["message"]
    assert world.reasons() == ["InvalidSpec"]
    assert world.kube.applied == []


def test_a_running_job_with_fields_of_a_newer_crd_is_left_alone_not_failed() -> None:
    """A CRD upgraded before the operator defaults a new field into every job: the old
    operator does not know it, and must not fail a job that trains (it did, in a soak)."""
    world = World()
    job = world.kube.jobs[NAME]
    job["status"] = {"phase": "Running", "currentStep": 12}
    job["spec"]["algorithm"]["newerKnob"] = 0
    assert world.reconcile() == 60.0
    assert world.status["phase"] == "Running"
    assert "does not know spec.algorithm.newerKnob" in world.status["message"]
    assert "upgrade the operator" in world.status["message"]
    assert world.reasons() == ["OperatorOutdated"]
    world.reconcile()
    assert world.reasons() == ["OperatorOutdated"], "said once"
    assert world.kube.applied == []


def test_a_job_only_the_models_can_refuse_fails_naming_the_field() -> None:
    """A pod volume of two sources passes the CRD (its source is free-form): the operator's
    first reconcile refuses it."""
    world = World(pods={"volumes": [{"name": "m", "emptyDir": {}, "configMap": {"name": "m"}}]})
    assert world.reconcile() is None
    assert world.status["phase"] == "Failed"
    assert "spec.pods.volumes[0]: a volume has one source" in world.status["message"]
    assert world.reasons() == ["InvalidSpec"] and world.kube.applied == []


def test_a_deleted_job_is_forgotten() -> None:
    world = World()
    world.reconcile()
    del world.kube.jobs[NAME]
    assert world.reconcile() is None
    assert world.sample("rlhf_operator_jobs", phase="Provisioning") == 0


# -- each port failing ------------------------------------------------------------------------


def test_a_refused_submission_is_decided_by_the_policy_not_patched_into_the_plan() -> None:
    world = World()
    world.reconcile(0)
    world.kube.make_cluster_ready()
    world.ray.failing["submit"] = DashboardUnavailableError("POST /api/jobs/: HTTP 500: busy")
    due = world.reconcile(1)
    assert world.status["phase"] == "Provisioning"  # not Running: nothing was submitted
    assert "submissionId" not in world.status
    assert world.status["message"] == (
        "could not submit the trainer: POST /api/jobs/: HTTP 500: busy"
    )
    reachable = world.condition("DashboardReachable")
    assert (reachable["status"], reachable["reason"]) == ("False", "SubmitFailed")
    assert reachable["lastTransitionTime"] == "2026-01-01T00:00:01Z"  # the injected clock
    assert "Submitted" not in world.reasons()
    assert due is not None and due <= 5
    assert world.sample("rlhf_operator_ray_job_submission_failures_total") == 1

    del world.ray.failing["submit"]  # Ray takes it on the next reconcile
    world.reconcile(7)
    assert world.status["submissionId"] == FIRST_ATTEMPT
    assert world.reasons()[-1] == "Submitted"
    assert world.condition("DashboardReachable")["status"] == "True"


def test_an_unreachable_dashboard_is_a_condition_not_an_error() -> None:
    world = World()
    world.reconcile(0)
    world.kube.make_cluster_ready()
    world.ray.failing["status"] = DashboardUnavailableError("GET /api/jobs/x: timed out")
    world.reconcile(1)
    reachable = world.condition("DashboardReachable")
    assert (reachable["status"], reachable["reason"]) == ("False", "Unreachable")
    assert reachable["message"] == "GET /api/jobs/x: timed out"
    assert world.ray.submitted == []
    assert world.sample("rlhf_operator_reconciles_total", result="ok") == 2


def test_a_failed_stop_does_not_keep_the_job_from_suspending() -> None:
    world = World()
    world.running()
    world.ray.failing["stop"] = DashboardUnavailableError("POST stop: refused")
    world.kube.jobs[NAME]["spec"]["suspend"] = True
    world.reconcile(3)
    assert world.status["phase"] == "Suspended"
    assert "RayCluster/job" in world.kube.deleted


def test_a_bug_behind_the_ray_port_shows_as_an_error_not_as_an_unreachable_dashboard() -> None:
    world = World()
    world.reconcile(0)
    world.kube.make_cluster_ready()
    world.ray.failing["status"] = KeyError("status")
    with pytest.raises(KeyError):
        world.reconcile(1)
    assert world.sample("rlhf_operator_reconciles_total", result="error") == 1
    assert world.status["phase"] == "Provisioning"  # nothing was written on a guess


@pytest.mark.parametrize(
    "method",
    ["get_job", "get_ray_cluster", "cluster_pods", "get_lease", "apply", "patch_job_status"],
)
def test_an_api_server_error_fails_the_reconcile_for_the_timer_to_retry(method: str) -> None:
    world = World()
    if method != "apply":  # a new job is applied; a ready cluster is read, its pods and Lease
        world.reconcile(0)
        world.kube.make_cluster_ready()
    world.kube.failing[method] = ApiException(status=500, reason="etcd is down")
    with pytest.raises(ApiException):
        world.reconcile(1)
    assert world.sample("rlhf_operator_reconciles_total", result="error") == 1
    del world.kube.failing[method]
    world.reconcile(2)
    assert world.status["phase"] == ("Provisioning" if method == "apply" else "Running")


# -- what only the cluster can tell (issue 13) ------------------------------------------------

INVALID_CLUSTER = (
    'RayCluster.ray.io "job" is invalid: spec.headGroupSpec.template.spec.volumes[2]'
    ".persistentVolumeClaim.claimName: Required value"
)


def test_a_raycluster_the_api_server_refuses_fails_the_job_quoting_why_once() -> None:
    world = World()
    world.kube.refusing["RayCluster"] = ApplyRefusedError(422, "Invalid", INVALID_CLUSTER)
    assert world.reconcile(0) is None
    assert world.status["phase"] == "Failed"
    assert world.status["message"] == (
        f"the API server refused the RayCluster job (422 Invalid): {INVALID_CLUSTER}"
    )
    assert world.condition("Failed")["reason"] == "ClusterRejected"
    assert world.condition("ClusterReady")["reason"] == "ClusterRejected"
    assert [(e.type, e.reason) for e in world.events] == [("Warning", "ClusterRejected")]
    assert INVALID_CLUSTER in world.events[0].message
    assert "RayCluster" not in [m["kind"] for m in world.kube.applied]
    applied, patches = len(world.kube.applied), len(world.kube.status_patches)
    for after in (5, 10, 60):  # no retry loop: nothing applied, written or said again
        assert world.reconcile(after) is None
    assert (len(world.kube.applied), len(world.kube.status_patches)) == (applied, patches)
    assert len(world.events) == 1
    assert world.sample("rlhf_operator_reconciles_total", result="error") is None


def test_a_refused_secret_never_shows_its_value() -> None:
    world = World()
    job = parse_job(world.kube.jobs[NAME])
    token = RAY_AUTH.token(job)
    encoded = base64.b64encode(token.encode()).decode()
    echo = f'Secret "job-ray-auth" is invalid: data[auth_token]: Invalid value: "{encoded}" {token}'
    world.kube.refusing["Secret"] = ApplyRefusedError(422, "Invalid", echo)
    world.reconcile(0)
    assert world.status["phase"] == "Failed"
    assert "Secret" in world.status["message"] and "[redacted]" in world.status["message"]
    shown = str(world.status) + "".join(e.message for e in world.events)
    assert token not in shown and encoded not in shown


FORBIDDEN_ROLE = (
    'roles.rbac.authorization.k8s.io "job-trainer" is forbidden: user "system:serviceaccount:'
    'rlhf:rlhf-operator" is attempting to grant RBAC permissions not currently held'
)


def test_a_forbidden_object_is_shown_retried_and_created_once_allowed() -> None:
    world = World()
    world.kube.refusing["Role"] = ApplyRefusedError(403, "Forbidden", FORBIDDEN_ROLE)
    due = world.reconcile(0)
    assert world.status["phase"] == "Provisioning"
    assert FORBIDDEN_ROLE in world.status["message"]
    ready = world.condition("ClusterReady")
    assert (ready["status"], ready["reason"]) == ("False", "ApplyRefused")
    assert FORBIDDEN_ROLE in ready["message"]
    assert due is not None and due <= 5  # soon again, not only at the timer's pace
    # What the pods need is applied at once; the RoleBinding and the RayCluster only once all
    # of it was taken.
    others = [
        "ServiceAccount",
        "NetworkPolicy",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "ConfigMap",
    ]
    assert [m["kind"] for m in world.kube.applied] == others
    world.reconcile(3)
    assert [m["kind"] for m in world.kube.applied] == others * 2  # tried again
    del world.kube.refusing["Role"]  # RBAC granted
    world.reconcile(6)
    assert "RayCluster" in [m["kind"] for m in world.kube.applied]
    assert world.status["message"] == "creating the RayCluster"
    assert world.condition("ClusterReady")["reason"] == "Creating"
    assert world.sample("rlhf_operator_reconciles_total", result="error") is None


@pytest.mark.parametrize("kind", ["ServiceAccount", "ConfigMap", "RoleBinding", "Lease"])
def test_an_object_of_the_jobs_name_that_is_someone_elses_fails_the_job_naming_it(
    kind: str,
) -> None:
    world = World()
    job = parse_job(world.kube.jobs[NAME])
    squat = next(
        m
        for m in [
            *builder.build_owned_objects(job, "t", NetworkSettings()),
            builder.build_heartbeat_lease(job),
        ]
        if m["kind"] == kind
    )
    squatter = {**squat, "metadata": {**squat["metadata"], "ownerReferences": []}}
    world.kube.objects[(kind, squat["metadata"]["name"])] = squatter
    world.reconcile(0)
    assert world.status["phase"] == "Failed"
    assert (
        f"{kind} ns/{squat['metadata']['name']} exists and is not this job's"
        in (world.status["message"])
    )
    assert world.kube.objects[(kind, squat["metadata"]["name"])] is squatter  # untouched
    assert "RayCluster" not in [m["kind"] for m in world.kube.applied]
    world.reconcile(60)
    assert world.status["phase"] == "Failed"  # no retry loop


def test_a_raycluster_of_the_jobs_name_that_is_someone_elses_is_never_used_or_deleted() -> None:
    world = World()
    foreign = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
               "metadata": {"name": NAME, "namespace": "ns", "uid": "theirs"},
               "spec": {"workerGroupSpecs": []}, "status": {"state": ray.STATE_READY}}  # fmt: skip
    world.kube.clusters[NAME] = foreign
    world.kube.objects[(ray.RAY_CLUSTER_KIND, NAME)] = foreign
    world.reconcile(0)
    assert world.status["phase"] == "Failed"
    assert f"RayCluster ns/{NAME} exists and is not this job's" in world.status["message"]
    assert world.kube.calls.get("cluster_pods") is None  # not read through either
    world.reconcile(5)
    assert world.kube.clusters[NAME] is foreign
    assert f"RayCluster/{NAME}" not in world.kube.deleted
    assert world.ray.submitted == [] and world.ray.tokens == set()  # nothing sent to it


def test_a_raycluster_of_an_earlier_job_of_the_same_name_is_waited_out() -> None:
    world = World()
    owner = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "name": NAME,
             "uid": "earlier", "controller": True}  # fmt: skip
    leftover = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
                "metadata": {"name": NAME, "namespace": "ns", "uid": "old",
                             "ownerReferences": [owner]}, "spec": {}}  # fmt: skip
    world.kube.clusters[NAME] = leftover
    world.reconcile(0)
    assert world.status["phase"] == "Provisioning"
    assert "earlier RLHFJob of this name" in world.status["message"]
    del world.kube.clusters[NAME]  # the garbage collector caught up
    world.reconcile(10)
    assert world.kube.clusters[NAME]["metadata"]["ownerReferences"][0]["uid"] != "earlier"


def test_a_forbidden_object_fails_the_job_like_a_cluster_that_never_became_ready() -> None:
    world = World(provisioningTimeoutSeconds=30)
    world.kube.refusing["RayCluster"] = ApplyRefusedError(403, "Forbidden", "exceeded quota")
    world.reconcile(0)
    world.reconcile(15)
    assert world.status["phase"] == "Provisioning"
    world.reconcile(31)
    assert world.status["phase"] == "Failed"
    assert world.status["message"] == (
        "the RayCluster was not ready after 30s: the API server refused the RayCluster job "
        "(403 Forbidden): exceeded quota"
    )
    assert world.reasons() == ["Provisioning", "ProvisioningTimeout"]


PSA = (
    'Failed to create head Pod ns/job-head-x, pods "job-head-x" is forbidden: violates '
    'PodSecurity "restricted:latest": allowPrivilegeEscalation != false'
)
QUOTA = (
    'Failed to create head Pod ns/job-head-x, pods "job-head-x" is forbidden: exceeded quota: '
    "pods, requested: pods=1, used: pods=0, limited: pods=0"
)


def kuberay_warning(message: str, first: float) -> CoreV1Event:
    return CoreV1Event(
        metadata=V1ObjectMeta(name=f"job.{first}"),
        involved_object=V1ObjectReference(kind="RayCluster", name=NAME),
        type="Warning",
        reason="FailedToCreateHeadPod",
        message=message,
        first_timestamp=T0 + timedelta(seconds=first),
        last_timestamp=T0 + timedelta(seconds=first),
    )


@pytest.mark.parametrize(
    ("message", "after", "phase", "reasons"),
    [
        (PSA, 30, "Provisioning", ["Provisioning"]),
        (PSA, 62, "Failed", ["Provisioning", "PodCreationFailed"]),
        (QUOTA, 62, "Provisioning", ["Provisioning"]),
        (QUOTA, 601, "Failed", ["Provisioning", "ProvisioningTimeout"]),
    ],
)
def test_pods_kuberay_cannot_create_show_at_once_and_fail_when_retrying_cannot_help(
    message: str, after: float, phase: str, reasons: list[str]
) -> None:
    world = World(provisioningTimeoutSeconds=600)
    world.reconcile(0)  # the RayCluster is created; KubeRay cannot create its head pod
    world.kube.events[NAME] = [kuberay_warning(message, first=1)]
    world.reconcile(2)
    assert world.status["phase"] == "Provisioning"
    shown = f"waiting for Ray pods: KubeRay FailedToCreateHeadPod: {message}"
    assert world.status["message"] == shown
    ready = world.condition("ClusterReady")
    assert (ready["reason"], ready["message"]) == ("PodCreationFailed", world.status["message"])
    world.reconcile(after)
    assert world.status["phase"] == phase
    assert message in world.status["message"]
    assert world.reasons() == reasons
    assert ("RayCluster/job" in world.kube.deleted) is (phase == "Failed")


def test_a_ready_cluster_costs_no_event_reads() -> None:
    world = World()
    world.reconcile(0)
    world.reconcile(1)  # not ready yet: KubeRay's Warnings are read
    assert world.kube.event_reads == 1
    world.kube.make_cluster_ready()
    world.kube.failing["cluster_events"] = AssertionError("read in steady state")
    for after in (2, 3, 4):
        world.reconcile(after)
    assert world.status["phase"] == "Running"


def test_a_garbled_raycluster_and_events_do_not_crash_the_reconciler() -> None:
    world = World()
    world.reconcile(0)
    cluster = world.kube.clusters[NAME]
    cluster["status"] = "garbage"
    cluster["spec"]["workerGroupSpecs"] = ["junk", {"groupName": 5}, {"groupName": "x"}]
    cluster["metadata"]["annotations"] = ["junk"]
    world.kube.pods[NAME] = [V1Pod(), V1Pod(metadata=V1ObjectMeta())]
    world.kube.events[NAME] = [
        CoreV1Event(metadata=V1ObjectMeta(), involved_object=V1ObjectReference())
    ]
    world.reconcile(1)
    assert world.status["phase"] == "Provisioning"
    assert world.sample("rlhf_operator_reconciles_total", result="error") is None


# -- the real port: which errors are the API server refusing the object -----------------------


class _Stored:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def to_dict(self) -> dict[str, Any]:
        return self.body


class _Resource:
    """One kind in the API server: `existing` is the object of the manifest's name, if any."""

    def __init__(self, fail: Exception | None, existing: list[dict[str, Any]] | None = None):
        self.fail = fail
        self.existing = list(existing or [])
        """What each read finds, in turn (the last one stays)."""
        self.reads = 0

    def get(self, **_: Any) -> _Stored:
        self.reads += 1
        if not self.existing:
            raise dynamic.exceptions.NotFoundError(ApiException(status=404, reason="NotFound"))
        return _Stored(self.existing[min(self.reads, len(self.existing)) - 1])

    def create(self, **_: Any) -> None:
        if self.fail is not None:
            raise self.fail


class _Dynamic:
    """The slice of `kubernetes.dynamic.DynamicClient` that `Kube.apply` uses."""

    def __init__(
        self, fail: Exception | None, existing: list[dict[str, Any]] | None = None
    ) -> None:
        self.fail = fail
        self.resources = self
        self.resource = _Resource(fail, existing)
        self.applied: list[dict[str, Any]] = []
        self.conflicts = 0
        """How many server-side applies answer 409 first (the uid precondition failed)."""

    def get(self, **_: Any) -> _Resource:
        return self.resource

    def server_side_apply(self, resource: Any, body: dict[str, Any], **_: Any) -> None:
        if self.fail is not None:
            raise self.fail
        if self.conflicts > 0:
            self.conflicts -= 1
            raise _api_error(409, reason="Conflict", message="Precondition failed: UID")
        self.applied.append(body)


def _api_error(code: int, **status: Any) -> dynamic.exceptions.DynamicApiError:
    raw = ApiException(status=code, reason="HTTP reason")
    raw.body = json.dumps({"kind": "Status", "code": code, **status})
    raw.headers = {"Authorization": "Bearer not-for-status"}
    return dynamic.exceptions.api_exception(raw)


def _kube(fail: Exception | None = None, existing: list[dict[str, Any]] | None = None) -> Kube:
    kube = Kube(client.ApiClient())
    kube._dynamic = _Dynamic(fail, existing)  # type: ignore[assignment]
    return kube


MANIFEST = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
            "metadata": {"name": "job", "namespace": "ns"}}  # fmt: skip


@pytest.mark.parametrize(
    ("method", "code"),
    [("apply", 400), ("apply", 403), ("apply", 422),
     ("create_if_missing", 400), ("create_if_missing", 403), ("create_if_missing", 422)],
)  # fmt: skip
def test_the_kube_port_reports_a_refused_object_with_the_status_words_only(
    method: str, code: int
) -> None:
    kube = _kube(_api_error(code, reason="Invalid", message="spec.x: Required value",
                            details={"causes": [{"message": "the object echoed"}]}))  # fmt: skip
    with pytest.raises(ApplyRefusedError) as refused:
        asyncio.run(getattr(kube, method)(MANIFEST))
    assert (refused.value.code, refused.value.reason, refused.value.message) == (
        code, "Invalid", "spec.x: Required value"
    )  # fmt: skip
    assert "Bearer" not in str(refused.value) and "echoed" not in str(refused.value)
    assert refused.value.__cause__ is None and refused.value.__suppress_context__


@pytest.mark.parametrize("code", [401, 404, 429, 500, 503])
def test_other_api_errors_stay_errors_for_the_timer(code: int) -> None:
    with pytest.raises(ApiException) as raised:
        asyncio.run(_kube(_api_error(code, message="etcd")).apply(MANIFEST))
    assert not isinstance(raised.value, ApplyRefusedError) and raised.value.status == code


OWNER = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "name": "job", "uid": "u-1",
         "controller": True}  # fmt: skip
OWNED = {**MANIFEST, "metadata": {**MANIFEST["metadata"], "ownerReferences": [OWNER]}}


def _existing(uid: str, owner: dict[str, Any] | None) -> dict[str, Any]:
    metadata = {"name": "job", "namespace": "ns", "uid": uid}
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return {"kind": "RayCluster", "metadata": metadata}


def test_an_existing_lease_of_the_job_is_kept() -> None:  # create's 409: it is there already
    kube = _kube(_api_error(409, reason="AlreadyExists"), [_existing("x", OWNER)])
    asyncio.run(kube.create_if_missing(OWNED))


@pytest.mark.parametrize(
    "owner",
    [None, {**OWNER, "uid": "u-2", "name": "other"}, {**OWNER, "controller": False}],
    ids=["no owner", "another job", "not the controller"],
)
@pytest.mark.parametrize("method", ["apply", "create_if_missing"])
def test_the_kube_port_never_adopts_an_object_of_the_jobs_name(
    method: str, owner: dict[str, Any] | None
) -> None:
    kube = _kube(_api_error(409, reason="AlreadyExists"), [_existing("squat", owner)])
    with pytest.raises(ApplyRefusedError) as refused:
        asyncio.run(getattr(kube, method)(OWNED))
    assert refused.value.reason == NOT_OWNED
    assert "RayCluster ns/job exists and is not this job's" in refused.value.message
    assert kube.dynamic.applied == []  # type: ignore[attr-defined]


def test_an_object_of_an_earlier_job_of_the_same_name_is_waited_for() -> None:
    earlier = {**OWNER, "uid": "u-0"}  # deleted and applied again: GC has not caught up yet
    kube = _kube(None, [_existing("old", earlier)])
    with pytest.raises(ApplyRefusedError) as refused:
        asyncio.run(kube.apply(OWNED))
    assert (refused.value.code, refused.value.reason) == (409, "Conflict")  # retried, not Failed
    assert "earlier RLHFJob of this name (uid u-0)" in refused.value.message


def test_the_jobs_own_object_is_applied_with_its_uid_as_a_precondition() -> None:
    kube = _kube(None, [_existing("mine", OWNER)])
    asyncio.run(kube.apply(OWNED))
    (applied,) = kube.dynamic.applied  # type: ignore[attr-defined]
    assert applied["metadata"]["uid"] == "mine"


def test_an_object_replaced_between_read_and_apply_is_read_again_and_refused() -> None:
    # Read: the job's own; then someone deletes it and makes their own before the apply lands.
    kube = _kube(None, [_existing("mine", OWNER), _existing("theirs", None)])
    kube.dynamic.conflicts = 1  # type: ignore[attr-defined]  # the uid precondition fails
    with pytest.raises(ApplyRefusedError) as refused:
        asyncio.run(kube.apply(OWNED))
    assert refused.value.reason == NOT_OWNED
    assert kube.dynamic.applied == []  # type: ignore[attr-defined]


def test_the_auth_secret_is_only_created_and_an_existing_one_kept_unread() -> None:
    kube = _kube(_api_error(409, reason="AlreadyExists"))
    asyncio.run(kube.create_secret({**OWNED, "kind": "Secret"}))
    assert kube.dynamic.resource.reads == 0  # type: ignore[attr-defined]


class _Core:
    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        self.selectors: list[str] = []

    def list_namespaced_event(self, namespace: str, field_selector: str, **_: Any) -> Any:
        self.selectors.append(field_selector)
        if self.fail is not None:
            raise self.fail
        return CoreV1EventList(items=[kuberay_warning(PSA, 1)])


def test_the_kube_port_reads_the_warnings_on_one_raycluster() -> None:
    kube = _kube()
    kube.core = _Core()  # type: ignore[assignment]
    (found,) = asyncio.run(kube.cluster_events("ns", "job"))
    assert found.reason == "FailedToCreateHeadPod"
    assert kube.core.selectors == [  # type: ignore[attr-defined]
        "involvedObject.kind=RayCluster,involvedObject.name=job,type=Warning"
    ]
    kube.core = _Core(ApiException(status=403, reason="Forbidden"))  # type: ignore[assignment]
    assert asyncio.run(kube.cluster_events("ns", "job")) == []  # an older chart: no cause shown
    kube.core = _Core(ApiException(status=500, reason="etcd"))  # type: ignore[assignment]
    with pytest.raises(ApiException):
        asyncio.run(kube.cluster_events("ns", "job"))


# -- many jobs: backing off from silent dashboards, writing only what changed (issue 13) -----


def _ticks(start: float, stop: float, every: float = 5.0) -> list[float]:
    return [start + i * every for i in range(int((stop - start) / every) + 1)]


def test_a_silent_dashboard_is_not_asked_on_every_tick_and_nothing_is_written() -> None:
    world = World()
    world.reconcile(0)
    world.kube.make_cluster_ready()
    world.ray.failing["status"] = DashboardUnavailableError("GET /api/jobs/x: refused")
    asked: list[float] = []
    for seconds in _ticks(1, 601):  # the timer, every 5 s for ten minutes
        before = world.reconciler.dashboard_asks
        assert world.reconcile(seconds) is None  # nothing due: no kick besides the timer
        if world.reconciler.dashboard_asks > before:
            asked.append(seconds)
    # Asked at the ticks on or after 1 + 5, 15, 35, 75, 135, ... s: then once a minute.
    assert asked[:6] == [1, 6, 16, 36, 76, 136]
    gaps = [b - a for a, b in itertools.pairwise(asked)]
    assert max(gaps) <= 60 and len(asked) <= 15  # of 121 ticks
    assert [p.get("conditions") is not None for p in world.kube.status_patches] == [True, True]
    reachable = world.condition("DashboardReachable")
    assert (reachable["status"], reachable["lastTransitionTime"]) == (
        "False", "2026-01-01T00:00:01Z"
    )  # fmt: skip


def test_a_dashboard_that_answers_again_is_seen_at_the_next_ask() -> None:
    world = World()
    world.reconcile(0)
    world.kube.make_cluster_ready()
    world.ray.failing["status"] = DashboardUnavailableError("GET /api/jobs/x: refused")
    for seconds in _ticks(1, 76):
        world.reconcile(seconds)
    del world.ray.failing["status"]  # back at 80 s; the next ask is due at 136 s
    world.reconcile(131)
    assert world.ray.submitted == []
    world.reconcile(136)
    assert [s["id"] for s in world.ray.submitted] == [FIRST_ATTEMPT]
    assert world.condition("DashboardReachable")["status"] == "True"


def test_a_new_cluster_or_address_is_asked_at_once() -> None:
    world = World()
    world.reconcile(0)
    world.kube.make_cluster_ready()
    world.ray.failing["status"] = DashboardUnavailableError("GET /api/jobs/x: refused")
    for seconds in _ticks(1, 76):
        world.reconcile(seconds)
    asks = world.reconciler.dashboard_asks
    annotations = world.kube.clusters[NAME]["metadata"]["annotations"]
    annotations[contract.DASHBOARD_ANNOTATION] = "http://127.0.0.1:9999"  # a new head
    world.reconcile(81)
    assert world.reconciler.dashboard_asks == asks + 1


def test_the_recovery_deadline_fires_on_time_while_backing_off() -> None:
    world = World(recovery={"clusterRecoveryTimeoutSeconds": 100})
    world.running()  # submitted at 1 s, RUNNING at 2 s
    world.ray.failing["status"] = DashboardUnavailableError("GET /api/jobs/x: timed out")
    dues = {seconds: world.reconcile(seconds) for seconds in _ticks(7, 102)}
    assert "RayCluster/job" not in world.kube.deleted
    assert dues[102] == pytest.approx(5)  # the handler kicks at 107 s, the deadline
    world.reconcile(107)
    assert world.kube.deleted == ["RayCluster/job"]
    assert world.status["restartHistory"][-1]["reason"] == "ClusterUnhealthy"
    assert world.status["restartHistory"][-1]["detectionSeconds"] == 100


def test_an_unchanged_running_job_writes_nothing() -> None:
    world = World()
    world.running()
    world.kube.beat(T0 + timedelta(seconds=3), LeaseReport(step=4, attempt=0))
    world.reconcile(4)
    patches = len(world.kube.status_patches)
    for seconds in _ticks(9, 59):  # Lease renewed at 3 s, not since: nothing to write
        world.reconcile(seconds)
    assert len(world.kube.status_patches) == patches
    assert world.ray.tokens  # and the dashboard was asked every time
    assert world.reconciler.dashboard_asks >= 12


def test_a_new_job_applies_its_objects_in_stages_each_at_once() -> None:
    order: list[str] = []

    class Slow(FakeKube):
        async def apply(self, manifest: dict[str, Any]) -> None:
            if manifest["kind"] == "ServiceAccount":
                await asyncio.sleep(0.01)  # the others do not wait for it, the RayCluster does
            order.append(manifest["kind"])
            await super().apply(manifest)

    world = World(kube=Slow())
    world.reconcile(0)
    # The API server refuses a RoleBinding to a Role it does not know yet (404): it comes after.
    assert order[-3:] == ["ServiceAccount", "RoleBinding", "RayCluster"]
    assert set(order[:-3]) == {
        "Role",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "ConfigMap",
    }


def _reads(world: World, *seconds: float) -> dict[str, int]:
    """What the reconciles at `seconds` read from the API server, by method."""
    world.kube.calls.clear()
    for at in seconds:
        world.reconcile(at)
    return {k: n for k, n in world.kube.calls.items() if k.startswith(("get_", "cluster_"))}


def test_waiting_for_a_silent_dashboard_reads_only_the_job_and_its_raycluster() -> None:
    world = World()
    world.reconcile(0)
    world.kube.make_cluster_ready()
    world.ray.failing["status"] = DashboardUnavailableError("GET /api/jobs/x: refused")
    world.reconcile(1)  # asked: silent
    # Nothing submitted, so no trainer: between asks neither pods nor the Lease can matter.
    assert _reads(world, 2, 3, 4) == {"get_job": 3, "get_ray_cluster": 3}
    # When the ask is due, everything is read again (the head Service first: whose it is).
    assert _reads(world, 6) == {"get_job": 1, "get_ray_cluster": 1, "cluster_pods": 1,
                                "get_lease": 1, "get_service": 1}  # fmt: skip


def test_a_submitted_job_with_a_silent_dashboard_still_reads_its_pods_and_lease() -> None:
    world = World()
    world.running()
    world.ray.failing["status"] = DashboardUnavailableError("GET /api/jobs/x: timed out")
    world.reconcile(3)
    assert _reads(world, 4, 5) == {"get_job": 2, "get_ray_cluster": 2, "cluster_pods": 2,
                                   "get_lease": 2, "get_service": 2}  # fmt: skip
    assert world.reconciler.dashboard_asks == 3  # at 1, 2 and 3 s; not at 4 or 5 s


def test_a_cluster_not_ready_yet_is_read_with_its_pods_and_warnings_not_the_lease() -> None:
    world = World()
    world.reconcile(0)
    assert _reads(world, 1) == {"get_job": 1, "get_ray_cluster": 1, "cluster_pods": 1,
                                "cluster_events": 1}  # fmt: skip
    del world.kube.clusters[NAME]  # none (yet, or any more): nothing else to read
    assert _reads(world, 2) == {"get_job": 1, "get_ray_cluster": 1}
    assert world.kube.calls["apply"] == 8


# -- parsing ------------------------------------------------------------------------------------


def _padded(kib: int) -> dict[str, Any]:
    """A `spec.pods` patch of literal env values, `kib` KiB of them."""
    return {"env": [{"name": f"PAD{i}", "value": "x" * 1024 * 16} for i in range(kib // 16)]}


def test_jobs_are_parsed_off_the_event_loop_once_per_version_and_large_ones_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads: list[threading.Thread] = []
    real = reconciler_module.parse_job

    def parse(body: dict[str, Any], source: str = "<object>") -> Any:
        threads.append(threading.current_thread())
        return real(body, source)

    monkeypatch.setattr(reconciler_module, "parse_job", parse)
    small = World()
    small.kube.jobs[NAME]["metadata"]["resourceVersion"] = "1"
    small.reconcile(0)
    small.reconcile(1)
    assert len(threads) == 1 and threads[0] is not threading.main_thread()
    big = World(pods=_padded(48))  # valid (under 128 KiB), but above what the cache keeps
    big.kube.jobs[NAME]["metadata"]["resourceVersion"] = "1"
    big.reconcile(0)
    big.reconcile(1)
    assert len(threads) == 3 and len(big.reconciler._parsed) == 0
    assert big.status["phase"] == "Provisioning"


def test_the_parse_cache_keeps_the_jobs_reconciled_last_within_its_bytes() -> None:
    cache = ParseCache(max_bytes=100, max_entry_bytes=60)
    job = parse_job(valid_job())
    cache.put(("ns", "a"), ("u", "1"), job, 40)
    cache.put(("ns", "b"), ("u", "1"), job, 40)
    assert cache.get(("ns", "a"), ("u", "1")) is job  # now the one reconciled last
    cache.put(("ns", "c"), ("u", "1"), job, 40)  # 120 bytes: b, reconciled longest ago, goes
    assert cache.get(("ns", "b"), ("u", "1")) is None and cache.bytes == 80
    cache.put(("ns", "d"), ("u", "1"), job, 61)  # above one entry's bound: not kept
    assert cache.get(("ns", "d"), ("u", "1")) is None and len(cache) == 2
    assert cache.get(("ns", "a"), ("u", "2")) is None  # another version: parsed again
    cache.put(("ns", "a"), ("u", "2"), job, 10)  # replaces its earlier version
    assert cache.bytes == 50 and len(cache) == 2


@pytest.mark.attack(
    "a spec of megabytes (env values, randomInit) stalls the cluster-wide operator for every "
    "tenant and stays in its memory",
    "the API models refuse a spec above 128 KiB as JSON (randomInit 64 KiB) before validating "
    "the rest; the operator parses off its event loop into a cache bounded in bytes "
    "(rlhfjob.api.base.size_error, rlhf_operator.reconciler.ParseCache)",
)
def test_a_spec_too_large_fails_naming_the_spec_before_any_cluster() -> None:
    world = World(pods=_padded(160))
    world.reconcile(0)
    assert world.status["phase"] == "Failed" and world.kube.applied == []
    assert "spec: takes" in world.status["message"]
    assert "more than the 131072 allowed" in world.status["message"]


# -- node drains --------------------------------------------------------------------------------


def _drain_trainer_node(world: World, driver_exit: ExitCode | None = None) -> None:
    """A running job whose trainer pod's node `kubectl drain` cordons, reconciled once after
    (its driver exited with `driver_exit` meanwhile, if given: then a second later, while the
    cordoned nodes listed a moment before the cordon are still fresh)."""
    world.running()
    world.kube.beat(T0 + timedelta(seconds=2), LeaseReport(step=6, attempt=0))
    for pod in world.kube.pods[NAME]:
        if pod.metadata.labels[ray.LABEL_GROUP] == "trainer":
            pod.metadata.labels[names.LABEL_ROLE] = "trainer"
            pod.spec = V1PodSpec(containers=[], node_name="gpu-train-1")
    world.reconcile(3)
    assert world.status["phase"] == "Running"  # nothing to see: no drain
    world.kube.cordoned = {"gpu-train-1"}  # `kubectl drain gpu-train-1` begins
    if driver_exit is None:
        world.reconcile(10)  # after the cordoned nodes' cache ran out
        return
    ended = T0 + timedelta(seconds=3.5)
    world.ray.jobs[FIRST_ATTEMPT] = RayJobView(
        FIRST_ATTEMPT, "FAILED", exit_code=driver_exit, ended=ended
    )
    world.reconcile(4)


def test_a_cordoned_trainer_node_drains_the_job_onto_a_new_cluster() -> None:
    world = World()
    _drain_trainer_node(world)
    lease = world.kube.leases[NAME].metadata.annotations
    assert contract.LEASE_STOP_REQUESTED_AT in lease, "the trainer is asked to checkpoint"
    assert world.condition("Draining")["reason"] == "NodeDrained"
    assert "gpu-train-1" in world.condition("Draining")["message"]
    assert f"RayCluster/{NAME}" not in world.kube.deleted  # not before the trainer is done

    world.ray.jobs[FIRST_ATTEMPT] = RayJobView(FIRST_ATTEMPT, "FAILED", exit_code=4)
    world.reconcile(20)
    assert f"RayCluster/{NAME}" in world.kube.deleted
    assert contract.LEASE_STOP_REQUESTED_AT not in world.kube.leases[NAME].metadata.annotations
    assert world.status["phase"] == "Provisioning"
    assert world.status["restartCount"] == 0, "moving off a drained node is not a failure"


@pytest.mark.parametrize(
    ("exit_code", "phase"),
    [(ExitCode.FAILED, "Provisioning"), (ExitCode.NON_RETRYABLE, "Failed")],
    ids=["retryable", "non-retryable"],
)
def test_a_driver_that_failed_on_a_cordoned_node_moves_off_it_unless_no_restart_could_help(
    exit_code: ExitCode, phase: str
) -> None:
    # Seen in CI: the drain evicted the rollout pods beside the trainer, and the driver, its
    # engines gone, failed before it heard the stop request. A drain is no failure.
    world = World()
    _drain_trainer_node(world, driver_exit=exit_code)
    assert world.status["phase"] == phase
    assert world.status.get("restartCount", 0) == 0
    if exit_code == ExitCode.FAILED:
        assert f"RayCluster/{NAME}" in world.kube.deleted
        assert "moving the job off gpu-train-1" in world.status["message"]
        assert "being drained" in world.condition("TrainerRunning")["message"]


def test_a_silent_dashboard_never_ends_a_drain_before_the_trainer_saved_its_step() -> None:
    # Seen once in the e2e tier: the dashboard timed out under a checkpointing driver, the
    # drain took the silence for the driver's exit, and the cluster went mid-step.
    world = World()
    _drain_trainer_node(world)
    requested = world.kube.leases[NAME].metadata.annotations[contract.LEASE_STOP_REQUESTED_AT]
    world.ray.failing["status"] = DashboardUnavailableError("GET /api/jobs/x: timed out")
    world.kube.beat(T0 + timedelta(seconds=11), LeaseReport(
        step=7, attempt=0, checkpoint_requested_at=parse_time(requested),
    ))  # fmt: skip
    for second in (12, 14, 20):  # heard, still on its step
        world.reconcile(second)
        assert f"RayCluster/{NAME}" not in world.kube.deleted
        assert world.condition("Draining")["status"] == "True"
    world.kube.beat(T0 + timedelta(seconds=21), LeaseReport(
        step=7, attempt=0, checkpoint_requested_at=parse_time(requested),
        checkpoint_saved_step=7,
    ))  # fmt: skip
    world.reconcile(22)  # the dashboard still silent: the Lease says the step is saved
    assert f"RayCluster/{NAME}" in world.kube.deleted
    drained = world.condition("Draining")
    assert (drained["status"], drained["reason"]) == ("False", "Drained")
    assert "after checkpointing step 7" in drained["message"]


def _place_head(world: World, node: str) -> None:
    """The head pod (made if the cluster has none yet) scheduled onto `node`."""
    pods = world.kube.pods.setdefault(NAME, [])
    if not any(p.metadata.labels[ray.LABEL_NODE_TYPE] == ray.NODE_HEAD for p in pods):
        pods.append(_pod("head", ray.NODE_HEAD, "headgroup"))
    for pod in pods:
        if pod.metadata.labels[ray.LABEL_NODE_TYPE] == ray.NODE_HEAD:
            pod.metadata.labels[names.LABEL_ROLE] = "head"
            pod.spec = V1PodSpec(containers=[], node_name=node)


def _moved_off(world: World, node: str) -> None:
    assert f"RayCluster/{NAME}" in world.kube.deleted, "the cluster stays on the cordoned node"
    assert world.status["phase"] == "Provisioning"
    assert f"moving the job off {node}" in world.status["message"]
    assert "NodeDrained" in world.reasons() and world.status.get("restartCount", 0) == 0


def test_a_cordoned_node_is_seen_while_the_cluster_is_still_provisioning() -> None:
    # Its head Ready on the node, a worker still pending: the budget holds the drain back,
    # and no Ray job runs (none was submitted) for the old check to look at.
    world = World()
    world.reconcile(0)
    _place_head(world, "cpu-0")
    world.reconcile(1)
    assert f"RayCluster/{NAME}" not in world.kube.deleted  # nothing cordoned yet
    world.kube.cordoned = {"cpu-0"}
    world.reconcile(10)
    _moved_off(world, "cpu-0")


@pytest.mark.attack(
    "a job whose head never answers its dashboard holds a node drain for ever through its "
    "PodDisruptionBudget",
    "the operator looks for cordoned nodes under the head and trainer pods in every state of the "
    "job and moves it off (rlhf_operator.observer.Observer._drained_nodes)",
)
def test_a_cordoned_node_is_seen_while_the_dashboard_is_silent_and_nothing_submitted() -> None:
    # Between the asks of a silent dashboard the pods are not read; with a node cordoned they
    # are, else a head whose dashboard never answers would hold the drain for ever.
    world = World()
    world.reconcile(0)
    world.kube.make_cluster_ready()
    world.ray.failing["status"] = DashboardUnavailableError("GET /api/jobs/x: refused")
    world.reconcile(1)  # asked: silent
    _place_head(world, "cpu-0")
    world.kube.cordoned = {"cpu-0"}
    world.reconcile(10)  # between asks (the next is due at 16 s)
    _moved_off(world, "cpu-0")


def test_a_driver_ray_reports_done_is_not_moved_off_a_cordoned_node() -> None:
    """It ends instead (here it succeeded), and its cluster goes with the end."""
    world = World()
    world.running()
    _place_head(world, "cpu-0")
    world.ray.jobs[FIRST_ATTEMPT] = RayJobView(FIRST_ATTEMPT, "SUCCEEDED")
    world.kube.cordoned = {"cpu-0"}
    world.reconcile(10)
    assert world.status["phase"] == "Succeeded" and "NodeDrained" not in world.reasons()


# -- Kueue ------------------------------------------------------------------------------------


def queued_world(**labels: str) -> World:
    world = World(policy=JobPolicy(kueue=True))
    world.kube.jobs[NAME]["metadata"]["labels"] = {kueue.LABEL_QUEUE_NAME: "team-a", **labels}
    return world


def kueue_conditions(*types: str, reason: str = "") -> list[dict[str, Any]]:
    return [
        {"type": t, "status": "True", "reason": reason or t, "message": f"{t} by Kueue",
         "lastTransitionTime": T0.isoformat()}
        for t in types
    ]  # fmt: skip


def admit(world: World, flavor: str = "gpu-a") -> str:
    """Kueue: quota reserved and admitted, every pod set on `flavor`."""
    name, workload = next(iter(world.kube.workloads.items()))
    assignments = [
        {"name": p["name"], "flavors": {"cpu": flavor}, "count": p["count"]}
        for p in workload["spec"]["podSets"]
    ]
    workload["status"] = {
        "conditions": kueue_conditions(kueue.QUOTA_RESERVED, kueue.ADMITTED),
        "admission": {"clusterQueue": "gpus", "podSetAssignments": assignments},
    }
    return name


def test_a_queued_job_waits_for_kueue_then_runs_where_the_flavor_says() -> None:
    world = queued_world(**{kueue.LABEL_PRIORITY_CLASS: "high"})
    world.kube.cluster_objects[(kueue.WORKLOAD_PRIORITY_CLASSES, "high")] = {"value": 1000}
    world.kube.cluster_objects[(kueue.RESOURCE_FLAVORS, "gpu-a")] = {
        "spec": {"nodeLabels": {"zone": "a"}, "tolerations": [{"key": "a", "operator": "Exists"}]}
    }
    world.reconcile(0)
    assert [m["kind"] for m in world.kube.applied] == []  # no pod's object before admission
    (workload,) = world.kube.workloads.values()
    assert workload["spec"]["priority"] == 1000 and workload["spec"]["queueName"] == "team-a"
    assert world.status["phase"] == "Pending"
    world.reconcile(1)
    assert NAME not in world.kube.clusters
    admit(world)
    world.reconcile(2)
    cluster = world.kube.clusters[NAME]
    for group in [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        assert pod["nodeSelector"]["zone"] == "a"
        assert {"key": "a", "operator": "Exists"} in pod["tolerations"]
    assert world.condition("Admitted")["status"] == "True"
    assert "Admitted" in world.reasons()


def test_a_missing_priority_class_keeps_the_job_out_of_the_queue_and_says_so() -> None:
    world = queued_world(**{kueue.LABEL_PRIORITY_CLASS: "missing"})
    world.reconcile(0)
    assert world.kube.workloads == {}
    assert (
        "WorkloadPriorityClass 'missing' does not exist" in world.condition("Admitted")["message"]
    )
    assert world.status["phase"] == "Pending"


def test_a_preempted_job_gives_its_quota_back_only_after_its_pods_are_gone() -> None:
    world = queued_world()
    world.reconcile(0)
    name = admit(world)
    world.running()
    workload = world.kube.workloads[name]
    workload["status"]["conditions"] += kueue_conditions(kueue.EVICTED, reason="Preempted")
    world.reconcile(10)  # no heartbeat: nobody to drain, the cluster goes at once
    assert NAME not in world.kube.clusters and FIRST_ATTEMPT in world.ray.stopped
    world.kube.pods[NAME] = world.kube.pods[NAME][:1]  # one pod still terminating
    world.reconcile(11)
    assert world.kube.workloads[name]["status"].get("admission") is not None  # still reserved
    world.kube.pods[NAME] = []
    world.reconcile(12)
    status = world.kube.workloads[name]["status"]
    assert status.get("admission") is None
    requeued = next(c for c in status["conditions"] if c["type"] == kueue.REQUEUED)
    assert requeued["status"] == "True"
    assert world.status["phase"] == "Pending" and world.status.get("restartCount", 0) == 0
    assert "QuotaReleased" in world.reasons()


def test_a_finished_queued_job_marks_its_workload_finished() -> None:
    world = queued_world()
    world.reconcile(0)
    name = admit(world)
    world.running()
    world.ray.jobs[FIRST_ATTEMPT] = RayJobView(FIRST_ATTEMPT, "SUCCEEDED")
    world.reconcile(5)
    world.kube.pods[NAME] = []
    world.reconcile(6)
    finished = [c for c in world.kube.workloads[name]["status"]["conditions"]
                if c["type"] == kueue.FINISHED]  # fmt: skip
    assert finished and finished[0]["reason"] == "Succeeded"


def test_a_cordoned_head_node_drains_the_job_too() -> None:
    # The head runs the driver and Ray's GCS: evicting it loses the run like a trainer would.
    world = World()
    world.running()
    world.kube.beat(T0 + timedelta(seconds=2), LeaseReport(step=6, attempt=0))
    for pod in world.kube.pods[NAME]:
        if pod.metadata.labels[ray.LABEL_NODE_TYPE] == ray.NODE_HEAD:
            pod.metadata.labels[names.LABEL_ROLE] = "head"
            pod.spec = V1PodSpec(containers=[], node_name="cpu-0")
    world.kube.cordoned = {"cpu-0"}
    world.reconcile(10)
    assert world.condition("Draining")["reason"] == "NodeDrained"
    budget = next(m for m in world.kube.applied if m["kind"] == "PodDisruptionBudget")
    (roles,) = budget["spec"]["selector"]["matchExpressions"]
    assert roles == {"key": names.LABEL_ROLE, "operator": "In", "values": ["head", "trainer"]}
