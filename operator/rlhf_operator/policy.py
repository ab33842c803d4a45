"""What a job may ask of the operator's power: volume types and the Ray pods' identity.

The operator can create pods in every namespace it serves, so a job must not borrow power
through it: a `hostPath` volume (the node's disk), a Secret of its namespace read through a
volume or the environment where Secret volumes are not allowed, or a ServiceAccount it was not
given (the operator's own, or any other in its namespace). The platform engineer sets the policy
in the chart's values. The policy is enforced twice, from this one module: the operator checks
a job at its first reconcile, before any cluster exists (clusters without the admission
policy), and the chart's ValidatingAdmissionPolicy refuses it at apply. Each rule below is
written in both forms side by side, the Python check (`JobPolicy.problems`) and its CEL
(`Check`), and `rlhf_operator.admission` generates the chart's template from the CEL;
`tests/operator/test_admission.py` evaluates the rendered policy against `problems` on the
same jobs, so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_operator.queueing import queue_name
from rlhfjob.api import POD_PLACES, HeadSpec, PodOverrides, RLHFJob, RLHFJobSpec, Roles
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


# ---------------------------------------------------------------------------------------------
# The same rules in CEL, for the admission policy (`rlhf_operator.admission` renders them)


@dataclass(frozen=True)
class PodPlace:
    """Where a job sets pod overrides (`RLHFJobSpec.pod_places`), as CEL reaches it: each step
    below spec, and whether it may be null (an optional role, an unset `pod`)."""

    field: str
    """``spec.roles.reference.pod``: how messages name it."""
    steps: tuple[tuple[str, bool], ...]

    def cel_list(self, root: str, leaf: str) -> str:
        """CEL: the list `leaf` of this place in `root` (``object`` or ``oldObject``), or []
        when any step is missing or null (every optional field is nullable in the CRD)."""
        expr = f"{root}.spec"
        checks = [f"{root} != null", f"has({expr})"]
        for step, nullable in (*self.steps, (leaf, False)):
            expr = f"{expr}.{step}"
            checks.append(f"has({expr})")
            if nullable:
                checks.append(f"{expr} != null")
        return f"({' && '.join(checks)} ? {expr} : [])"


def _nullable(model: type[RLHFJobSpec] | type[HeadSpec] | type[Roles], name: str) -> bool:
    field = model.model_fields[name]
    return not field.is_required() and field.default is None


def pod_places() -> tuple[PodPlace, ...]:
    """Every place of pod overrides, from the API's models: spec.pods, the head's, each role's."""
    places = [PodPlace("spec.pods", (("pods", _nullable(RLHFJobSpec, "pods")),))]
    for place in POD_PLACES:
        steps: tuple[tuple[str, bool], ...]
        if place == "head":
            steps = (("head", _nullable(RLHFJobSpec, "head")), ("pod", _nullable(HeadSpec, "pod")))
        else:
            role = place.removeprefix("roles.")
            steps = (("roles", False), (role, _nullable(Roles, role)), ("pod", True))
        places.append(PodPlace(f"spec.{place}.pod", steps))
    return tuple(places)


@dataclass(frozen=True)
class Variable:
    """A CEL variable of the admission policy; `secrets_refused` ones exist only where the
    policy does not allow `secret` volumes (the chart renders them under that condition)."""

    name: str
    expression: str
    secrets_refused: bool = False


@dataclass(frozen=True)
class Check:
    """A validation of the admission policy: `expression` must hold; `field` is what it guards."""

    field: str
    expression: str
    message: str
    message_expression: str
    secrets_refused: bool = False


def _unchanged(new: str, old: str) -> str:
    """CEL: an UPDATE that leaves the field as it was is not re-checked (so a job created before
    a policy change can still be finalized and deleted)."""
    return f"(variables.update && variables.{new} == variables.{old})"


def _present(root: str, path: str) -> str:
    """CEL: every step of `path` below `root` is set and not null."""
    parts, checks, expr = path.split("."), [f"{root} != null"], root
    for part in parts:
        checks.append(f"has({expr}.{part})")
        expr = f"{expr}.{part}"
        checks.append(f"{expr} != null")
    return " && ".join(checks)


