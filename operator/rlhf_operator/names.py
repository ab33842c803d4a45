"""Every name and label the operator gives the objects of a job, in one place.

Kubernetes names are derived from the job's name (cut to fit, with a stable hash), so a retried
reconcile or a restarted operator finds the objects it made; the Ray job's submission id is
derived from the job and the attempt, so neither ever submits twice.
"""

from __future__ import annotations

import hashlib

from rlhfjob import api
from rlhfjob.api import RLHFJob

MAX_RAY_CLUSTER_NAME = 53  # KubeRay derives Service and pod names from it; 63 - suffixes
MANAGED_BY = "rlhfjob-operator"
FIELD_MANAGER = MANAGED_BY
"""Server-side apply's field manager."""
DASHBOARD_PORT = 8265

LABEL_JOB = f"{api.GROUP}/job"
LABEL_ROLE = f"{api.GROUP}/role"
STANDARD_LABELS = {"app.kubernetes.io/name": "rlhfjob", "app.kubernetes.io/managed-by": MANAGED_BY}
OPERATOR_POD_LABELS = {
    "app.kubernetes.io/name": "rlhfjob",
    "app.kubernetes.io/component": "operator",
}
"""The labels of the operator's pod (the chart sets them); a job's head admits those pods."""


def short_name(base: str, limit: int) -> str:
    """`base` if it fits, else a truncated prefix plus a stable hash (names must stay unique)."""
    if len(base) <= limit:
        return base
    digest = hashlib.sha256(base.encode()).hexdigest()[:8]
    return f"{base[: limit - 9].rstrip('-')}-{digest}"


def ray_cluster_name(job: RLHFJob) -> str:
    return short_name(job.metadata.name, MAX_RAY_CLUSTER_NAME)


def config_map_name(job: RLHFJob) -> str:
    return short_name(f"{job.metadata.name}-config", 63)


def trainer_service_account(job: RLHFJob) -> str:
    """The ServiceAccount the Ray pods run as (it may renew this job's Lease, nothing else)."""
    return job.spec.service_account_name or short_name(f"{job.metadata.name}-trainer", 63)


def heartbeat_role_name(job: RLHFJob) -> str:
    """The Role and RoleBinding that let the trainer renew its Lease."""
    return short_name(f"{job.metadata.name}-heartbeat", 63)


def ray_auth_secret_name(job: RLHFJob, token: str | None) -> str:
    """The Secret holding the job's Ray token (KubeRay puts it in every Ray container's env),
    named after the token's fingerprint: nobody without the token can make a Secret of that
    name ahead of the operator, so an existing one is the job's own and is never read; a new
    key (a rotation) gives a new name. None (`rlhfjob render`, no key): the name's stem."""
    if token is None:
        return f"{job.metadata.name}-ray-auth"
    fingerprint = hashlib.sha256(token.encode()).hexdigest()[:10]
    return f"{short_name(job.metadata.name, 43)}-ray-auth-{fingerprint}"  # the suffix never cut


RAY_AUTH_SECRETS = r"-ray-auth(-[0-9a-f]{10}|-key)?$"
"""What the name of a job's Ray token Secret (`ray_auth_secret_name`) and of the chart's key
Secret (`<release>-ray-auth-key`) end with: no job may reference one (`policy`)."""


def network_policy_name(job: RLHFJob) -> str:
    """The NetworkPolicy of the job's pods: who may reach them, where they may connect."""
    return short_name(f"{job.metadata.name}-ray-head", 63)


def head_api_policy_name(job: RLHFJob) -> str:
    """The NetworkPolicy that lets the job's head (alone) reach the API server."""
    return short_name(f"{job.metadata.name}-head-api", 63)


def disruption_budget_name(job: RLHFJob) -> str:
    """The PodDisruptionBudget that holds a node drain back until the trainer checkpointed."""
    return short_name(f"{job.metadata.name}-trainer", 63)


def heartbeat_lease_name(job: RLHFJob) -> str:
    """The trainer's heartbeat Lease is named after the job (design decision 4)."""
    return job.metadata.name


def workload_name(job: RLHFJob) -> str:
    """The job's Kueue Workload, named as Kueue names its integrations' Workloads
    (`<kind>-<name>-<hash of the owner>`), so two jobs of one name in time never share one."""
    owner = f"RLHFJob\n{api.GROUP}\n{job.metadata.name}\n{job.metadata.uid or ''}"
    digest = hashlib.sha1(owner.encode(), usedforsecurity=False).hexdigest()[:5]
    return f"{short_name(f'rlhfjob-{job.metadata.name}', 247)}-{digest}"


def job_labels(job: RLHFJob) -> dict[str, str]:
    return {**STANDARD_LABELS, LABEL_JOB: job.metadata.name}


def head_service_name(job: RLHFJob) -> str:
    """The head Service KubeRay makes for the job's RayCluster (`<cluster>-head-svc`)."""
    return f"{ray_cluster_name(job)}-head-svc"


def dashboard_url(job: RLHFJob) -> str:
    """The head Service's dashboard inside the cluster."""
    return f"http://{head_service_name(job)}.{job.metadata.namespace}.svc:{DASHBOARD_PORT}"


def submission_id(job: RLHFJob, attempt: int) -> str:
    """Stable per (job, attempt): a retried reconcile resubmits the same id, never a duplicate."""
    uid = (job.metadata.uid or "local")[:8]
    return f"{job.metadata.name}-{uid}-{attempt}"
