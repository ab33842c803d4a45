"""Kueue on the local cluster, from a test's side: admin objects, Workload reads, and the job
controller's half of an eviction.

Everything speaks `kueue.x-k8s.io/v1beta2` (Kueue v0.17's storage version). A `KueueAdmin` is
one test's set of cluster-scoped objects (ResourceFlavors, a ClusterQueue, WorkloadPriorityClasses)
and namespaced LocalQueues, every name suffixed so that tests never share one; `close` (or
leaving its ``with``) deletes them in dependency order and waits until they are gone::

    with KueueAdmin(local_cluster) as admin:
        gpu = admin.flavor("gpu-train")                      # the fake pool's labels and taint
        cq = admin.cluster_queue("rlhf", [FlavorQuota(gpu, cpu="192", memory="2048Gi", gpus=8)],
                                 namespaces=[namespace])
        lq = admin.local_queue(namespace, "rlhf", cq)
        low = admin.priority_class("low", 100)

`release_quota` is what a job controller does once the job of an evicted Workload has stopped
(Kueue's jobframework, "handle eviction"): clear the quota reservation, as Kueue itself would.
"""

from __future__ import annotations

import copy
import datetime
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rlhf_local import pools
from rlhf_local.harness import LocalCluster, wait_for
from rlhfjob.contract import kueue as contract

# Kueue's names, from the one place the operator takes them too.
GROUP = contract.KUEUE_GROUP
VERSION = contract.KUEUE_VERSION
API_VERSION = contract.KUEUE_API_VERSION
#: The deprecated version Kueue v0.17 still serves, converted by its /convert webhook.
OLD_VERSION = "v1beta1"

WORKLOADS = contract.WORKLOADS
CLUSTER_QUEUES = "clusterqueues"
LOCAL_QUEUES = "localqueues"
RESOURCE_FLAVORS = contract.RESOURCE_FLAVORS
WORKLOAD_PRIORITY_CLASSES = contract.WORKLOAD_PRIORITY_CLASSES

LABEL_QUEUE_NAME = contract.LABEL_QUEUE_NAME
LABEL_PRIORITY_CLASS = contract.LABEL_PRIORITY_CLASS

#: Kueue's field manager of a Workload's admission status fields (`constants.AdmissionName`).
ADMISSION_FIELD_MANAGER = contract.ADMISSION_FIELD_MANAGER
#: Who creates this module's admin objects (what `kubectl get --show-managed-fields` shows).
FIELD_MANAGER = "rlhf-e2e-kueue-admin"

# Workload condition types.
QUOTA_RESERVED = contract.QUOTA_RESERVED
ADMITTED = contract.ADMITTED
EVICTED = contract.EVICTED
PREEMPTED = contract.PREEMPTED
REQUEUED = contract.REQUEUED
FINISHED = contract.FINISHED
#: The conditions the `kueue-admission` manager owns (`admissionManagedConditions`, in Kueue's
#: order); an apply by that manager must carry every one of them the Workload has.
ADMISSION_CONDITIONS = (
    QUOTA_RESERVED,
    "BlockedOnPreemptionGates",
    EVICTED,
    ADMITTED,
    PREEMPTED,
    REQUEUED,
    "DeactivationTarget",
    FINISHED,
)
#: Eviction reasons after which the Workload goes back to its queue (Requeued True).
REQUEUED_EVICTIONS = contract.REQUEUED_EVICTIONS
#: Kueue truncates condition messages to this many bytes.
MAX_CONDITION_MESSAGE = 32 * 1024


@dataclass(frozen=True)
class FlavorQuota:
    """One ResourceFlavor's nominal quota in a ClusterQueue (the covered resources: CPU,
    memory and GPUs, so a workload's GPU requests always count)."""

    flavor: str
    cpu: str = "0"
    memory: str = "0"
    gpus: int = 0

    def resources(self) -> list[dict[str, Any]]:
        return [
            {"name": "cpu", "nominalQuota": self.cpu},
            {"name": "memory", "nominalQuota": self.memory},
            {"name": pools.GPU_RESOURCE, "nominalQuota": str(self.gpus)},
        ]


