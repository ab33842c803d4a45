"""What a job adds to its Ray pods: environment, volumes and their mounts, pull Secrets, the
pod overrides of a role and the defaults of every role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from rlhfjob.api.base import (
    DNS_LABEL_PATTERN,
    DNS_SUBDOMAIN_PATTERN,
    ENV_NAME_PATTERN,
    LABEL_KEYS_RULE,
    OPERATOR_RESOURCES,
    OPERATOR_VOLUMES,
    READ_ONLY_MOUNT_PATHS,
    RESERVED_ENV,
    RESERVED_KEY_DOMAINS,
    RESERVED_MOUNT_PATHS,
    VOLUME_SOURCES_SCHEMA,
    ApiModel,
    LabelValue,
    Quantity,
    _cel_list,
    _checked,
    _one_volume_source,
    _validations,
)
from rlhfjob.cel import CelRule, clean_path


def _free_mount_path(field: str) -> CelRule:
    """`field`, a mount path, is not /, nor where the operator mounts, nor inside a read-only
    mount: the pod API would refuse the second mount (or the operator's would be hidden)."""
    path = f"self.{field}"
    return CelRule(
        f"{path} != '/' && !{_cel_list(RESERVED_MOUNT_PATHS)}"
        f".exists(p, {path} == p || {path} == p + '/')"
        f" && !{_cel_list(READ_ONLY_MOUNT_PATHS)}.exists(p, {path}.startsWith(p + '/'))",
        f"{field} must not be /, where the operator mounts a volume"
        f" ({', '.join(RESERVED_MOUNT_PATHS)}) nor inside the read-only"
        f" {', '.join(READ_ONLY_MOUNT_PATHS)}",
        f".{field}",
    )


@dataclass(frozen=True)
class ListMapKey:
    """Entries of a list differ in `key` (a field of theirs), as in the pod API: the API server
    keeps the list a map (`x-kubernetes-list-type: map`), refusing a repeated key at no CEL cost
    and merging by it on server-side apply; the models refuse it alike, naming the entry; and a
    pod's own entry replaces the job's of the same key (`PodOverrides.overlaid`)."""

    key: str

    def __get_pydantic_json_schema__(
        self, core: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core)
        schema["x-kubernetes-list-type"] = "map"
        schema["x-kubernetes-list-map-keys"] = [to_camel(self.key)]
        return schema

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def _check(self, items: list[Any]) -> list[Any]:
        seen: set[Any] = set()
        for index, item in enumerate(items):
            value = getattr(item, self.key)
            if value in seen:
                message = f"Duplicate value: {to_camel(self.key)} {value!r}"
                raise PydanticCustomError(
                    "duplicate_key", "{message}", {"message": message, "field": f"[{index}]"}
                )
            seen.add(value)
        return items

    @staticmethod
    def of(field: FieldInfo) -> str | None:
        """The key of a field's list, if it is keyed."""
        return next((m.key for m in field.metadata if isinstance(m, ListMapKey)), None)


ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]
EnvName = Annotated[str, Field(min_length=1, max_length=253, pattern=ENV_NAME_PATTERN)]


class KeyRef(ApiModel):
    """One key of a Secret or ConfigMap in the job's namespace. The kubelet reads it when it
    starts the pod; the operator never does."""

    name: ObjectName
    """The Secret's or ConfigMap's name."""
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    """The key whose value the variable takes."""
    optional: bool = False
    """Start the pod without the variable when the object or key is missing (else the pod waits
    for them)."""


class EnvSource(ApiModel):
    """Where a variable's value comes from: a Secret's key or a ConfigMap's."""

    secret_key_ref: KeyRef | None = None
    """A key of a Secret: tokens and passwords (HF_TOKEN, WANDB_API_KEY)."""
    config_map_key_ref: KeyRef | None = None
    """A key of a ConfigMap."""

    cel_rules = (
        CelRule(
            "has(self.secretKeyRef) != has(self.configMapKeyRef)",
            "set exactly one of secretKeyRef and configMapKeyRef",
            ".secretKeyRef",
        ),
    )


class EnvVar(ApiModel):
    """One environment variable of the Ray container: a literal value or a reference."""

    name: EnvName
    """The variable's name. The operator's and KubeRay's own (RLHF_JOB_NAME, RAY_ADDRESS, ...)
    cannot be set."""
    value: str | None = Field(default=None, max_length=32768)
    """A literal value. It is stored in the RLHFJob, its ConfigMap and the RayCluster, where
    anyone who may read those reads it: put secrets in a Secret and use valueFrom."""
    value_from: EnvSource | None = None
    """The value of a Secret's or ConfigMap's key, read by the kubelet."""

    cel_rules = (
        CelRule(
            f"!(self.name in {_cel_list(RESERVED_ENV)})",
            "the operator or KubeRay sets this variable: " + ", ".join(RESERVED_ENV),
            ".name",
        ),
        CelRule(
            "!has(self.value) || !has(self.valueFrom)",
            "set value or valueFrom, not both",
            ".valueFrom",
        ),
    )


