"""What a job may ask of the operator's power: volume types and the Ray pods' identity.

The operator can create pods in every namespace it serves, so a job must not borrow power
through it: a `hostPath` checkpoint volume (the node's disk), or a ServiceAccount it was not
given (the operator's own, or any other in its namespace). The platform engineer sets the policy
in the chart's values; the chart also renders it as a ValidatingAdmissionPolicy, so a job is
refused at apply. This module is the same policy in the operator, checked at the first
reconcile (clusters without the admission policy), before any cluster exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfjob.api import RLHFJob

DEFAULT_VOLUME_TYPES = (
    "persistentVolumeClaim",
    "csi",
    "nfs",
    "emptyDir",
    "configMap",
    "secret",
)
"""Volume sources a checkpoint volume may use unless the policy says otherwise."""


@dataclass(frozen=True)
class JobPolicy:
    """The installation's rules for what an RLHFJob may ask for."""

    allowed_volume_types: tuple[str, ...] = DEFAULT_VOLUME_TYPES
    allowed_service_accounts: tuple[str, ...] = ()
    """ServiceAccounts a job may name; empty: only the per-job one the operator creates."""
    operator_namespace: str | None = None
    operator_service_account: str | None = None

    def problems(self, job: RLHFJob) -> list[str]:
        """Each way the job breaks the policy, naming the field; empty when it keeps it."""
        found: list[str] = []
        volume = job.spec.checkpoint.volume
        if volume is not None:
            refused = sorted(key for key in volume if key not in self.allowed_volume_types)
            if refused:
                found.append(
                    f"spec.checkpoint.volume: volume type {', '.join(refused)} is not allowed "
                    f"here (allowed: {', '.join(self.allowed_volume_types)})"
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

    def _is_operator(self, job: RLHFJob, account: str) -> bool:
        return (
            account == self.operator_service_account
            and job.metadata.namespace == self.operator_namespace
        )