COVERED_RESOURCES = ("cpu", "memory", pools.GPU_RESOURCE)


def pool(name: str) -> pools.Pool:
    """The fake node pool `name` (see `rlhf_local.pools`)."""
    for candidate in pools.POOLS:
        if candidate.name == name:
            return candidate
    raise ValueError(f"no pool {name!r}; pools: {[p.name for p in pools.POOLS]}")


def resource_flavor(name: str, pool_name: str) -> dict[str, Any]:
    """A ResourceFlavor for one fake pool: its node label and, for a tainted (GPU) pool, its
    taint with the matching toleration, which Kueue adds to the pods it admits there."""
    spec: dict[str, Any] = {"nodeLabels": {pools.POOL_LABEL: pool(pool_name).name}}
    if pool(pool_name).gpus:
        taint = dict(pools.GPU_TAINT)
        spec["nodeTaints"] = [taint]
        spec["tolerations"] = [{**taint, "operator": "Equal"}]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceFlavor",
        "metadata": {"name": name},
        "spec": spec,
    }


def cluster_queue(
    name: str, quotas: Sequence[FlavorQuota], namespaces: Iterable[str] | None = None
) -> dict[str, Any]:
    """A ClusterQueue with one resource group (flavors tried in `quotas`' order) that preempts
    lower-priority Workloads of its own queue; admits only from `namespaces` when given."""
    selector: dict[str, Any] = {}
    if namespaces is not None:
        selector = {
            "matchExpressions": [
                {
                    "key": "kubernetes.io/metadata.name",
                    "operator": "In",
                    "values": sorted(namespaces),
                }
            ]
        }
    return {
        "apiVersion": API_VERSION,
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": selector,
            "resourceGroups": [
                {
                    "coveredResources": list(COVERED_RESOURCES),
                    "flavors": [{"name": q.flavor, "resources": q.resources()} for q in quotas],
                }
            ],
            "preemption": {"withinClusterQueue": "LowerPriority"},
        },
    }


def local_queue(name: str, namespace: str, cluster_queue_name: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "LocalQueue",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterQueue": cluster_queue_name},
    }


def workload_priority_class(name: str, value: int) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": name},
        "value": value,
    }


@dataclass(frozen=True)
class PodSet:
    """One pod set of a hand-written Workload: `count` pods of one container's requests."""

    name: str
    count: int = 1
    requests: Mapping[str, str] = field(default_factory=dict)

    def manifest(self) -> dict[str, Any]:
        container = {"name": "main", "resources": {"requests": dict(self.requests)}}
        return {
            "name": self.name,
            "count": self.count,
            "template": {"spec": {"containers": [container], "restartPolicy": "Never"}},
        }


def workload(
    name: str,
    namespace: str,
    queue: str,
    pod_sets: Sequence[PodSet],
    *,
    priority_class: str | None = None,
    priority: int | None = None,
) -> dict[str, Any]:
    """A Workload with no job behind it (Kueue admits it all the same; nothing runs)."""
    spec: dict[str, Any] = {"queueName": queue, "podSets": [p.manifest() for p in pod_sets]}
    if priority_class is not None:
        if priority is None:
            raise ValueError("a Workload with a priority class needs its value as priority")
        spec["priorityClassRef"] = {
            "group": GROUP,
            "kind": "WorkloadPriorityClass",
            "name": priority_class,
        }
        spec["priority"] = priority
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


# --- reading Workloads -------------------------------------------------------------------


