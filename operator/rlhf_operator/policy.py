"""What a job may ask of the operator's power: volume types and the Ray pods' identity.

The operator can create pods in every namespace it serves, so a job must not borrow power
through it: a `hostPath` volume (the node's disk), a Secret of its namespace read through a
volume or the environment where Secret volumes are not allowed, or a ServiceAccount it was not
given (the operator's own, or any other in its namespace). The platform engineer sets the policy
in the chart's values. The policy is enforced twice, from this one module: the operator checks
a job at its first reconcile, before any cluster exists (clusters without the admission
policy), and the chart's ValidatingAdmissionPolicy refuses it at apply. Each rule is written
in both forms side by side, the Python check and its CEL (`Check`), in a module of its topic:
Secrets (`policy_secrets`), where pods run (`policy_placement`), volumes (`policy_volumes`),
images and extended resources (`policy_supply`); the job's identity and its queue are here.
`JobPolicy.problems` and `checks` gather them, and `rlhf_operator.admission` generates the
chart's template from the CEL; `tests/operator/test_admission.py` evaluates the rendered policy
against `problems` on the same jobs, so the two cannot drift apart.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from rlhf_operator import policy_egress as egress
from rlhf_operator import policy_placement as placement
from rlhf_operator import policy_secrets as secrets
from rlhf_operator import policy_supply as supply
from rlhf_operator import policy_volumes as volumes
from rlhf_operator.network import NetworkSettings
from rlhf_operator.policy_base import (
    ROOTS,
    Check,
    Variable,
    field_or,
    pair,
    pod_places,
    present,
    same_side,
    unchanged,
)
from rlhf_operator.queueing import queue_name
from rlhfjob.api import RLHFJob
from rlhfjob.api.kubeschema import VOLUME_SOURCES
from rlhfjob.contract.kueue import LABEL_QUEUE_NAME

DEFAULT_VOLUME_TYPES = VOLUME_SOURCES
"""Volume sources a job's volumes may use unless the policy says otherwise: those whose
Kubernetes schema the API carries (`rlhfjob.api.kubeschema`)."""
ACCOUNT = "spec.serviceAccountName"
QUEUE_LABEL = f"metadata.labels[{LABEL_QUEUE_NAME}]"
UNQUEUED = (
    "the job names no LocalQueue, and this installation admits every job through Kueue (or it "
    "would run outside its team's quota): add the label (the chart's kueue.requireQueueName)"
)


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
    require_queue_name: bool = True
    """With `kueue`: a job must name its LocalQueue (Kueue's label), or it would run outside
    every quota at any priority (`--kueue-optional` turns it off)."""
    allowed_image_registries: tuple[str, ...] = ()
    """Registries (or paths, or repositories) images may come from; empty: any
    (`policy_supply.image_allowed`)."""
    allowed_extended_resources: tuple[str, ...] = supply.DEFAULT_EXTENDED_RESOURCES
    """Extended resources the pods may request (a role's `gpus` are `nvidia.com/gpu`)."""
    tolerate_all_taints: bool = False
    """Whether a toleration may match every taint (`operator: Exists` without a key)."""
    allowed_system_priority_classes: tuple[str, ...] = ()
    """`system-` PriorityClasses a job may name (others are free: Kueue bounds the rest)."""
    allowed_scheduler_names: tuple[str, ...] = ()
    """Schedulers a job may name besides the default one (a gang scheduler's, say)."""
    allowed_nfs_servers: tuple[str, ...] = ()
    """Servers an inline `nfs` volume may mount from; empty: none."""
    allowed_csi_drivers: tuple[str, ...] = ()
    """Drivers an inline `csi` volume may use; empty: none."""
    network: NetworkSettings | None = None
    """The installation's approved egress: each destination a job names must be covered
    (`policy_egress`). None: not checked, as in the admission policy, which has no such rule;
    the `Reconciler` gives its policy the operator's network settings."""

    @property
    def secrets_allowed(self) -> bool:
        """Whether a job may read Secrets at all: as `secret` volumes, or any other way."""
        return "secret" in self.allowed_volume_types

    def problems(self, job: RLHFJob) -> list[str]:
        """Each way the job breaks the policy, naming the field; empty when it keeps it."""
        spec = job.spec
        found = self._namespace_problems(job)
        found += secrets.token_problems(spec)
        found += placement.node_problems(spec, tolerate_all_taints=self.tolerate_all_taints)
        found += placement.scheduling_problems(
            spec,
            system_priority_classes=self.allowed_system_priority_classes,
            scheduler_names=self.allowed_scheduler_names,
        )
        found += volumes.inline_problems(
            spec, nfs_servers=self.allowed_nfs_servers, csi_drivers=self.allowed_csi_drivers
        )
        found += self._queue_problems(job)
        found += supply.image_problems(spec, self.allowed_image_registries)
        found += supply.resource_problems(spec, self.allowed_extended_resources)
        if self.network is not None:
            found += egress.problems(job, self.network)
        found += volumes.checkpoint_problems(spec, self.allowed_volume_types)
        for path, pod in spec.pod_places().items():
            found += volumes.pod_problems(path, pod, self.allowed_volume_types)
            if not self.secrets_allowed:
                found += secrets.environment_problems(path, pod)
        if not self.secrets_allowed:
            found += secrets.bucket_problems(spec)
        return found + self._account_problems(job)

    def _namespace_problems(self, job: RLHFJob) -> list[str]:
        if self.operator_namespace and job.metadata.namespace == self.operator_namespace:
            return [
                f"metadata.namespace: {self.operator_namespace!r} is the operator's own namespace "
                "(its key and identity live there): create the job in a team's namespace"
            ]
        return []

    def _queue_problems(self, job: RLHFJob) -> list[str]:
        queue = queue_name(job)
        if not self.kueue and queue is not None:
            return [
                f"{QUEUE_LABEL}: {queue!r} asks Kueue to admit the job, "
                "but this operator runs without the Kueue integration (the chart's "
                "kueue.enabled); remove the label or enable it"
            ]
        if self.kueue and self.require_queue_name and queue is None:
            return [f"{QUEUE_LABEL}: {UNQUEUED}"]
        return []

    def _account_problems(self, job: RLHFJob) -> list[str]:
        account = job.spec.service_account_name
        if account is None:
            return []
        if self._is_operator(job, account):
            return [f"{ACCOUNT}: {account!r} is the operator's own ServiceAccount"]
        if account not in self.allowed_service_accounts:
            allowed = ", ".join(self.allowed_service_accounts) or "none"
            return [
                f"{ACCOUNT}: {account!r} is not allowed here (allowed: "
                f"{allowed}; leave it unset for the job's own ServiceAccount)"
            ]
        return []

    def _is_operator(self, job: RLHFJob, account: str) -> bool:
        return (
            account == self.operator_service_account
            and job.metadata.namespace == self.operator_namespace
        )


# ---------------------------------------------------------------------------------------------
# The same rules in CEL, for the admission policy (`rlhf_operator.admission` renders them)


def _identity_variables() -> list[Variable]:
    """The texts the messages quote, whether this is an UPDATE, and the job's ServiceAccount."""
    return [
        Variable(
            "allowedVolumesText",
            "size(variables.allowedVolumeTypes) == 0 ? 'none is allowed'"
            " : 'allowed: ' + variables.allowedVolumeTypes.join(', ')",
        ),
        Variable(
            "allowedAccountsText",
            "size(variables.allowedServiceAccounts) == 0 ? 'none is allowed: leave it unset'"
            " : 'allowed: ' + variables.allowedServiceAccounts.join(', ')",
        ),
        Variable("update", "request.operation == 'UPDATE' && oldObject != null"),
    ]


def _queue_name(root: str) -> str:
    """CEL: the job's LocalQueue (Kueue's label on it), or '' (`queueing.queue_name`'s None)."""
    labels = f"{root}.metadata.labels"
    return f"{present(root, 'metadata.labels')} && '{LABEL_QUEUE_NAME}' in {labels}" + (
        f" ? {labels}['{LABEL_QUEUE_NAME}'] : ''"
    )


def variables() -> list[Variable]:
    """The policy's variables after the installation's (`admission.INSTALLATION`), each after
    the variables it reads."""
    found = [
        *_identity_variables(),
        *volumes.checkpoint_variables(),
        *pair("serviceAccount", functools.partial(field_or, path=ACCOUNT, empty="''")),
        *(Variable(same_side(root, "queueName"), _queue_name(root)) for root in ROOTS),
    ]
    for index, place in enumerate(pod_places()):
        found += volumes.pod_variables(index, place)
        found += secrets.environment_variables(index, place)
    return [
        *found,
        *secrets.token_variables(),
        *placement.variables(),
        *secrets.bucket_variables(),
        *supply.variables(),
    ]


def _identity_checks() -> list[Check]:
    """The ServiceAccount is one the installation allows and not the operator's; the namespace
    is not the operator's."""
    account = f"{unchanged('serviceAccount')} || variables.serviceAccount == ''"
    return [
        Check(
            ACCOUNT,
            f"{account} || variables.serviceAccount in variables.allowedServiceAccounts",
            f"{ACCOUNT}: ServiceAccount not allowed by the job policy",
            f"'{ACCOUNT}: ServiceAccount ' + variables.serviceAccount"
            " + ' is not allowed (' + variables.allowedAccountsText + ')'",
        ),
        Check(
            ACCOUNT,
            f"{account} || !(request.namespace == variables.operatorNamespace"
            " && variables.serviceAccount == variables.operatorServiceAccount)",
            f"{ACCOUNT}: a job may not run as the operator's own ServiceAccount",
            f"'{ACCOUNT}: a job may not run as the operator\\'s own ServiceAccount ('"
            " + variables.operatorNamespace + '/' + variables.operatorServiceAccount + ')'",
        ),
        Check(
            "metadata.namespace",
            "variables.update || request.namespace != variables.operatorNamespace",
            "metadata.namespace: no job may run in the operator's own namespace",
            "'metadata.namespace: ' + request.namespace + ' is the operator\\'s own namespace"
            " (its key and identity live there): create the job in a team\\'s namespace'",
        ),
    ]


def _queue_checks() -> list[Check]:
    """A queue label only where Kueue admits jobs; where it must, every job has one."""
    kept = unchanged("queueName")
    return [
        Check(
            QUEUE_LABEL,
            f"{kept} || variables.kueue || variables.queueName == ''",
            f"{QUEUE_LABEL}: this installation runs without the Kueue integration",
            f"'{QUEUE_LABEL}: ' + variables.queueName + ' asks Kueue to admit the job, but this"
            " operator runs without the Kueue integration (the chart\\'s kueue.enabled); remove"
            " the label or enable it'",
        ),
        Check(
            QUEUE_LABEL,
            f"{kept} || !variables.queueRequired || variables.queueName != ''",
            f"{QUEUE_LABEL}: {UNQUEUED}",
            "'" + f"{QUEUE_LABEL}: {UNQUEUED}".replace("'", "\\'") + "'",
        ),
    ]


def checks() -> list[Check]:
    """The policy's validations, one per rule and place (`JobPolicy.problems` in CEL)."""
    found = [
        volumes.checkpoint_check(),
        *_identity_checks(),
        *secrets.token_checks(),
        *placement.checks(),
        *volumes.inline_checks(),
        *_queue_checks(),
    ]
    for index, place in enumerate(pod_places()):
        found += [volumes.pod_check(index, place), secrets.environment_check(index, place)]
    return [*found, *secrets.bucket_checks(), *supply.image_checks(), *supply.resource_checks()]
