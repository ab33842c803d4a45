"""Kueue's names the operator reads and writes (Kueue v0.17, API `kueue.x-k8s.io/v1beta2`).

A job opts into queueing with Kueue's own label, `kueue.x-k8s.io/queue-name`, as every Kueue
integration does; the operator then owns one Workload per job (docs/design.md, "Kueue admits the
job, not its cluster"). The e2e tier's admin helpers import these too.
"""

from __future__ import annotations

from rlhfjob.api import KUEUE_GROUP

KUEUE_VERSION = "v1beta2"
KUEUE_API_VERSION = f"{KUEUE_GROUP}/{KUEUE_VERSION}"
WORKLOADS = "workloads"
WORKLOAD_KIND = "Workload"
RESOURCE_FLAVORS = "resourceflavors"
WORKLOAD_PRIORITY_CLASSES = "workloadpriorityclasses"
WORKLOAD_PRIORITY_CLASS_KIND = "WorkloadPriorityClass"

LABEL_QUEUE_NAME = f"{KUEUE_GROUP}/queue-name"
"""On an RLHFJob: the LocalQueue (in the job's namespace) that admits it."""
LABEL_PRIORITY_CLASS = f"{KUEUE_GROUP}/priority-class"
"""On an RLHFJob: the WorkloadPriorityClass of its Workload (what preemption compares)."""
LABEL_JOB_UID = f"{KUEUE_GROUP}/job-uid"
"""On a Workload: the uid of the job that owns it (Kueue's convention)."""
LABEL_PODSET = f"{KUEUE_GROUP}/podset"
"""On an admitted pod: the pod set of the Workload it counts against."""

ADMISSION_FIELD_MANAGER = "kueue-admission"
"""The field manager of the admission fields of a Workload's status (Kueue's own)."""

# Workload conditions (Kueue's types and the reasons the operator reads or writes).
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
PREEMPTED = "Preempted"
REQUEUED = "Requeued"
FINISHED = "Finished"
PODS_READY = "PodsReady"
REQUEUED_EVICTIONS = frozenset({"Preempted", "NodeFailures"})
"""Eviction reasons after which the job controller puts the Workload back in its queue (the
others, e.g. Deactivated for a suspended job, wait for their cause to go away)."""