class ObjectRef(ApiModel):
    """A Secret or ConfigMap in the job's namespace, all of whose keys become variables."""

    name: ObjectName
    """Its name."""
    optional: bool = False
    """Start the pod without its variables when it is missing (else the pod waits for it)."""


class EnvFromSource(ApiModel):
    """Every key of a Secret or ConfigMap as a variable (keys that are no variable name are
    skipped)."""

    prefix: str | None = Field(default=None, min_length=1, max_length=253, pattern=ENV_NAME_PATTERN)
    """Put before each key to make the variable's name."""
    secret_ref: ObjectRef | None = None
    """A Secret."""
    config_map_ref: ObjectRef | None = None
    """A ConfigMap."""

    cel_rules = (
        CelRule(
            "has(self.secretRef) != has(self.configMapRef)",
            "set exactly one of secretRef and configMapRef",
            ".secretRef",
        ),
    )


class PodVolume(ApiModel):
    """A Kubernetes volume: its name and one source (persistentVolumeClaim, configMap, secret,
    csi, nfs, emptyDir, ...), of the types the installation allows."""

    # The source: one of some thirty kinds, passed on; those the API knows, with their schema.
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra=lambda schema: schema["properties"].update(
            VOLUME_SOURCES_SCHEMA["properties"]
        ),
    )

    name: str = Field(
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="The volume's name, which volumeMounts use; the operator's own are taken: "
        + ", ".join(OPERATOR_VOLUMES)
        + ".",
    )

    cel_rules = (
        CelRule(
            f"!(self.name in {_cel_list(OPERATOR_VOLUMES)})",
            "the operator names its own volumes so: " + ", ".join(OPERATOR_VOLUMES),
            ".name",
        ),
    )

    @model_validator(mode="after")
    def _one_source(self) -> PodVolume:
        # Not expressible in CEL: the server shows a rule only the declared properties.
        _one_volume_source(self.model_extra or {})
        return self

    def source_types(self) -> list[str]:
        """The volume's source kinds (one in a valid volume): what the job policy allows."""
        return sorted(self.model_extra or {})


class VolumeMount(ApiModel):
    """Where the Ray container mounts one of its pod's volumes."""

    name: str = Field(max_length=63, pattern=DNS_LABEL_PATTERN)
    """The volume: one of this pod's volumes or of spec.pods.volumes."""
    mount_path: str = Field(min_length=2, max_length=4096, pattern="^/")
    """Where, an absolute path; not where the operator mounts its own volumes nor the checkpoint
    path."""
    read_only: bool = False
    """Mount it read-only (a models volume shared by every pod, say)."""
    sub_path: str | None = Field(default=None, min_length=1, max_length=4096, pattern="^[^/]")
    """Mount only this relative path inside the volume."""

    cel_rules = (
        _free_mount_path("mountPath"),
        clean_path("mountPath"),
        clean_path("subPath"),
    )


def _reserved_keys_rule(what: str) -> CelRule:
    domains = "|".join(domain.replace(".", "[.]") for domain in RESERVED_KEY_DOMAINS)
    return CelRule(
        f"self.all(k, !k.matches('^([^/]*[.])?({domains})/'))",
        f"{what} under "
        + " and ".join(f"{d}/" for d in RESERVED_KEY_DOMAINS)
        + " (or their subdomains) are the operator's and KubeRay's",
    )


_LABELS_RULES = (LABEL_KEYS_RULE, _reserved_keys_rule("labels"))
PodLabels = Annotated[
    dict[str, LabelValue],
    Field(max_length=64, json_schema_extra=_validations(_LABELS_RULES)),
    _checked(_LABELS_RULES),
]
SECURITY_PROFILE_ANNOTATIONS = (
    "container.apparmor.security.beta.kubernetes.io/",
    "seccomp.security.alpha.kubernetes.io/",
    "container.seccomp.security.alpha.kubernetes.io/",
)
"""The older annotation form of AppArmor and seccomp profiles: one set to `unconfined` would turn
the profile the operator's pods run under off, so no job may set them."""
_ANNOTATIONS_RULES = (
    LABEL_KEYS_RULE,
    _reserved_keys_rule("annotations"),
    CelRule(
        "self.all(k, "
        + " && ".join(f"!k.startsWith('{prefix}')" for prefix in SECURITY_PROFILE_ANNOTATIONS)
        + ")",
        "AppArmor and seccomp profiles are the operator's (RuntimeDefault): no annotation may "
        "set one",
    ),
)
PodAnnotations = Annotated[
    dict[str, str],
    Field(max_length=64, json_schema_extra=_validations(_ANNOTATIONS_RULES)),
    _checked(_ANNOTATIONS_RULES),
]
_RESOURCE_KEYS_RULES = (
    CelRule(
        LABEL_KEYS_RULE.rule,
        "every key must be a resource name: [prefix/]name, as a label key (rdma/ib, "
        "ephemeral-storage)",
    ),
    CelRule(
        f"!self.exists(k, k in {_cel_list(OPERATOR_RESOURCES)})",
        "cpu, memory and GPUs have their own fields (cpu, memory, gpus)",
    ),
)
ExtraResources = Annotated[
    dict[str, Quantity],
    Field(max_length=16, json_schema_extra=_validations(_RESOURCE_KEYS_RULES)),
    _checked(_RESOURCE_KEYS_RULES),
]


