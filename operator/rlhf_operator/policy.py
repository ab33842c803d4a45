"""What a job may ask of the operator's power: volume types and the Ray pods' identity.

The operator can create pods in every namespace it serves, so a job must not borrow power
through it: a `hostPath` volume (the node's disk), a Secret of its namespace read through a
volume or the environment where Secret volumes are not allowed, or a ServiceAccount it was not
given (the operator's own, or any other in its namespace). The platform engineer sets the policy
in the chart's values; the chart also renders it as a ValidatingAdmissionPolicy, so a job is
refused at apply. This module is the same policy in the operator, checked at the first
reconcile (clusters without the admission policy), before any cluster exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_operator.queueing import queue_name
from rlhfjob.api import PodOverrides, RLHFJob
from rlhfjob.contract.kueue import LABEL_QUEUE_NAME

DEFAULT_VOLUME_TYPES = (
    "persistentVolumeClaim",
    "csi",
    "nfs",
    "emptyDir",
    "configMap",
    "secret",
)
"""Volume sources a job's volumes may use unless the policy says otherwise."""


def _secret_references(path: str, pod: PodOverrides) -> list[str]:
    """Where `pod` reads a Secret into the environment: as much power as a `secret` volume."""
    refs = [
        f"{path}.env[{index}].valueFrom.secretKeyRef"
        for index, var in enumerate(pod.env)
        if var.value_from is not None and var.value_from.secret_key_ref is not None
    ]
    refs += [
        f"{path}.envFrom[{index}].secretRef"
        for index, source in enumerate(pod.env_from)
        if source.secret_ref is not None
    ]
    return [
        f"{ref}: Secrets may not be read here (the job policy does not allow secret volumes)"
        for ref in refs
    ]


@dataclass(frozen=True)
class JobPolicy:
    """The installation's rules for what an RLHFJob may ask for."""

    allowed_volume_types: tuple[str, ...] = DEFAULT_VOLUME_TYPES
    allowed_service_accounts: tuple[str, ...] = ()
    """ServiceAccounts a job may name; empty: only the per-job one the operator creates."""
    operator_namespace: str | None = None
    operator_service_account: str | None = None
    kueue: bool = False
    """Whether jobs may ask Kueue for admission (the operator runs with `--kueue`): a job with
    a queue label where nothing would queue it must not run unqueued, past its team's quota."""

    def problems(self, job: RLHFJob) -> list[str]:
        """Each way the job breaks the policy, naming the field; empty when it keeps it."""
        found: list[str] = []
        if not self.kueue and (queue := queue_name(job)) is not None:
            found.append(
                f"metadata.labels[{LABEL_QUEUE_NAME}]: {queue!r} asks Kueue to admit the job, "
                "but this operator runs without the Kueue integration (the chart's "
                "kueue.enabled); remove the label or enable it"
            )
        volume = job.spec.checkpoint.volume
        if volume is not None:
            found += self._volume_problems("spec.checkpoint.volume", sorted(volume))
        for path, pod in job.spec.pod_places().items():
            for index, extra in enumerate(pod.volumes):
                found += self._volume_problems(f"{path}.volumes[{index}]", extra.source_types())
            if "secret" not in self.allowed_volume_types:
                found += _secret_references(path, pod)
        bucket = job.spec.checkpoint.object_store
        if bucket and bucket.credentials_secret and "secret" not in self.allowed_volume_types:
            found.append(
                "spec.checkpoint.objectStore.credentialsSecret: Secrets may not be read here "
                "(the job policy does not allow secret volumes)"
            )
        account = job.spec.service_account_name
        if account is not None:
            if self._is_operator(job, account):
                found.append(
                    f"spec.serviceAccountName: {account!r} is the operator's own ServiceAccount"
                )
            elif account not in self.allowed_service_accounts:
                allowed = ", ".join(self.allowed_service_accounts) or "none"
                found.append(
                    f"spec.serviceAccountName: {account!r} is not allowed here (allowed: "
                    f"{allowed}; leave it unset for the job's own ServiceAccount)"
                )
        return found

    def _volume_problems(self, field: str, types: list[str]) -> list[str]:
        refused = [kind for kind in types if kind not in self.allowed_volume_types]
        if not refused:
            return []
        return [
            f"{field}: volume type {', '.join(refused)} is not allowed here "
            f"(allowed: {', '.join(self.allowed_volume_types)})"
        ]

    def _is_operator(self, job: RLHFJob, account: str) -> bool:
        return (
            account == self.operator_service_account
            and job.metadata.namespace == self.operator_namespace
        )