def conditions(wl: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A Workload's status conditions by type."""
    return {c["type"]: c for c in wl.get("status", {}).get("conditions") or []}


def condition(wl: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    return conditions(wl).get(kind)


def is_true(wl: Mapping[str, Any], kind: str) -> bool:
    found = condition(wl, kind)
    return found is not None and found["status"] == "True"


def message(wl: Mapping[str, Any], kind: str) -> str:
    """The message of condition `kind` ("" when the Workload has none)."""
    return str((condition(wl, kind) or {}).get("message", ""))


def is_admitted(wl: Mapping[str, Any]) -> bool:
    """Admitted and not evicted: when a job controller may start the job (`IsAdmitted`)."""
    return is_true(wl, ADMITTED) and not is_true(wl, EVICTED)


def has_quota_reservation(wl: Mapping[str, Any]) -> bool:
    return is_true(wl, QUOTA_RESERVED)


def summary(wl: Mapping[str, Any]) -> str:
    """One line per condition (for failure messages)."""
    name = wl.get("metadata", {}).get("name", "?")
    lines = [
        f"  {c['type']}={c['status']} {c.get('reason', '')}: {c.get('message', '')}"
        for c in conditions(wl).values()
    ]
    return f"Workload {name}:\n" + ("\n".join(lines) or "  (no conditions)")


# --- the job controller's half of an eviction --------------------------------------------


def _time(now: datetime.datetime) -> str:
    """metav1.Time: RFC 3339 in UTC, whole seconds."""
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str) -> datetime.datetime:
    return datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)


def _truncate(message: str) -> str:
    data = message.encode()
    if len(data) <= MAX_CONDITION_MESSAGE:
        return message
    return data[: MAX_CONDITION_MESSAGE - 3].decode(errors="ignore") + "..."


def set_condition(conds: list[dict[str, Any]], new: dict[str, Any], now: datetime.datetime) -> bool:
    """apimachinery's `meta.SetStatusCondition`: the transition time moves only when the
    status changes (to the new condition's, else now); reason, message and observed
    generation are always taken. Returns whether anything changed."""
    for existing in conds:
        if existing["type"] != new["type"]:
            continue
        changed = False
        if existing["status"] != new["status"]:
            existing["status"] = new["status"]
            existing["lastTransitionTime"] = new.get("lastTransitionTime") or _time(now)
            changed = True
        for key in ("reason", "message", "observedGeneration"):
            if new.get(key) is not None and existing.get(key) != new[key]:
                existing[key] = new[key]
                changed = True
        return changed
    added = {k: v for k, v in new.items() if v is not None}
    conds.append({**added, "lastTransitionTime": new.get("lastTransitionTime") or _time(now)})
    return True