class PodOverrides(ApiModel):
    """What a job adds to Ray pods: environment, volumes, labels, annotations, resources.

    As `spec.pods` it applies to every Ray pod, the head's too; as a role's or the head's `pod`,
    to those pods, on top of `spec.pods`: maps merged, lists joined (this pod's entry wins on an
    equal env name, volume name or mount path), single values replaced.
    """

    env: Annotated[list[EnvVar], ListMapKey("name")] = Field(default_factory=list, max_length=64)
    """Environment variables of the Ray container (the driver's and every actor's). Name
    secrets with valueFrom.secretKeyRef: the kubelet resolves it, and the value appears in no
    object the operator writes."""
    env_from: list[EnvFromSource] = Field(default_factory=list, max_length=16)
    """Secrets and ConfigMaps whose every key becomes a variable. `env` wins over them, and the
    operator's and KubeRay's own variables over both."""
    volumes: Annotated[list[PodVolume], ListMapKey("name")] = Field(
        default_factory=list, max_length=32
    )
    """More volumes (a models volume, say), beside the operator's own and the checkpoint
    volume."""
    volume_mounts: Annotated[list[VolumeMount], ListMapKey("mount_path")] = Field(
        default_factory=list, max_length=32
    )
    """Where the Ray container mounts them."""
    extra_resources: ExtraResources = Field(default_factory=dict)
    """More resources per pod, requested and limited alike (extended resources must be): for
    example `rdma/ib: 1` or `ephemeral-storage: 100Gi` (Kubernetes quantities)."""
    shm_size: Quantity | None = None
    """Size limit of the memory-backed /dev/shm (Ray's object store, NCCL), a quantity of bytes
    counted against the pod's memory; unset: only the pod's memory limits it."""
    labels: PodLabels = Field(default_factory=dict)
    """Labels of the pods, beside the operator's and KubeRay's."""
    annotations: PodAnnotations = Field(default_factory=dict)
    """Annotations of the pods (a service mesh's, a log shipper's)."""

    def overlaid(self, pod: PodOverrides | None) -> PodOverrides:
        """These overrides (spec.pods) with one pod's own laid over them."""
        pod = pod or PodOverrides()
        values: dict[str, Any] = {}
        for name in PodOverrides.model_fields:
            low, high = getattr(self, name), getattr(pod, name)
            if isinstance(low, dict):
                values[name] = {**low, **high}
            elif isinstance(low, list):
                key = ListMapKey.of(PodOverrides.model_fields[name])
                if key is None:
                    values[name] = [*low, *(item for item in high if item not in low)]
                else:
                    replaced = {getattr(item, key) for item in high}
                    values[name] = [i for i in low if getattr(i, key) not in replaced] + high
            else:
                values[name] = low if high is None else high
        return PodOverrides.model_construct(**values)


class PullSecret(ApiModel):
    """A Secret of the job's namespace with registry credentials (a dockerconfigjson)."""

    name: ObjectName
    """Its name."""


class PodDefaults(PodOverrides):
    """What a job adds to every Ray pod, and what only the whole job can choose: every pod of a
    job is scheduled by one scheduler, at one priority (so that preemption never takes a job
    apart role by role), and pulls the one image."""

    priority_class_name: ObjectName | None = None
    """The PriorityClass of every Ray pod (unset: the cluster's default)."""
    scheduler_name: ObjectName | None = None
    """The scheduler of every Ray pod, for example a gang scheduler's (unset: the default)."""
    image_pull_secrets: Annotated[list[PullSecret], ListMapKey("name")] = Field(
        default_factory=list, max_length=16
    )
    """Secrets of the job's namespace that the kubelet pulls spec.image with."""

    cel_rules = (
        CelRule(
            "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes)"
            " && self.volumes.exists(v, v.name == m.name))",
            "every volumeMount must name one of spec.pods.volumes",
            ".volumeMounts",
        ),
    )
