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

import re
from dataclasses import dataclass
from typing import Any

from rlhf_operator.names import RAY_AUTH_SECRETS
from rlhf_operator.queueing import queue_name
from rlhfjob.api import (
    POD_PLACES,
    ROLE_NAMES,
    HeadSpec,
    PodOverrides,
    RLHFJob,
    RLHFJobSpec,
    Roles,
    Toleration,
)
from rlhfjob.api.kubeschema import VOLUME_SOURCES
from rlhfjob.contract.kueue import LABEL_QUEUE_NAME

DEFAULT_VOLUME_TYPES = VOLUME_SOURCES
"""Volume sources a job's volumes may use unless the policy says otherwise: those whose
Kubernetes schema the API carries (`rlhfjob.api.kubeschema`)."""


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


CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
"""Node labels and taints of control-plane nodes: no job's pod may select or tolerate them."""
SYSTEM_PRIORITY_PREFIX = "system-"
"""Kubernetes' own priority classes (system-cluster-critical, system-node-critical) and any a
platform names so: a job may use one only where the policy lists it."""
DEFAULT_SCHEDULER = "default-scheduler"


def _volume_secrets(where: str, source: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, name) of each Secret a volume source reads: a `secret` volume, a `projected`
    one's secret sources, and a CSI driver's `nodePublishSecretRef`."""
    found: list[tuple[str, str]] = []
    secret = source.get("secret")
    if isinstance(secret, dict) and isinstance(secret.get("secretName"), str):
        found.append((f"{where}.secret.secretName", secret["secretName"]))
    projected = source.get("projected")
    sources = projected.get("sources") if isinstance(projected, dict) else None
    for index, item in enumerate(sources if isinstance(sources, list) else []):
        ref = item.get("secret") if isinstance(item, dict) else None
        if isinstance(ref, dict) and isinstance(ref.get("name"), str):
            found.append((f"{where}.projected.sources[{index}].secret.name", ref["name"]))
    csi = source.get("csi")
    ref = csi.get("nodePublishSecretRef") if isinstance(csi, dict) else None
    if isinstance(ref, dict) and isinstance(ref.get("name"), str):
        found.append((f"{where}.csi.nodePublishSecretRef.name", ref["name"]))
    return found


def _pod_secrets(pod: PodOverrides) -> list[tuple[str, str]]:
    """(field below the pod, name) of every Secret the pod overrides read."""
    found = [
        (f"env[{index}].valueFrom.secretKeyRef.name", var.value_from.secret_key_ref.name)
        for index, var in enumerate(pod.env)
        if var.value_from is not None and var.value_from.secret_key_ref is not None
    ]
    found += [
        (f"envFrom[{index}].secretRef.name", source.secret_ref.name)
        for index, source in enumerate(pod.env_from)
        if source.secret_ref is not None
    ]
    for index, volume in enumerate(pod.volumes):
        found += _volume_secrets(f"volumes[{index}]", volume.model_extra or {})
    return found


def _placements(spec: RLHFJobSpec) -> dict[str, Any]:
    """The head and each role present, by field path: where nodes are selected and tolerated."""
    places: dict[str, Any] = {"spec.head": spec.head}
    for role in ROLE_NAMES:
        if (found := getattr(spec.roles, role)) is not None:
            places[f"spec.roles.{role}"] = found
    return places


def _affinity_keys(affinity: Any) -> list[str]:
    """The node label keys a Kubernetes affinity selects on (required and preferred terms)."""
    node = affinity.get("nodeAffinity") if isinstance(affinity, dict) else None
    if not isinstance(node, dict):
        return []
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
    terms = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
    terms = list(terms) if isinstance(terms, list) else []
    preferred = node.get("preferredDuringSchedulingIgnoredDuringExecution")
    for item in preferred if isinstance(preferred, list) else []:
        if isinstance(item, dict):
            terms.append(item.get("preference"))
    keys = []
    for term in terms:
        expressions = term.get("matchExpressions") if isinstance(term, dict) else None
        for expression in expressions if isinstance(expressions, list) else []:
            if isinstance(expression, dict) and isinstance(expression.get("key"), str):
                keys.append(expression["key"])
    return keys


def _allowed_text(values: tuple[str, ...], value: str) -> str:
    return f"allowed: {', '.join(values) or 'none'}; the chart's jobPolicy.{value}"


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

    def problems(self, job: RLHFJob) -> list[str]:
        """Each way the job breaks the policy, naming the field; empty when it keeps it."""
        found: list[str] = []
        if self.operator_namespace and job.metadata.namespace == self.operator_namespace:
            found.append(
                f"metadata.namespace: {self.operator_namespace!r} is the operator's own namespace "
                "(its key and identity live there): create the job in a team's namespace"
            )
        found += self._token_problems(job.spec)
        found += self._placement_problems(job.spec)
        found += self._inline_volume_problems(job.spec)
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

    def _token_problems(self, spec: RLHFJobSpec) -> list[str]:
        """A reference to a Ray token Secret, which would let one job reach another's head."""
        refs: dict[str, list[tuple[str, str]]] = {}
        for path, pod in spec.pod_places().items():
            refs[path] = [(f"{path}.{field}", name) for field, name in _pod_secrets(pod)]
        pulls = spec.pods.image_pull_secrets if spec.pods is not None else []
        refs.setdefault("spec.pods", []).extend(
            (f"spec.pods.imagePullSecrets[{index}].name", pull.name)
            for index, pull in enumerate(pulls)
        )
        checkpoint = spec.checkpoint
        refs["spec.checkpoint"] = _volume_secrets("spec.checkpoint.volume", checkpoint.volume or {})
        if checkpoint.object_store and checkpoint.object_store.credentials_secret:
            where = "spec.checkpoint.objectStore.credentialsSecret"
            refs["spec.checkpoint"].append((where, checkpoint.object_store.credentials_secret))
        return [
            f"{place}: {field.removeprefix(place + '.')} names {name!r}, a Ray token Secret (a "
            "name ending -ray-auth-…): no job may read one, its own included (the operator "
            "hands each job its token)"
            for place, found in refs.items()
            for field, name in found
            if re.search(RAY_AUTH_SECRETS, name)
        ]

    def _placement_problems(self, spec: RLHFJobSpec) -> list[str]:
        """Pods placed onto control-plane nodes, onto every tainted node, or scheduled with
        more priority or by another scheduler than the policy gives."""
        found: list[str] = []
        for place, where in _placements(spec).items():
            for key in sorted(set(where.node_selector) & set(CONTROL_PLANE_KEYS)):
                found.append(f"{place}.nodeSelector: {key} selects control-plane nodes")
            for index, toleration in enumerate(where.tolerations):
                found += self._toleration_problems(f"{place}.tolerations[{index}]", toleration)
            for key in _affinity_keys(getattr(where, "affinity", None)):
                if key in CONTROL_PLANE_KEYS:
                    found.append(f"{place}.affinity: {key} selects control-plane nodes")
        pods = spec.pods
        priority = pods.priority_class_name if pods is not None else None
        if (
            priority
            and priority.startswith(SYSTEM_PRIORITY_PREFIX)
            and priority not in self.allowed_system_priority_classes
        ):
            allowed = _allowed_text(
                self.allowed_system_priority_classes, "allowedSystemPriorityClasses"
            )
            found.append(
                f"spec.pods.priorityClassName: {priority!r} is a system priority class ({allowed})"
            )
        scheduler = pods.scheduler_name if pods is not None else None
        if (
            scheduler
            and scheduler != DEFAULT_SCHEDULER
            and scheduler not in self.allowed_scheduler_names
        ):
            allowed = _allowed_text(self.allowed_scheduler_names, "allowedSchedulerNames")
            found.append(f"spec.pods.schedulerName: {scheduler!r} is not allowed ({allowed})")
        return found

    def _toleration_problems(self, field: str, toleration: Toleration) -> list[str]:
        if toleration.key in CONTROL_PLANE_KEYS:
            return [f"{field}: tolerates the control-plane taint {toleration.key}"]
        if not toleration.key and not self.tolerate_all_taints:
            return [
                f"{field}: operator Exists without a key tolerates every taint (the chart's "
                "jobPolicy.tolerateAllTaints allows it); name the taint"
            ]
        return []

    def _inline_volume_problems(self, spec: RLHFJobSpec) -> list[str]:
        """Inline NFS servers and CSI drivers outside the policy's lists."""
        sources = {"spec.checkpoint.volume": spec.checkpoint.volume or {}}
        for path, pod in spec.pod_places().items():
            for index, volume in enumerate(pod.volumes):
                sources[f"{path}.volumes[{index}]"] = volume.model_extra or {}
        found: list[str] = []
        for field, source in sources.items():
            nfs, csi = source.get("nfs"), source.get("csi")
            if isinstance(nfs, dict) and nfs.get("server") not in self.allowed_nfs_servers:
                allowed = _allowed_text(self.allowed_nfs_servers, "allowedNfsServers")
                found.append(
                    f"{field}: NFS server {nfs.get('server')!r} is not allowed ({allowed})"
                )
            if isinstance(csi, dict) and csi.get("driver") not in self.allowed_csi_drivers:
                allowed = _allowed_text(self.allowed_csi_drivers, "allowedCsiDrivers")
                found.append(
                    f"{field}: CSI driver {csi.get('driver')!r} is not allowed ({allowed})"
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

    def cel_list(self, root: str, leaf: str, empty: str = "[]", nullable: bool = False) -> str:
        """CEL: the list (or map, `empty` ``{}``) `leaf` of this place in `root` (``object`` or
        ``oldObject``), or `empty` when any step is missing or null (every optional field is
        nullable in the CRD; a `nullable` leaf too)."""
        expr = f"{root}.spec"
        checks = [f"{root} != null", f"has({expr})"]
        for step, may_be_null in (*self.steps, (leaf, nullable)):
            expr = f"{expr}.{step}"
            checks.append(f"has({expr})")
            if may_be_null:
                checks.append(f"{expr} != null")
        return f"({' && '.join(checks)} ? {expr} : {empty})"


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


def placement_places() -> tuple[PodPlace, ...]:
    """Where nodes are selected and tolerated (`_placements`): the head and each role."""
    places = [PodPlace("spec.head", (("head", _nullable(RLHFJobSpec, "head")),))]
    for role in ROLE_NAMES:
        places.append(
            PodPlace(f"spec.roles.{role}", (("roles", False), (role, _nullable(Roles, role))))
        )
    return tuple(places)


def _set(expr: str) -> str:
    """CEL: `expr` (a field path) is set and not null."""
    return f"has({expr}) && {expr} != null"


def _cel_strings(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{value}'" for value in values) + "]"


TOKEN = f"matches('{RAY_AUTH_SECRETS}')"
CONTROL_PLANE = _cel_strings(CONTROL_PLANE_KEYS)


def _volume_token(v: str) -> str:
    """CEL: the volume source `v` reads a Ray token Secret (`_volume_secrets`)."""
    sources = f"{v}.projected.sources"
    return (
        f"({_set(f'{v}.secret')} && has({v}.secret.secretName) && {v}.secret.secretName.{TOKEN})"
        f" || ({_set(f'{v}.csi')} && {_set(f'{v}.csi.nodePublishSecretRef')}"
        f" && has({v}.csi.nodePublishSecretRef.name) && {v}.csi.nodePublishSecretRef.name.{TOKEN})"
        f" || ({_set(f'{v}.projected')} && {_set(sources)}"
        f" && {sources}.exists(s, {_set('s.secret')} && has(s.secret.name)"
        f" && s.secret.name.{TOKEN}))"
    )


def _pod_tokens(place: PodPlace, root: str, volumes: str) -> str:
    """CEL: the pod overrides at `place` read a Ray token Secret (`_pod_secrets`)."""
    ref = "e.valueFrom.secretKeyRef"
    found = (
        f"{place.cel_list(root, 'env')}.exists(e, {_set('e.valueFrom')} && {_set(ref)}"
        f" && {ref}.name.{TOKEN})"
        f" || {place.cel_list(root, 'envFrom')}.exists(e, {_set('e.secretRef')}"
        f" && e.secretRef.name.{TOKEN})"
        f" || {volumes}.exists(v, {_volume_token('v')})"
    )
    if place.field == "spec.pods":
        found += f" || {place.cel_list(root, 'imagePullSecrets')}.exists(p, p.name.{TOKEN})"
    return f"({found})"


def _affinity_keys_in(a: str, keys: str) -> str:
    """CEL: the affinity `a` selects on one of `keys` (`_affinity_keys`)."""
    node = f"{a}.nodeAffinity"
    required = f"{node}.requiredDuringSchedulingIgnoredDuringExecution"
    preferred = f"{node}.preferredDuringSchedulingIgnoredDuringExecution"
    matches = "exists(e, has(e.key) && e.key in " + keys + ")"
    return (
        f"({_set(node)} && (({_set(required)} && {_set(f'{required}.nodeSelectorTerms')}"
        f" && {required}.nodeSelectorTerms.exists(t, {_set('t.matchExpressions')}"
        f" && t.matchExpressions.{matches}))"
        f" || ({_set(preferred)} && {preferred}.exists(p, {_set('p.preference')}"
        f" && {_set('p.preference.matchExpressions')}"
        f" && p.preference.matchExpressions.{matches}))))"
    )


def _inline_allowed(v: str, kind: str, key: str, allowed: str) -> str:
    """CEL: the volume source `v` is no inline `kind`, or its `key` is in `allowed`."""
    return f"(!({_set(f'{v}.{kind}')}) || (has({v}.{kind}.{key}) && {v}.{kind}.{key} in {allowed}))"


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
    """The policy's variables after the installation's (`admission.INSTALLATION`)."""
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
    for index, place in enumerate(pod_places()):
        for prefix, root in (("", "object"), ("old", "oldObject")):
            volumes = (
                f"variables.{prefix}PodVolumes{index}" if prefix else f"variables.podVolumes{index}"
            )
            name = f"{prefix}PodTokens{index}" if prefix else f"podTokens{index}"
            found.append(Variable(name, _pod_tokens(place, root, volumes)))
    bucket = "spec.checkpoint.objectStore.credentialsSecret"
    for prefix, root in (("", "object"), ("old", "oldObject")):
        volume = f"variables.{prefix}Volume" if prefix else "variables.volume"
        name = f"{prefix}CheckpointTokens" if prefix else "checkpointTokens"
        expression = (
            f"({_volume_token(volume)}) || ({_present(root, bucket)} && {root}.{bucket}.{TOKEN})"
        )
        found.append(Variable(name, expression))
    for index, place in enumerate(placement_places()):
        for prefix, root in (("", "object"), ("old", "oldObject")):
            for leaf, empty, nullable in (
                ("tolerations", "[]", False),
                ("nodeSelector", "{}", False),
                ("affinity", "{}", True),
            ):
                if leaf == "affinity" and place.field == "spec.head":
                    continue  # the head has no affinity
                name = f"{prefix}{leaf[0].upper()}{leaf[1:]}{index}" if prefix else f"{leaf}{index}"
                found.append(Variable(name, place.cel_list(root, leaf, empty, nullable)))
    for name, path in (
        ("priorityClass", "spec.pods.priorityClassName"),
        ("scheduler", "spec.pods.schedulerName"),
    ):
        for prefix, root in (("", "object"), ("old", "oldObject")):
            key = f"{prefix}{name[0].upper()}{name[1:]}" if prefix else name
            found.append(Variable(key, f"{_present(root, path)} ? {root}.{path} : ''"))
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
    found.append(
        Check(
            "metadata.namespace",
            "variables.update || request.namespace != variables.operatorNamespace",
            "metadata.namespace: no job may run in the operator's own namespace",
            "'metadata.namespace: ' + request.namespace + ' is the operator\\'s own namespace"
            " (its key and identity live there): create the job in a team\\'s namespace'",
        )
    )
    token_text = "a Ray token Secret (a name ending -ray-auth-…) may not be read by any job"
    for index, place in enumerate(pod_places()):
        found.append(
            Check(
                place.field,
                f"{_unchanged(f'podTokens{index}', f'oldPodTokens{index}')}"
                f" || !variables.podTokens{index}",
                f"{place.field}: {token_text}",
                f"'{place.field}: {token_text}'",
            )
        )
    found.append(
        Check(
            "spec.checkpoint",
            f"{_unchanged('checkpointTokens', 'oldCheckpointTokens')}"
            " || !variables.checkpointTokens",
            f"spec.checkpoint: {token_text}",
            f"'spec.checkpoint: {token_text}'",
        )
    )
    for index, place in enumerate(placement_places()):
        tolerations = f"variables.tolerations{index}"
        unchanged = _unchanged(f"tolerations{index}", f"oldTolerations{index}")
        field = f"{place.field}.tolerations"
        found.append(
            Check(
                field,
                f"{unchanged} || !{tolerations}.exists(t, has(t.key) && t.key in {CONTROL_PLANE})",
                f"{field}: no job may tolerate the control-plane taints",
                f"'{field}: no job may tolerate the control-plane taints'",
            )
        )
        found.append(
            Check(
                field,
                f"{unchanged} || variables.tolerateAllTaints"
                f" || {tolerations}.all(t, {_set('t.key')} && t.key != '')",
                f"{field}: operator Exists without a key tolerates every taint",
                f"'{field}: operator Exists without a key tolerates every taint (the chart\\'s"
                " jobPolicy.tolerateAllTaints allows it); name the taint'",
            )
        )
        field = f"{place.field}.nodeSelector"
        found.append(
            Check(
                field,
                f"{_unchanged(f'nodeSelector{index}', f'oldNodeSelector{index}')}"
                f" || !variables.nodeSelector{index}.exists(k, k in {CONTROL_PLANE})",
                f"{field}: no job may select control-plane nodes",
                f"'{field}: no job may select control-plane nodes'",
            )
        )
        if place.field != "spec.head":
            field = f"{place.field}.affinity"
            found.append(
                Check(
                    field,
                    f"{_unchanged(f'affinity{index}', f'oldAffinity{index}')}"
                    f" || !{_affinity_keys_in(f'variables.affinity{index}', CONTROL_PLANE)}",
                    f"{field}: no job may select control-plane nodes",
                    f"'{field}: no job may select control-plane nodes'",
                )
            )
    found.append(
        Check(
            "spec.pods.priorityClassName",
            f"{_unchanged('priorityClass', 'oldPriorityClass')}"
            f" || !variables.priorityClass.startsWith('{SYSTEM_PRIORITY_PREFIX}')"
            " || variables.priorityClass in variables.allowedSystemPriorityClasses",
            "spec.pods.priorityClassName: a system priority class the job policy does not list",
            "'spec.pods.priorityClassName: ' + variables.priorityClass + ' is a system priority"
            " class (allowed: ' + (size(variables.allowedSystemPriorityClasses) == 0 ? 'none'"
            " : variables.allowedSystemPriorityClasses.join(', ')) + '; the chart\\'s"
            " jobPolicy.allowedSystemPriorityClasses)'",
        )
    )
    found.append(
        Check(
            "spec.pods.schedulerName",
            f"{_unchanged('scheduler', 'oldScheduler')} || variables.scheduler == ''"
            f" || variables.scheduler == '{DEFAULT_SCHEDULER}'"
            " || variables.scheduler in variables.allowedSchedulerNames",
            "spec.pods.schedulerName: a scheduler the job policy does not list",
            "'spec.pods.schedulerName: ' + variables.scheduler + ' is not allowed (allowed: ' +"
            " (size(variables.allowedSchedulerNames) == 0 ? 'none'"
            " : variables.allowedSchedulerNames.join(', ')) + '; the chart\\'s"
            " jobPolicy.allowedSchedulerNames)'",
        )
    )
    inline = [
        ("nfs", "server", "variables.allowedNfsServers", "an NFS server"),
        ("csi", "driver", "variables.allowedCsiDrivers", "a CSI driver"),
    ]
    for kind, key, allowed, what in inline:
        found.append(
            Check(
                "spec.checkpoint.volume",
                f"{_unchanged('volume', 'oldVolume')}"
                f" || {_inline_allowed('variables.volume', kind, key, allowed)}",
                f"spec.checkpoint.volume: {what} the job policy does not list",
                f"'spec.checkpoint.volume: {what} the job policy does not list'",
            )
        )
    for index, place in enumerate(pod_places()):
        volumes = f"variables.podVolumes{index}"
        for kind, key, allowed, what in inline:
            field = f"{place.field}.volumes"
            found.append(
                Check(
                    field,
                    f"{_unchanged(f'podVolumes{index}', f'oldPodVolumes{index}')}"
                    f" || {volumes}.all(v, {_inline_allowed('v', kind, key, allowed)})",
                    f"{field}: {what} the job policy does not list",
                    f"'{field}: {what} the job policy does not list'",
                )
            )
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