def quota_release_patch(wl: Mapping[str, Any], now: datetime.datetime) -> dict[str, Any]:
    """The `workloads/status` apply that releases an evicted Workload's quota.

    Mirrors Kueue v0.17's job reconciler once the evicted job is no longer active:
    `SetRequeuedCondition` (True only after a Preempted or NodeFailures eviction; reason and
    message the eviction's) and `UnsetQuotaReservationWithCondition` (QuotaReserved False,
    reason Pending; admission removed; `SyncAdmittedCondition`: Admitted False, NoReservation,
    its admitted seconds added to accumulatedPastExecutionTimeSeconds), written as
    `PrepareWorkloadPatch` does: identity and resourceVersion (a conflict if the Workload
    changed since it was read) plus every field the `kueue-admission` manager owns, except
    `admission`, which is thereby deleted. Only status counts on the status subresource, so
    the labels and annotations Kueue's patch also carries are left out.
    """
    evicted = condition(wl, EVICTED)
    if evicted is None or evicted["status"] != "True":
        raise ValueError(f"Workload {wl['metadata']['name']} is not evicted")
    meta, status = wl["metadata"], wl.get("status", {})
    generation = meta.get("generation")
    conds = copy.deepcopy(status.get("conditions") or [])
    accumulated = status.get("accumulatedPastExecutionTimeSeconds")

    set_condition(
        conds,
        {
            "type": REQUEUED,
            "status": "True" if evicted["reason"] in REQUEUED_EVICTIONS else "False",
            "reason": evicted["reason"],
            "message": _truncate(evicted.get("message", "")),
            "observedGeneration": generation,
        },
        now,
    )
    set_condition(
        conds,
        {
            "type": QUOTA_RESERVED,
            "status": "False",
            "reason": "Pending",
            "message": _truncate(evicted.get("message", "")),
            "observedGeneration": generation,
            "lastTransitionTime": _time(now),
        },
        now,
    )
    admitted = next((c for c in conds if c["type"] == ADMITTED), None)
    if admitted is not None and admitted["status"] == "True":  # SyncAdmittedCondition
        ran = int((now - parse_time(admitted["lastTransitionTime"])).total_seconds())
        accumulated = (accumulated or 0) + ran
        checks_ready = all(c.get("state") == "Ready" for c in status.get("admissionChecks") or [])
        reason, message = (
            ("NoReservation", "The workload has no reservation")
            if checks_ready
            else (
                "NoReservationUnsatisfiedChecks",
                "The workload has no reservation and not all checks ready",
            )
        )
        set_condition(
            conds,
            {
                "type": ADMITTED,
                "status": "False",
                "reason": reason,
                "message": message,
                "observedGeneration": generation,
                "lastTransitionTime": _time(now),
            },
            now,
        )

    out: dict[str, Any] = {
        "conditions": [c for kind in ADMISSION_CONDITIONS for c in conds if c["type"] == kind]
    }
    requeue = status.get("requeueState") or {}
    if requeue.get("count") is not None or requeue.get("requeueAt") is not None:
        out["requeueState"] = copy.deepcopy(requeue)
    if status.get("resourceRequests"):
        out["resourceRequests"] = copy.deepcopy(status["resourceRequests"])
    if accumulated is not None:
        out["accumulatedPastExecutionTimeSeconds"] = accumulated
    if status.get("schedulingStats") is not None:
        evictions = status["schedulingStats"].get("evictions") or []
        out["schedulingStats"] = {"evictions": copy.deepcopy(evictions)}
    for key in ("clusterName", "nominatedClusterNames", "unhealthyNodes", "preemptionGates"):
        if status.get(key):
            out[key] = copy.deepcopy(status[key])
    if status.get("admissionChecks") is not None:
        out["admissionChecks"] = copy.deepcopy(status["admissionChecks"])
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
            "resourceVersion": meta["resourceVersion"],
        },
        "status": out,
    }


def release_quota(
    custom: client.CustomObjectsApi, namespace: str, name: str, attempts: int = 5
) -> dict[str, Any]:
    """Release an evicted Workload's quota as a job controller does once its job stopped:
    apply `quota_release_patch` to `workloads/status` as `kueue-admission`, forced; on a
    conflict (the Workload changed since it was read) read it again and retry. Returns the
    Workload as the API server stored it; a Workload with no reservation is left alone."""
    for attempt in range(attempts):
        wl = get_workload(custom, namespace, name)
        if not has_quota_reservation(wl):
            return wl
        body = quota_release_patch(wl, datetime.datetime.now(datetime.UTC))
        try:
            stored: Any = custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, WORKLOADS, name, body,
                field_manager=ADMISSION_FIELD_MANAGER, force=True,
                _content_type="application/apply-patch+yaml",
            )  # fmt: skip
            return stored
        except ApiException as error:
            if error.status != 409 or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def get_workload(
    custom: client.CustomObjectsApi, namespace: str, name: str, version: str = VERSION
) -> dict[str, Any]:
    found: Any = custom.get_namespaced_custom_object(GROUP, version, namespace, WORKLOADS, name)
    return found


def wait_workload(
    custom: client.CustomObjectsApi,
    namespace: str,
    name: str,
    check: Callable[[dict[str, Any]], bool],
    what: str,
    timeout: float = 30,
) -> dict[str, Any]:
    """Poll the Workload until `check` holds and return it; on timeout fail with its
    conditions."""

    def holds() -> dict[str, Any] | None:
        wl = get_workload(custom, namespace, name)
        return wl if check(wl) else None

    return wait_for(
        holds,
        timeout,
        f"Workload {namespace}/{name}: {what}",
        details=lambda: summary(get_workload(custom, namespace, name)),
    )


# --- one test's admin objects ------------------------------------------------------------