def variables() -> list[Variable]:
    """The policy's variables after the installation's four (`admission.INSTALLATION`)."""
    found = [
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
    for name, root in (("volume", "object"), ("oldVolume", "oldObject")):
        volume = f"{root}.spec.checkpoint.volume"
        found.append(
            Variable(name, f"{_present(root, 'spec.checkpoint.volume')} ? {volume} : {{}}")
        )
    for name, root in (("serviceAccount", "object"), ("oldServiceAccount", "oldObject")):
        account = f"{root}.spec.serviceAccountName"
        found.append(
            Variable(name, f"{_present(root, 'spec.serviceAccountName')} ? {account} : ''")
        )
    for index, place in enumerate(pod_places()):
        for prefix, root in (("", "object"), ("old", "oldObject")):
            volumes = f"{prefix}PodVolumes{index}" if prefix else f"podVolumes{index}"
            found.append(Variable(volumes, place.cel_list(root, "volumes")))
        for prefix, root in (("", "object"), ("old", "oldObject")):
            secrets = f"{prefix}PodSecrets{index}" if prefix else f"podSecrets{index}"
            env = place.cel_list(root, "env")
            env_from = place.cel_list(root, "envFrom")
            expression = (
                f"{env}.filter(e, has(e.valueFrom) && e.valueFrom != null"
                " && has(e.valueFrom.secretKeyRef) && e.valueFrom.secretKeyRef != null)"
                f".map(e, e.valueFrom.secretKeyRef.name) + {env_from}"
                ".filter(e, has(e.secretRef) && e.secretRef != null).map(e, e.secretRef.name)"
            )
            found.append(Variable(secrets, expression, secrets_refused=True))
    for name, root in (("bucketSecret", "object"), ("oldBucketSecret", "oldObject")):
        path = "spec.checkpoint.objectStore.credentialsSecret"
        found.append(
            Variable(name, f"{_present(root, path)} ? {root}.{path} : ''", secrets_refused=True)
        )
    return found


def checks() -> list[Check]:
    """The policy's validations, one per rule and place (`JobPolicy.problems` in CEL)."""
    not_allowed = "is not allowed (' + variables.allowedVolumesText + ')'"
    found = [
        Check(
            "spec.checkpoint.volume",
            f"{_unchanged('volume', 'oldVolume')}"
            " || variables.volume.all(t, t in variables.allowedVolumeTypes)",
            "spec.checkpoint.volume: volume type not allowed by the job policy",
            "'spec.checkpoint.volume: volume type '"
            " + variables.volume.filter(t, !(t in variables.allowedVolumeTypes)).join(', ')"
            f" + ' {not_allowed}",
        ),
        Check(
            "spec.serviceAccountName",
            f"{_unchanged('serviceAccount', 'oldServiceAccount')}"
            " || variables.serviceAccount == ''"
            " || variables.serviceAccount in variables.allowedServiceAccounts",
            "spec.serviceAccountName: ServiceAccount not allowed by the job policy",
            "'spec.serviceAccountName: ServiceAccount ' + variables.serviceAccount"
            " + ' is not allowed (' + variables.allowedAccountsText + ')'",
        ),
        Check(
            "spec.serviceAccountName",
            f"{_unchanged('serviceAccount', 'oldServiceAccount')}"
            " || variables.serviceAccount == ''"
            " || !(request.namespace == variables.operatorNamespace"
            " && variables.serviceAccount == variables.operatorServiceAccount)",
            "spec.serviceAccountName: a job may not run as the operator's own ServiceAccount",
            "'spec.serviceAccountName: a job may not run as the operator\\'s own ServiceAccount ('"
            " + variables.operatorNamespace + '/' + variables.operatorServiceAccount + ')'",
        ),
    ]
    for index, place in enumerate(pod_places()):
        volumes = f"variables.podVolumes{index}"
        found.append(
            Check(
                f"{place.field}.volumes",
                f"{_unchanged(f'podVolumes{index}', f'oldPodVolumes{index}')}"
                f" || {volumes}.all(v, v.all(k, k == 'name' || k in variables.allowedVolumeTypes))",
                f"{place.field}.volumes: volume type not allowed by the job policy",
                f"'{place.field}.volumes: volume type ' + {volumes}.map(v, v.filter(k, k != 'name'"
                " && !(k in variables.allowedVolumeTypes)).join(', ')).filter(t, t != '')"
                f".join(', ') + ' {not_allowed}",
            )
        )
        secrets = f"variables.podSecrets{index}"
        found.append(
            Check(
                place.field,
                f"{_unchanged(f'podSecrets{index}', f'oldPodSecrets{index}')}"
                f" || size({secrets}) == 0",
                f"{place.field}: Secrets may not be read into the environment here (secret is"
                " not an allowed volume type)",
                f"'{place.field}: Secrets may not be read into the environment here (' +"
                f" {secrets}.join(', ') + '; secret is not an allowed volume type)'",
                secrets_refused=True,
            )
        )
    found.append(
        Check(
            "spec.checkpoint.objectStore.credentialsSecret",
            f"{_unchanged('bucketSecret', 'oldBucketSecret')} || variables.bucketSecret == ''",
            "spec.checkpoint.objectStore.credentialsSecret: Secrets may not be read into the"
            " environment here (secret is not an allowed volume type)",
            "'spec.checkpoint.objectStore.credentialsSecret: Secrets may not be read into the"
            " environment here (secret is not an allowed volume type)'",
            secrets_refused=True,
        )
    )
    return found