class KueueAdmin:
    """One test's Kueue objects, each name suffixed with `suffix` (random by default), made
    with the cluster's admin kubeconfig and deleted by `close`."""

    def __init__(self, lc: LocalCluster, suffix: str | None = None) -> None:
        self.lc = lc
        self.custom = lc.custom
        self.suffix = suffix or uuid.uuid4().hex[:5]
        self._made: list[tuple[str, str | None, str]] = []  # (plural, namespace, name)

    def name(self, base: str) -> str:
        return f"{base}-{self.suffix}"

    def _create(self, manifest: dict[str, Any], plural: str) -> str:
        meta = manifest["metadata"]
        namespace = meta.get("namespace")
        if namespace is None:
            self.custom.create_cluster_custom_object(
                GROUP, VERSION, plural, manifest, field_manager=FIELD_MANAGER
            )
        else:
            self.custom.create_namespaced_custom_object(
                GROUP, VERSION, namespace, plural, manifest, field_manager=FIELD_MANAGER
            )
        self._made.append((plural, namespace, meta["name"]))
        return str(meta["name"])

    def flavor(self, pool_name: str, base: str | None = None) -> str:
        """A ResourceFlavor for the fake pool `pool_name`; returns its name."""
        return self._create(
            resource_flavor(self.name(base or pool_name), pool_name), RESOURCE_FLAVORS
        )

    def flavors(self, *pool_names: str) -> dict[str, str]:
        """A ResourceFlavor for each named fake pool (every pool when none is named): pool
        name -> flavor name."""
        names = pool_names or tuple(p.name for p in pools.POOLS)
        return {name: self.flavor(name) for name in names}

    def cluster_queue(
        self, base: str, quotas: Sequence[FlavorQuota], namespaces: Iterable[str] | None = None
    ) -> str:
        return self._create(cluster_queue(self.name(base), quotas, namespaces), CLUSTER_QUEUES)

    def local_queue(self, namespace: str, base: str, cluster_queue_name: str) -> str:
        """A LocalQueue in `namespace` (suffixed too: its name is what jobs' labels carry)."""
        return self._create(
            local_queue(self.name(base), namespace, cluster_queue_name), LOCAL_QUEUES
        )

    def priority_class(self, base: str, value: int) -> str:
        return self._create(
            workload_priority_class(self.name(base), value), WORKLOAD_PRIORITY_CLASSES
        )

    def workload(self, manifest: dict[str, Any]) -> str:
        """Create a hand-written Workload (`workload(...)`); deleted by `close` too."""
        return self._create(manifest, WORKLOADS)

    def get(self, plural: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        found: Any = (
            self.custom.get_cluster_custom_object(GROUP, VERSION, plural, name)
            if namespace is None
            else self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
        )
        return found

    def wait_cluster_queue_active(self, name: str, timeout: float = 30) -> dict[str, Any]:
        """Wait until Kueue reports the ClusterQueue Active (its flavors exist)."""

        def active() -> dict[str, Any] | None:
            cq = self.get(CLUSTER_QUEUES, name)
            return cq if is_true(cq, "Active") else None

        return wait_for(active, timeout, f"ClusterQueue {name} to be Active")

    def _delete(self, plural: str, namespace: str | None, name: str) -> None:
        try:
            if namespace is None:
                self.custom.delete_cluster_custom_object(GROUP, VERSION, plural, name)
            else:
                self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
        except ApiException as error:
            if error.status != 404:
                raise

    def _gone(self, plural: str, namespace: str | None, name: str) -> bool:
        try:
            self.get(plural, name, namespace)
        except ApiException as error:
            if error.status == 404:
                return True
            raise
        return False

    def close(self, timeout: float = 60) -> None:
        """Delete what this admin made, newest first, and wait until all of it is gone
        (Kueue holds a ClusterQueue or flavor in use by its finalizer until its users go)."""
        made, self._made = list(reversed(self._made)), []
        for plural, namespace, name in made:
            self._delete(plural, namespace, name)
        wait_for(
            lambda: all(self._gone(*m) for m in made),
            timeout,
            f"Kueue objects of {self.suffix} to be deleted",
            details=lambda: str([m for m in made if not self._gone(*m)]),
        )

    def __enter__(self) -> KueueAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
