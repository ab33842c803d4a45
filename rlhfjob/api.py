"""The RLHFJob API (`rlhf.dev/v1alpha1`): the one source of its schema, defaults and rules.

The CRD in `crds/` is generated from these models (`task crds`), the operator reads jobs through
them, and the trainer reads its part of the same spec, so a cluster job and a local run share one
config format. Field docstrings become the CRD's descriptions (`kubectl explain rlhfjob.spec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from rlhfjob import cel
from rlhfjob.cel import CelRule, immutable

GROUP = "rlhf.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLHFJob"
PLURAL = "rlhfjobs"
SINGULAR = "rlhfjob"
SHORT_NAMES = ["rlhf"]
DERIVED_NAME_SUFFIXES = ("-config", "-trainer", "-heartbeat", "-ray-auth", "-ray-head", "-head-svc")
"""What is appended to a job's name to name the objects made for it: its ConfigMap,
ServiceAccount, heartbeat Role, Ray token Secret and NetworkPolicy (`rlhf_operator.names`), and
the head Service KubeRay names after the RayCluster, which has the job's name."""
MAX_NAME_LENGTH = 63 - max(len(suffix) for suffix in DERIVED_NAME_SUFFIXES)
"""53, so every derived name is a DNS label of at most 63 characters, the job's name itself
fits KubeRay's limit on a RayCluster's name (53) and is a valid label value."""
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""A DNS-1035 label: KubeRay refuses a RayCluster whose name is not one (no dots, no leading
digit), and the RayCluster has the job's name."""

# Kubernetes' name syntax. Only explicit ASCII classes: `\d`, `\w` and `\s` mean different
# things in the API server's regular expressions (Go) and in pydantic's (Rust).
_DNS_LABEL = "[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_DNS_SUBDOMAIN = f"{_DNS_LABEL}([.]{_DNS_LABEL})*"
_LABEL_NAME = "[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
QUALIFIED_NAME_PATTERN = f"^({_DNS_SUBDOMAIN}/)?{_LABEL_NAME}$"
"""A label key or taint key: an optional DNS-subdomain prefix and `/`, then 1-63 characters of
`[A-Za-z0-9_.-]` that start and end alphanumeric."""
MAX_QUALIFIED_NAME_LENGTH = 253 + 1 + 63
LABEL_VALUE_PATTERN = "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
"""A label value (at most 63 characters): empty, or `[A-Za-z0-9_.-]` starting and ending
alphanumeric."""
DNS_SUBDOMAIN_PATTERN = f"^{_DNS_SUBDOMAIN}$"


def _image_pattern() -> str:
    """The image reference grammar of the container runtimes (distribution's `reference`):
    `[registry[:port]/]path[:tag][@digest]`, the path lowercase."""
    component = "([a-zA-Z0-9]|[a-zA-Z0-9][-a-zA-Z0-9]*[a-zA-Z0-9])"
    host = f"({component}([.]{component})*|\\[[a-fA-F0-9:]+\\])"
    registry = f"{host}(:[0-9]+)?"
    path_component = "[a-z0-9]+(([_.]|__|[-]+)[a-z0-9]+)*"
    path = f"{path_component}(/{path_component})*"
    tag = "[A-Za-z0-9_][-A-Za-z0-9_.]{0,127}"
    digest = "[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
    return f"^({registry}/)?{path}(:{tag})?(@{digest})?$"


IMAGE_PATTERN = _image_pattern()
REWARD_FUNCTION_PATTERN = "^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$"
"""`module:function`, as a Python import path (ASCII)."""
SHM_PATH = "/dev/shm"
JOB_CONFIG_DIR = "/etc/rlhfjob"
"""The job's config (a ConfigMap, read-only) in every Ray pod."""
WRITABLE_PATHS = {
    "tmp": "/tmp",  # Ray's session directory, torch inductor, every library's scratch space
    "cache": "/home/ray/.cache",  # ~/.cache: DeepSpeed ops, vLLM, Hugging Face
    "triton": "/home/ray/.triton",  # Triton's kernel cache
}
"""The Ray pods' root filesystem is read-only; these are the image user's writable paths
(emptyDirs), by volume name."""
RESERVED_MOUNT_PATHS = (SHM_PATH, JOB_CONFIG_DIR, *WRITABLE_PATHS.values())
"""Where the operator mounts volumes in the Ray pods (`rlhf_operator.builder`): shared memory,
the job config and the writable scratch paths. A second mount at one of them is refused."""
READ_ONLY_MOUNT_PATHS = (JOB_CONFIG_DIR,)
"""Read-only mounts: nothing can be mounted inside them."""
SHM_VOLUME = "dshm"
JOB_CONFIG_VOLUME = "job-config"
CHECKPOINT_VOLUME = "checkpoints"
OPERATOR_VOLUMES = (SHM_VOLUME, *WRITABLE_PATHS, JOB_CONFIG_VOLUME, CHECKPOINT_VOLUME)
"""The volumes the operator gives every Ray pod, by name: a job's own volumes need others."""
GPU_RESOURCE = "nvidia.com/gpu"
OPERATOR_RESOURCES = ("cpu", "memory", GPU_RESOURCE)
"""What a role's `cpu`, `memory` and `gpus` request: `extraResources` may not name them."""

# The Ray container's environment: what the operator and KubeRay put there, which a job's own
# variables may not replace (`rlhfjob.contract.PodEnv` writes and reads the operator's).
ENV_JOB_NAME = "RLHF_JOB_NAME"
ENV_JOB_NAMESPACE = "RLHF_JOB_NAMESPACE"
ENV_ROLE = "RLHF_ROLE"
ENV_JOB_CONFIG = "RLHF_JOB_CONFIG"
"""Path of the job file (the ConfigMap mounted in every pod)."""
ENV_ATTEMPT = "RLHF_ATTEMPT"
"""Which restart this driver is (0 first); written into the Lease so stale writers are ignored."""
ENV_TRAINER_METRICS_PORT = "RLHF_TRAINER_METRICS_PORT"
"""Where the trainer driver (on the head) serves its Prometheus metrics."""
ENV_TRAINER_REPLICAS = "RLHF_TRAINER_REPLICAS"
"""Trainer replicas a Ray job submission trains with, when an elastic trainer runs on fewer
than roles.trainer.replicas (unset: all)."""
ENV_OBJECT_STORE_ACCESS_KEY_ID = "RLHF_OBJECT_STORE_ACCESS_KEY_ID"
ENV_OBJECT_STORE_SECRET_ACCESS_KEY = "RLHF_OBJECT_STORE_SECRET_ACCESS_KEY"
"""The checkpoint bucket's credentials in the head's container (where the driver uploads), from
the keys `OBJECT_STORE_SECRET_KEYS` of `checkpoint.objectStore.credentialsSecret`."""
OBJECT_STORE_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
"""The keys a checkpoint bucket's credentials Secret holds (the names S3 tools use)."""
KUBERAY_GROUP = "ray.io"
KUEUE_GROUP = "kueue.x-k8s.io"
"""Kueue's API group and label prefix: a job opts into queueing with its label
`kueue.x-k8s.io/queue-name` (`rlhfjob.contract.kueue`)."""
KUBERAY_ENV = (
    *("RAY_ADDRESS", "RAY_PORT", "RAY_IP", "FQ_RAY_IP"),
    *("RAY_CLUSTER_NAME", "RAY_CLUSTER_NAMESPACE", "RAY_CLOUD_INSTANCE_ID", "RAY_NODE_TYPE_NAME"),
    *("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "KUBERAY_GEN_RAY_START_CMD"),
    *("RAY_USAGE_STATS_KUBERAY_IN_USE", "RAY_USAGE_STATS_EXTRA_TAGS"),
    "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE",
)
"""What KubeRay (1.6) sets in every Ray container of a cluster like the operator's: the head's
address, the cluster's and pod's identity, the Ray token, its generated `ray start`."""
RESERVED_ENV = (
    ENV_JOB_NAME,
    ENV_JOB_NAMESPACE,
    ENV_ROLE,
    ENV_JOB_CONFIG,
    ENV_ATTEMPT,
    ENV_TRAINER_METRICS_PORT,
    ENV_TRAINER_REPLICAS,
    ENV_OBJECT_STORE_ACCESS_KEY_ID,
    ENV_OBJECT_STORE_SECRET_ACCESS_KEY,
    *KUBERAY_ENV,
)
RESERVED_KEY_DOMAINS = (GROUP, KUBERAY_GROUP, KUEUE_GROUP)
"""The operator's, KubeRay's and Kueue's label and annotation prefixes (`rlhf.dev/job`,
`ray.io/group`, `kueue.x-k8s.io/queue-name`): a job's pod labels and annotations stay out of them
and their subdomains (a queue label on a pod would have Kueue queue each pod on its own)."""
ENV_NAME_PATTERN = "^[-._a-zA-Z][-._a-zA-Z0-9]*$"
"""An environment variable's name as the pod API checks it (a C identifier, `.` and `-` too)."""
HTTP_URL_PATTERN = r"^https?://[^ \t\n\v\f\r/]+(/[^ \t\n\v\f\r]*)?$"
"""An http(s) URL: a host, then an optional path, no whitespace (the classes spelled out: `\\s`
means different things to Python and to the API server)."""
DNS_LABEL_PATTERN = f"^{_DNS_LABEL}$"


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{value}'" for value in values) + "]"


def _rule_error(rule: CelRule) -> PydanticCustomError:
    """The error of a broken rule, blaming the field it names as the API server does."""
    field = (rule.field_path or "").lstrip(".")
    return PydanticCustomError("cel_rule", "{message}", {"message": rule.message, "field": field})


def _checked(rules: tuple[CelRule, ...], schema: dict[str, Any] | None = None) -> AfterValidator:
    """An after-validator that evaluates a field's own CEL `rules` (those of its schema)."""

    def check(value: Any) -> Any:
        for rule in cel.broken(rules, value, schema):
            raise _rule_error(rule)
        return value

    return AfterValidator(check)


QUANTITY_SYNTAX = r"^[+-]?([0-9]+[.]?[0-9]*|[.][0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]{1,2})?$"
"""A quantity's syntax with an exponent of at most two digits. Checked before `isQuantity`,
which on the API server parses `1e-99999999` by working out the power of ten: one such job
held the server's CPU for minutes (found by the fuzzer)."""

QUANTITY_RULES = (
    CelRule(
        f"type(self) == int ? true"
        f" : (self.matches('{QUANTITY_SYNTAX}') ? isQuantity(self) : false)",
        "must be a Kubernetes quantity (for example 500m, 4, 16Gi)",
    ),
    CelRule("type(self) == int ? self >= 0 : !self.startsWith('-')", "must not be negative"),
)


QUANTITY_MAX_LENGTH = 64
"""Longer than any quantity; the bound keeps the CEL cost of a map of quantities (a pod's
extraResources) within the API server's budget."""


def _int_or_string(value: Any) -> Any:
    """Refuse other types here, so the error names the field (not a branch of the union)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise PydanticCustomError("int_or_string", "must be an integer or a string")
    if isinstance(value, str) and len(value) > QUANTITY_MAX_LENGTH:
        raise PydanticCustomError(
            "int_or_string", "may not be longer than {limit}", {"limit": QUANTITY_MAX_LENGTH}
        )
    return value


# A structural schema allows only this exact anyOf for int-or-string; the syntax check of the
# string form therefore is a CEL rule (isQuantity) rather than a pattern.
Quantity = Annotated[
    int | str,
    BeforeValidator(_int_or_string),
    _checked(QUANTITY_RULES),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "maxLength": QUANTITY_MAX_LENGTH,
            "x-kubernetes-validations": [rule.to_schema() for rule in QUANTITY_RULES],
        }
    ),
]
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]

LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]
LABEL_KEYS_RULE = CelRule(
    f"self.all(k, k.size() <= {MAX_QUALIFIED_NAME_LENGTH}"
    f" && k.matches('{QUALIFIED_NAME_PATTERN}'))",
    "every key must be a label key: [prefix/]name, the name 1-63 characters of [A-Za-z0-9_.-] "
    "starting and ending alphanumeric, the prefix a DNS subdomain",
)
# Keys of a map have no schema of their own, so their syntax is a CEL rule on the map; the
# bounds (entries, value length) keep the rule's cost estimate within the server's budget.


def _validations(rules: tuple[CelRule, ...]) -> dict[str, Any]:
    """The schema entry of a type's own CEL `rules` (those `_checked` evaluates)."""
    return {"x-kubernetes-validations": [rule.to_schema() for rule in rules]}


NodeSelector = Annotated[
    dict[str, LabelValue],
    Field(max_length=64, json_schema_extra=_validations((LABEL_KEYS_RULE,))),
    _checked((LABEL_KEYS_RULE,)),
]


def _open_object(
    properties: dict[str, dict[str, Any]], rules: tuple[CelRule, ...]
) -> dict[str, Any]:
    """The schema of a free-form object whose few declared `properties` CEL rules may read
    (the server hides undeclared fields from CEL)."""
    return {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "properties": properties,
        "x-kubernetes-validations": [rule.to_schema() for rule in rules],
    }


_RANDOM_INIT_RULES = (
    CelRule(
        "has(self.model_type) && self.model_type.size() > 0",
        "randomInit needs model_type (a Hugging Face model type, for example qwen2)",
        ".model_type",
    ),
)
_RANDOM_INIT_SCHEMA = _open_object(
    {"model_type": {"type": "string", "description": "The Hugging Face model type (qwen2)."}},
    _RANDOM_INIT_RULES,
)
RandomInitConfig = Annotated[
    dict[str, Any],
    _checked(_RANDOM_INIT_RULES, _RANDOM_INIT_SCHEMA),
    WithJsonSchema(_RANDOM_INIT_SCHEMA),
]

_VOLUME_RULES = (
    CelRule(
        "!has(self.name)",
        "leave out name: the operator names the checkpoint volume",
        ".name",
    ),
)
_VOLUME_SCHEMA = _open_object(
    {"name": {"type": "string", "description": "Not allowed: the operator names the volume."}},
    _VOLUME_RULES,
)


def _one_volume_source(value: dict[str, Any]) -> dict[str, Any]:
    # Not expressible in CEL: the server shows a rule only the declared properties.
    if len(value) > 1:
        raise ValueError(
            f"a volume has one source (for example persistentVolumeClaim), not {len(value)}: "
            + ", ".join(sorted(value))
        )
    return value


VolumeSource = Annotated[
    dict[str, Any],
    _checked(_VOLUME_RULES, _VOLUME_SCHEMA),
    AfterValidator(_one_volume_source),
    WithJsonSchema(_VOLUME_SCHEMA),
]


_CEL_SCHEMAS: dict[type, tuple[dict[str, Any], dict[str, Any]]] = {}


class ApiModel(BaseModel):
    """Base of every API object: camelCase on the wire, unknown fields rejected, CEL enforced."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        # As the API server types a job: "4" is no integer, 2.0 none either, and a file's .inf
        # or .nan (which JSON cannot carry) is no number.
        strict=True,
        allow_inf_nan=False,
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = ()
    """Cross-field rules of this object; evaluated here and copied into the CRD."""

    @classmethod
    def cel_schema(cls) -> tuple[dict[str, Any], dict[str, Any]]:
        """This object's JSON schema and its `$defs`: how a rule sees it (`cel.cel_view`)."""
        if cls not in _CEL_SCHEMAS:
            schema = cls.model_json_schema(by_alias=True, mode="validation")
            _CEL_SCHEMAS[cls] = (schema, schema.get("$defs", {}))
        return _CEL_SCHEMAS[cls]

    @model_validator(mode="after")
    def _check_cel_rules(self) -> ApiModel:
        if not any(not rule.is_transition for rule in self.cel_rules):
            return self
        wire = self.model_dump(by_alias=True, exclude_none=True, mode="json")
        schema, defs = self.cel_schema()
        for rule in cel.broken(self.cel_rules, wire, schema, defs):
            raise _rule_error(rule)
        return self

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core_schema)
        if cls.cel_rules:
            target = handler.resolve_ref_schema(schema)
            target["x-kubernetes-validations"] = [rule.to_schema() for rule in cls.cel_rules]
        return schema

    def wire(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase, no nulls."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# ---------------------------------------------------------------------------------------------
# What a job adds to its Ray pods


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

    model_config = ConfigDict(extra="allow")  # the source: one of some thirty kinds, passed on

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
        if not self.model_extra:
            raise ValueError("a volume needs a source (for example persistentVolumeClaim)")
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
        CelRule(
            "!has(self.subPath) || !self.subPath.matches('(^|/)[.][.](/|$)')",
            "subPath must not contain ..",
            ".subPath",
        ),
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
_ANNOTATIONS_RULES = (LABEL_KEYS_RULE, _reserved_keys_rule("annotations"))
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


# ---------------------------------------------------------------------------------------------
# Placement


class Toleration(ApiModel):
    """A Kubernetes toleration, so a role's pods may land on tainted GPU nodes."""

    key: str | None = Field(
        default=None,
        max_length=MAX_QUALIFIED_NAME_LENGTH,
        pattern=f"^(({_DNS_SUBDOMAIN}/)?{_LABEL_NAME})?$",
    )
    """The taint key it tolerates, a label key (empty with Exists: every taint)."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """Equal matches the taint's value; Exists any value."""
    value: LabelValue | None = None
    """The taint value for operator Equal (a label value)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """The taint effect it tolerates (empty: every effect)."""
    toleration_seconds: int | None = None
    """For NoExecute: seconds the pod stays bound after the taint appears (unset: for ever)."""

    cel_rules = (
        CelRule(
            "self.operator != 'Exists' || !has(self.value)",
            "value must be empty when operator is Exists",
            ".value",
        ),
        CelRule(
            "self.operator == 'Exists' || (has(self.key) && self.key.size() > 0)",
            "operator must be Exists when key is empty (that tolerates every taint)",
            ".operator",
        ),
        CelRule(
            "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            "tolerationSeconds needs effect NoExecute",
            ".tolerationSeconds",
        ),
    )


class RoleSpec(ApiModel):
    """One role's worker group: how many replicas, what each asks for, where it may run."""

    replicas: int = Field(default=1, ge=0, le=1024)
    """Ray worker pods for this role."""
    gpus: int = Field(default=0, ge=0, le=64)
    """GPUs per replica (`nvidia.com/gpu`), requested and limited alike."""
    cpu: Quantity = "4"
    """CPU cores per replica, requested and limited alike: a Kubernetes quantity (4, 500m)."""
    memory: Quantity = "16Gi"
    """Memory per replica, requested and limited alike: a Kubernetes quantity of bytes (16Gi,
    512Mi)."""
    node_selector: NodeSelector = Field(default_factory=dict)
    """Labels of the node pool this role runs on."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Tolerations for the pool's taints (GPU pools are usually tainted)."""
    affinity: FreeForm | None = None
    """A Kubernetes affinity, passed through unchanged."""
    pod: PodOverrides | None = None
    """What this role's pods add to spec.pods: environment, volumes, labels, resources."""

    placement_fields: ClassVar[tuple[str, ...]] = (
        "gpus",
        "cpu",
        "memory",
        "nodeSelector",
        "tolerations",
        "affinity",
        "pod",
    )


class TrainerRoleSpec(RoleSpec):
    """The DeepSpeed ZeRO-3 policy trainer: one rank (Ray actor) per GPU, or per replica on CPU.

    Elastic with `minReplicas`: when trainer pods are lost and not replaced within
    `replacementTimeoutSeconds`, training restarts from the newest checkpoint on the replicas
    left (the job is Degraded), and grows back to `replicas` at a checkpoint once they return.
    The global batch (rows per step) and the data position carry over: each rank takes more
    rows, so a step means the same thing on any number of ranks."""

    min_replicas: int | None = Field(default=None, ge=1)
    """Fewest replicas training may restart with; unset: `replicas` (not elastic, the job
    waits for every trainer pod)."""
    replacement_timeout_seconds: int = Field(default=300, ge=0, le=86400)
    """Seconds lost trainer pods may take to come back before an elastic trainer restarts on
    fewer replicas (0: at once)."""

    @property
    def effective_min_replicas(self) -> int:
        """`minReplicas` with its default applied."""
        return self.replicas if self.min_replicas is None else self.min_replicas

    cel_rules = (
        CelRule("self.replicas >= 1", "the trainer needs at least 1 replica", ".replicas"),
        CelRule(
            "!has(self.minReplicas) || self.minReplicas <= self.replicas",
            "minReplicas must not exceed replicas",
            ".minReplicas",
        ),
    )


class ElasticRoleSpec(RoleSpec):
    """A role that may run below its replica count while training goes on (rollout, reward)."""

    min_replicas: int | None = Field(default=None, ge=0)
    """Fewest replicas training may continue with; defaults to `replicas` (not elastic)."""

    @property
    def effective_min_replicas(self) -> int:
        """`minReplicas` with its default applied: the one place that default is spelt out."""
        return self.replicas if self.min_replicas is None else self.min_replicas

    cel_rules = (
        CelRule(
            "!has(self.minReplicas) || self.minReplicas <= self.replicas",
            "minReplicas must not exceed replicas",
            ".minReplicas",
        ),
        *(immutable(field) for field in RoleSpec.placement_fields),
    )


RolloutPlacement = Literal["disaggregated", "colocated"]
COLOCATED: RolloutPlacement = "colocated"


def _unless_colocated(rule: str) -> str:
    return f"self.placement != '{COLOCATED}' || ({rule})"


class RolloutRoleSpec(ElasticRoleSpec):
    """Rollout engines: each replica hosts `gpus / tensorParallelSize` engines (one on CPU).

    Colocated, the engines have no pods of their own: every trainer rank hosts one engine on
    its own GPU (or CPU), and the pod fields of this role stay unset.
    """

    placement: RolloutPlacement = "disaggregated"
    """`disaggregated`: engines on this role's own pods and node pool, weights sent over a
    process group after each update. `colocated`: each trainer rank hosts an engine on its own
    GPU (a hybrid engine); vLLM sleeps during the update, the trainer offloads its optimizer
    state during generation, and weights pass in-process. Colocated engines live and die with
    their rank, so the role is not elastic then."""
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    """GPUs one engine spans (vLLM's tensor parallelism)."""
    backend: Literal["vllm", "hf"] = "vllm"
    """`vllm` on GPUs; `hf` (transformers) for CPU runs and tests."""
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    """Fraction (above 0, at most 1) of each GPU's memory vLLM may claim (colocated: the share
    beside the trainer)."""
    sleep_level: int = Field(default=2, ge=1, le=2)
    """Colocated vLLM only: what the engine releases while the trainer updates. 1 moves its
    weights to host memory and frees the KV cache; 2 frees both (the update's new weights are
    loaded at wake-up anyway)."""

    cel_rules = (
        *ElasticRoleSpec.cel_rules,
        CelRule("self.replicas >= 1", "rollout needs at least 1 replica", ".replicas"),
        CelRule(
            "self.gpus % self.tensorParallelSize == 0",
            "gpus must be a multiple of tensorParallelSize",
            ".gpus",
        ),
        CelRule(
            f"self.backend != 'vllm' || self.placement == '{COLOCATED}' || self.gpus >= 1",
            "the vllm backend needs gpus >= 1 (use backend: hf on CPU)",
            ".backend",
        ),
        CelRule(
            _unless_colocated("!has(self.gpus) || self.gpus == 0"),
            "colocated engines run on the trainer's GPUs: leave roles.rollout.gpus at 0",
            ".gpus",
        ),
        CelRule(
            _unless_colocated(
                "(!has(self.replicas) || self.replicas == 1) && !has(self.minReplicas)"
            ),
            "colocated engines come one per trainer rank: leave replicas and minReplicas unset",
            ".replicas",
        ),
        CelRule(
            _unless_colocated(
                "(!has(self.nodeSelector) || size(self.nodeSelector) == 0)"
                " && (!has(self.tolerations) || size(self.tolerations) == 0)"
                " && !has(self.affinity) && !has(self.pod)"
            ),
            "colocated engines run in the trainer's pods: set nodeSelector, tolerations, "
            "affinity and pod on roles.trainer",
            ".placement",
        ),
        CelRule(
            _unless_colocated("!has(self.tensorParallelSize) || self.tensorParallelSize == 1"),
            "colocated engines span one GPU each for now (tensorParallelSize 1)",
            ".tensorParallelSize",
        ),
        immutable("placement"),
        immutable("tensorParallelSize"),
        immutable("backend"),
    )

    @property
    def colocated(self) -> bool:
        return self.placement == COLOCATED


def ray_resource(role: str) -> str:
    """The Ray custom resource a role's nodes advertise and its actors request (decision 3)."""
    return f"rlhf-role-{role}"


def actor_slots(spec: RoleSpec) -> int:
    """Actors one replica of a role hosts: one per GPU (rollout: one per engine), one on CPU."""
    if isinstance(spec, RolloutRoleSpec):
        return max(1, spec.gpus // spec.tensor_parallel_size)
    return max(1, spec.gpus)


ROLE_NAMES = ("trainer", "rollout", "reference", "reward", "critic")
"""Every role, in the order of their worker groups (manifests must be deterministic)."""


class Roles(ApiModel):
    """The worker groups: trainer and rollout are required, the others optional."""

    trainer: TrainerRoleSpec
    rollout: RolloutRoleSpec
    reference: RoleSpec | None = None
    """Frozen reference model for KL; without it the trainer computes reference log-probs."""
    reward: ElasticRoleSpec | None = None
    """Reward-model servers, for `reward.type: model`."""
    critic: RoleSpec | None = None
    """Value model for PPO."""

    cel_rules = (
        immutable("trainer"),
        immutable("reference"),
        immutable("critic"),
        CelRule(
            f"self.rollout.placement != '{COLOCATED}' || self.rollout.backend != 'vllm'"
            " || self.trainer.gpus >= 1",
            "colocated vllm engines need trainer GPUs (roles.trainer.gpus >= 1)",
            ".rollout.placement",
        ),
        CelRule(
            f"self.rollout.placement != '{COLOCATED}'"
            " || self.trainer.gpus % self.rollout.tensorParallelSize == 0",
            "colocated engines need roles.trainer.gpus to be a multiple of tensorParallelSize",
            ".rollout.tensorParallelSize",
        ),
        CelRule(
            f"self.rollout.placement != '{COLOCATED}' || !has(self.trainer.minReplicas)"
            " || self.trainer.minReplicas == self.trainer.replicas",
            "an elastic trainer (minReplicas below replicas) needs a disaggregated rollout:"
            " colocated engines live in the trainer's ranks",
            ".trainer.minReplicas",
        ),
    )

    def enabled(self) -> dict[str, RoleSpec]:
        """Roles that get a worker group, in a fixed order (manifests must be deterministic).

        A colocated rollout has none: its engines live in the trainer's pods.
        """
        roles: dict[str, RoleSpec | None] = {role: getattr(self, role) for role in ROLE_NAMES}
        if self.rollout.colocated:
            roles["rollout"] = None
        return {name: spec for name, spec in roles.items() if spec is not None}


class HeadSpec(ApiModel):
    """The Ray head: CPU only, it runs the driver and the dashboard."""

    cpu: Quantity = "2"
    """CPU cores of the head pod, requested and limited alike: a Kubernetes quantity."""
    memory: Quantity = "8Gi"
    """Memory of the head pod, requested and limited alike: a Kubernetes quantity of bytes."""
    node_selector: NodeSelector = Field(default_factory=dict)
    """Node labels the head pod must land on."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Taints the head pod tolerates."""
    pod: PodOverrides | None = None
    """What the head pod adds to spec.pods: environment, volumes, labels, resources."""

    cel_rules = (immutable("pod"),)


# ---------------------------------------------------------------------------------------------
# What to train


class ModelSpec(ApiModel):
    """Which weights each role starts from."""

    policy: str | None = Field(default=None, min_length=1)
    """Policy weights: a path in the image or on the checkpoint volume, or a model URI."""
    random_init: RandomInitConfig | None = None
    """A Hugging Face model config; the policy starts from random weights (smoke tests)."""
    reference: str | None = Field(default=None, min_length=1)
    """Reference weights; defaults to the policy's initial weights."""
    reward: str | None = Field(default=None, min_length=1)
    """Reward model (sequence classification head), for `reward.type: model`."""
    critic: str | None = Field(default=None, min_length=1)
    """Critic initial weights; defaults to the policy's (with a fresh value head)."""
    tokenizer: str | None = Field(default=None, min_length=1)
    """Tokenizer directory (Hugging Face format); defaults to the policy's directory when that
    holds one. Text and chat prompts, stopping at the end-of-sequence token and text rewards
    need it; a randomInit policy has none unless this is set."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Training and rollout dtype; CPU runs use float32 regardless."""

    cel_rules = (
        CelRule(
            "has(self.policy) != has(self.randomInit)",
            "set exactly one of policy and randomInit",
            ".policy",
        ),
    )


class AlgorithmSpec(ApiModel):
    """GRPO or PPO and their hyper-parameters."""

    name: Literal["grpo", "ppo"] = "grpo"
    """GRPO (group-relative advantages, no critic) or PPO (GAE over a critic's values)."""
    group_size: int = Field(default=8, ge=1, le=1024)
    """Responses sampled per prompt (GRPO normalises rewards within each group)."""
    prompts_per_step: int = Field(default=32, ge=1, le=65536)
    """Prompts per training step (rollout batch = promptsPerStep x groupSize)."""
    micro_batch_size: int = Field(default=4, ge=1, le=4096)
    """Sequences per forward/backward per trainer rank (gradient accumulation covers the rest)."""
    update_epochs: int = Field(default=1, ge=1, le=64)
    """Passes over each rollout batch."""
    total_steps: int | None = Field(default=None, ge=1, le=1_000_000_000)
    """Training steps (a rollout batch and its update each); set this or epochs."""
    epochs: int | None = Field(default=None, ge=1, le=1_000_000)
    """Passes over the prompt dataset; set this or totalSteps."""
    max_prompt_length: int = Field(default=512, ge=1, le=1048576)
    """Prompt tokens at most (after the chat template); see dataset.overlongPrompts."""
    max_response_length: int = Field(default=512, ge=1, le=1048576)
    """Generated tokens at most per response."""
    stop_at_eos: bool = True
    """End a response at the tokenizer's end-of-sequence token (kept as its last token; when the
    job has a tokenizer). Off: responses run to maxResponseLength unless stopTokenIds stop them."""
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=64)
    """More token ids that end a response (kept as its last token)."""
    stop_strings: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=16
    )
    """Text that ends a response: it ends with the token that completes the first occurrence
    (needs a tokenizer)."""
    temperature: float = Field(default=1.0, gt=0, le=10)
    """Sampling temperature of the rollout; the log-probs and entropy are of the tempered
    distribution."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling: sample from the smallest set of tokens holding this probability."""
    clip_range: float = Field(default=0.2, gt=0, le=10)
    """PPO ratio clipping epsilon: the new-to-old policy ratio is clipped to
    [1 - clipRange, 1 + clipRange]."""
    value_clip_range: float | None = Field(default=0.2, gt=0)
    """Critic value clipping (PPO): new values stay within this distance of the old ones;
    unset disables it."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL to the reference policy."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """How the KL is estimated per token: k1 (log-ratio) or k3 (the unbiased, positive one)."""
    kl_mode: Literal["reward", "loss"] = "loss"
    """Apply KL as a per-token reward penalty or as a loss term."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus in the policy loss."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """GAE discount (PPO)."""
    gae_lambda: float = Field(default=0.95, ge=0, le=1)
    """GAE lambda (PPO)."""
    scale_rewards: bool = True
    """GRPO: divide group-centred rewards by the group's standard deviation."""
    policy_learning_rate: float = Field(default=1e-6, gt=0, le=1)
    """Peak learning rate of the policy's optimizer (AdamW)."""
    critic_learning_rate: float = Field(default=5e-6, gt=0, le=1)
    """Peak learning rate of the critic's optimizer (PPO)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after the warm-up, over the run's optimizer steps."""
    warmup_steps: int = Field(default=0, ge=0, le=1_000_000_000)
    """Optimizer steps of linear warm-up from 0 to the peak learning rate."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradients are clipped to this global norm."""
    seed: int = Field(default=0, ge=0)
    """Seeds initialisation, the data order and sampling, so a resumed run repeats the
    uninterrupted one."""

    cel_rules = (
        CelRule(
            "has(self.totalSteps) != has(self.epochs)",
            "set exactly one of totalSteps and epochs",
            ".totalSteps",
        ),
        CelRule(
            "self.name != 'grpo' || self.groupSize >= 2",
            "grpo needs groupSize >= 2 (advantages are relative within a group)",
            ".groupSize",
        ),
        CelRule(
            "self.microBatchSize"
            " <= self.promptsPerStep * (self.name == 'grpo' ? self.groupSize : 1)",
            "microBatchSize must not exceed the sequences of a step (grpo: promptsPerStep x "
            "groupSize, ppo: promptsPerStep)",
            ".microBatchSize",
        ),
        CelRule(
            "!has(self.totalSteps) || self.warmupSteps < self.totalSteps * self.updateEpochs",
            "warmupSteps must be fewer than the run's optimizer steps (totalSteps x updateEpochs)",
            ".warmupSteps",
        ),
    )


class DatasetSpec(ApiModel):
    """Where prompts come from."""

    source: str = Field(min_length=1, max_length=4096)
    """A JSON-lines file, a Parquet file (`.parquet`) — a path in the image or on a volume —
    or `synthetic:<task>`."""
    prompt_field: str = Field(default="prompt", min_length=1)
    """The field of each record that holds the prompt: token ids, text, or chat messages (a list
    of {role, content} objects). Text and messages need a tokenizer (model.tokenizer)."""
    shuffle: bool = True
    """Serve the prompts in a new seeded order each epoch (a checkpoint keeps the position)."""
    chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template and its generation prompt.
    Off: a dataset with chat messages is refused at start."""
    overlong_prompts: Literal["truncate", "skip"] = "truncate"
    """A prompt longer than algorithm.maxPromptLength keeps its last maxPromptLength tokens
    (truncate) or is left out of the dataset (skip); both are counted at start."""

    cel_rules = (
        CelRule(
            "!self.source.startsWith('synthetic:')"
            " || self.source.matches('^synthetic:[A-Za-z0-9_-]+$')",
            "a synthetic source is synthetic:<task>, the task's name of [A-Za-z0-9_-]",
            ".source",
        ),
    )


class RemoteRewardSpec(ApiModel):
    """An HTTP reward server the trainer calls, batched, with timeouts and retries."""

    url: str = Field(pattern=HTTP_URL_PATTERN, max_length=2048)
    """The endpoint; requests are POSTed to this URL as is (for example
    `http://rm.team.svc:8000/classify`)."""
    protocol: Literal["rlhfjob", "classify"] = "rlhfjob"
    """`rlhfjob`: this project's JSON protocol (`{prompts, responses, metadata}` in, `{rewards}`
    out; docs/reward-protocol.md). `classify`: the classification API of vLLM and other
    OpenAI-compatible servers (`{model, input}` in, `{data: [{probs}]}` out) serving a
    sequence-classification reward model; the reward is the raw logit of label 0."""
    model: str | None = Field(default=None, min_length=1, max_length=512)
    """The model name sent with `classify` requests (a server serving one model ignores it)."""
    timeout_seconds: float = Field(default=30.0, gt=0, le=3600)
    """Seconds one request may take."""
    max_retries: int = Field(default=3, ge=0, le=100)
    """Retries of a request that timed out, could not connect or got a 5xx or 429; the step
    fails (retryably) once they are spent. A 4xx other than 429 fails the job at once."""
    backoff_seconds: float = Field(default=1.0, ge=0, le=600)
    """Seconds before the first retry; doubles with each retry."""
    max_concurrency: int = Field(default=4, ge=1, le=256)
    """Requests in flight at once."""
    batch_size: int = Field(default=64, ge=1, le=65536)
    """Samples (prompt and response pairs) per request."""


class RewardSourceSpec(ApiModel):
    """One way to score responses: a rule function, the reward-model role, or a remote server."""

    type: Literal["function", "model", "remote"] = "function"
    """`function`: a rule function; `model`: the reward-model role (roles.reward serving
    model.reward); `remote`: an HTTP reward server."""
    function: str | None = Field(default=None, pattern=REWARD_FUNCTION_PATTERN)
    """A rule reward as `module:function` importable in the trainer image."""
    remote: RemoteRewardSpec | None = None
    """The HTTP reward server, for `type: remote`."""

    cel_rules = (
        CelRule(
            "self.type != 'function' || has(self.__function__)",
            "type function needs function (module:function)",
            ".function",
        ),
        CelRule(
            "self.type != 'model' || !has(self.__function__)",
            "function must be empty when type is model",
            ".function",
        ),
        CelRule(
            "self.type != 'remote' || has(self.remote)",
            "type remote needs remote (url)",
            ".remote",
        ),
        CelRule(
            "self.type == 'remote' || !has(self.remote)",
            "remote must be empty unless type is remote",
            ".remote",
        ),
    )


class RewardComponentSpec(RewardSourceSpec):
    """One weighted part of a combined reward."""

    name: str | None = Field(
        default=None, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63
    )
    """Its label in metrics and the step log; defaults to its type. Labels that two components
    share get each component's position appended."""
    weight: float = Field(default=1.0, ge=-1000, le=1000)
    """Its factor in the sum."""


class RewardSpec(ApiModel):
    """How responses are scored: one source, or (`type: combined`) a weighted sum of several."""

    type: Literal["function", "model", "remote", "combined"] = "function"
    """`function`: a rule function; `model`: the reward-model role (roles.reward serving
    model.reward); `remote`: an HTTP reward server; `combined`: the weighted sum of
    `components`."""
    function: str | None = Field(default=None, pattern=REWARD_FUNCTION_PATTERN)
    """A rule reward as `module:function` importable in the trainer image."""
    remote: RemoteRewardSpec | None = None
    """The HTTP reward server, for `type: remote`."""
    components: list[RewardComponentSpec] = Field(default_factory=list, max_length=16)
    """The parts of a `combined` reward: reward = sum of weight x score."""
    normalize: bool = False
    """Standardise each source's scores over the step's batch (mean 0, std 1) before weighting,
    so weights compare sources of different scales."""
    batch_size: int = Field(default=32, ge=1, le=65536)
    """Samples (prompt and response pairs) per scoring call to a reward-model replica."""

    cel_rules = (
        *RewardSourceSpec.cel_rules[:3],
        CelRule(
            "self.type == 'remote' || !has(self.remote)",
            "remote must be empty unless type is remote",
            ".remote",
        ),
        CelRule(
            "self.type != 'combined' || (has(self.components) && size(self.components) >= 1)",
            "type combined needs components",
            ".components",
        ),
        CelRule(
            "self.type == 'combined' || !has(self.components) || size(self.components) == 0",
            "components must be empty unless type is combined",
            ".components",
        ),
        CelRule(
            "self.type != 'combined' || !has(self.__function__)",
            "function must be empty when type is combined (name it in a component)",
            ".function",
        ),
    )

    def sources(self) -> list[tuple[str, RewardSourceSpec, float]]:
        """``(name, source, weight)`` for each part: the components, or the spec itself."""
        if self.type != "combined":
            single = RewardSourceSpec(type=self.type, function=self.function, remote=self.remote)
            return [(self.type, single, 1.0)]
        labels = [component.name or component.type for component in self.components]
        named: list[tuple[str, RewardSourceSpec, float]] = []
        for index, component in enumerate(self.components):
            label = labels[index]
            if labels.count(label) > 1:  # two of a type (or one name given twice): add the position
                label = f"{label}-{index}"
            named.append((label, component, component.weight))
        return named

    def uses_model(self) -> bool:
        """Whether the reward-model role scores (alone or as a component)."""
        return any(source.type == "model" for _, source, _ in self.sources())


class ObjectStoreSpec(ApiModel):
    """An S3-compatible bucket, the durable tier of the job's checkpoints. Training waits only
    for the save to the checkpoint volume; the driver uploads complete checkpoints in the
    background, the manifest last, so a partial upload is never chosen. A cluster whose volume
    lacks the newest checkpoint (a new one, an empty volume) resumes from the bucket."""

    bucket: str = Field(min_length=3, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
    """The bucket's name; it must exist. Checkpoints go under
    `<prefix><namespace>/<job name>/step-<8 digits>/`."""
    prefix: str = Field(default="", max_length=512, pattern=r"^([^/].*/)?$")
    """Key prefix inside the bucket, ending in `/` (for example `team-a/`); empty: none."""
    endpoint: str | None = Field(default=None, max_length=2048, pattern=HTTP_URL_PATTERN)
    """The S3 API's URL (for example `https://s3.example.com`) for a store other than AWS;
    unset: AWS's endpoint for the region. Buckets are addressed path-style at an endpoint."""
    region: str | None = Field(default=None, max_length=64, pattern=r"^[a-z0-9-]+$")
    """The bucket's region (for example `us-east-1`); unset: the client's default."""
    credentials_secret: ObjectName | None = None
    """A Secret in the job's namespace with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY,
    given to the head's container only (the kubelet reads it; the operator never does). Unset:
    the pod's ambient credentials (a workload identity, an instance profile)."""
    interval_steps: int | None = Field(default=None, ge=1)
    """Upload every this many steps: a multiple of checkpoint.intervalSteps, so the volume takes
    frequent light saves and the bucket rarer ones. The last step's checkpoint and a drain's are
    always uploaded. Unset: every checkpoint."""
    keep_last: int | None = Field(default=None, ge=1, le=1000)
    """Complete checkpoints the trainer keeps in the bucket; it deletes older ones of this job
    (never anything else; the operator deletes none). Unset: checkpoint.keepLast."""


class CheckpointSpec(ApiModel):
    """Where and how often the trainer checkpoints; the operator never deletes checkpoints."""

    path: str = Field(default="/mnt/checkpoints", pattern=r"^/", max_length=4096)
    """Directory checkpoints are written under, mounted in every pod."""
    volume: VolumeSource | None = None
    """A Kubernetes volume source (for example a persistentVolumeClaim) mounted at path."""
    interval_steps: int = Field(default=50, ge=1)
    """Checkpoint every this many training steps (and at the last step and on SIGTERM)."""
    keep_last: int = Field(default=3, ge=1, le=1000)
    """Complete checkpoints the trainer keeps; older ones it removes (the operator never does)."""
    stop_grace_period_seconds: int = Field(default=600, ge=0, le=86400)
    """Seconds a training driver gets to finish its step and checkpoint it when the job's
    cluster is released while it trains (suspend, preemption): the operator asks it to stop,
    waits up to this long for it to exit, then releases the cluster anyway. 0: release at
    once; the job then resumes from its last interval checkpoint."""
    object_store: ObjectStoreSpec | None = None
    """An S3-compatible bucket checkpoints are also uploaded to, so they outlive the volume."""

    cel_rules = (
        _free_mount_path("path"),
        CelRule(
            "!has(self.objectStore) || !has(self.objectStore.intervalSteps)"
            " || self.objectStore.intervalSteps % self.intervalSteps == 0",
            "objectStore.intervalSteps must be a multiple of intervalSteps",
            ".objectStore.intervalSteps",
        ),
    )

    @property
    def upload_interval_steps(self) -> int | None:
        """Steps between uploads to the bucket; None without one."""
        store = self.object_store
        return None if store is None else (store.interval_steps or self.interval_steps)

    @property
    def bucket_keep_last(self) -> int | None:
        """Complete checkpoints kept in the bucket; None without one."""
        store = self.object_store
        return None if store is None else (store.keep_last or self.keep_last)


class RecoverySpec(ApiModel):
    """The recovery ladder's budget and pacing."""

    max_restarts: int = Field(default=3, ge=0, le=1000)
    """Restarts before the job is Failed (RestartsExhausted)."""
    backoff_seconds: int = Field(default=10, ge=0)
    """Seconds before the first restart; doubles with each restart, up to maxBackoffSeconds."""
    max_backoff_seconds: int = Field(default=300, ge=0)
    """Seconds at which the doubling restart delay stops growing."""
    restart_strategy: Literal["InPlaceFirst", "RecreateCluster"] = "InPlaceFirst"
    """InPlaceFirst climbs the ladder cheapest first; RecreateCluster always starts over."""
    cluster_recovery_timeout_seconds: int = Field(default=600, ge=1)
    """Seconds an unhealthy RayCluster (its head not ready, its dashboard silent) may take to
    heal before it is recreated."""

    cel_rules = (
        CelRule(
            "self.backoffSeconds <= self.maxBackoffSeconds",
            "backoffSeconds must not exceed maxBackoffSeconds",
            ".backoffSeconds",
        ),
    )


class LivenessSpec(ApiModel):
    """How the operator tells a hung or stalled trainer from a slow one."""

    heartbeat_interval_seconds: int = Field(default=10, ge=1)
    """Seconds between the trainer's renewals of its heartbeat Lease."""
    heartbeat_timeout_seconds: int = Field(default=60, ge=1)
    """Seconds without a heartbeat after which the trainer is hung (TrainerHung); also the
    Lease's duration."""
    progress_timeout_seconds: int = Field(default=1800, ge=1)
    """Seconds of heartbeats without a new step after which the trainer is stalled
    (TrainerStalled)."""

    cel_rules = (
        CelRule(
            "self.heartbeatTimeoutSeconds > self.heartbeatIntervalSeconds",
            "heartbeatTimeoutSeconds must exceed heartbeatIntervalSeconds",
            ".heartbeatTimeoutSeconds",
        ),
        CelRule(
            "self.progressTimeoutSeconds >= self.heartbeatTimeoutSeconds",
            "progressTimeoutSeconds must be at least heartbeatTimeoutSeconds",
            ".progressTimeoutSeconds",
        ),
    )


_USES_REWARD_MODEL = (
    "(self.reward.type == 'model' || (has(self.reward.components)"
    " && self.reward.components.exists(c, c.type == 'model')))"
)
_HAS_TOKENIZER = "(!has(self.model.randomInit) || has(self.model.tokenizer))"
"""Whether the job may have a tokenizer: a randomInit policy has one only when it is named (a
policy directory may hold one; only the trainer can look)."""


POD_PLACES = ("head", *(f"roles.{role}" for role in ROLE_NAMES))
"""Where, below spec, a `pod` of overrides may be: the head and each role."""
_MOUNT_LISTS = ("pods.volumeMounts", *(f"{place}.pod.volumeMounts" for place in POD_PLACES))


def _present(path: str) -> str:
    """CEL: every step of `path` below self is set."""
    parts = path.split(".")
    return " && ".join(f"has(self.{'.'.join(parts[: i + 1])})" for i in range(len(parts)))


def _mounts_name_a_volume(place: str) -> CelRule:
    mounts, own = f"{place}.pod.volumeMounts", f"{place}.pod.volumes"
    return CelRule(
        f"!({_present(mounts)}) || self.{mounts}.all(m,"
        f" ({_present('pods.volumes')} && self.pods.volumes.exists(v, v.name == m.name))"
        f" || ({_present(own)} && self.{own}.exists(v, v.name == m.name)))",
        "every volumeMount must name a volume of this pod or of spec.pods",
        f".{mounts}",
    )


def _mounts_avoid_the_checkpoint(mounts: str) -> CelRule:
    return CelRule(
        f"!({_present(mounts)}) || !has(self.checkpoint) || self.{mounts}.all(m,"
        " m.mountPath != self.checkpoint.path && m.mountPath != self.checkpoint.path + '/'"
        " && m.mountPath + '/' != self.checkpoint.path)",
        "no volumeMount may be at checkpoint.path, where the checkpoint volume is mounted",
        f".{mounts}",
    )


class RLHFJobSpec(ApiModel):
    """What to train, where, and how to keep it alive."""

    image: str = Field(min_length=1, max_length=4096, pattern=IMAGE_PATTERN)
    """Container image with the trainer (Ray, DeepSpeed, vLLM):
    `[registry[:port]/]path[:tag][@digest]`, the path lowercase."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Pull policy of the Ray pods' image."""
    entrypoint: str | None = Field(default=None, min_length=1, max_length=4096)
    """Ray job entrypoint instead of `rlhfjob train` (custom drivers, smoke tests). The operator
    appends `--resume-from latest` when it resumes."""
    service_account_name: str | None = Field(
        default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN
    )
    """ServiceAccount of the Ray pods, if the installation allows it (its job policy); it must
    be allowed to renew this job's heartbeat Lease. Unset: the job's own, which the operator
    creates."""
    pods: PodDefaults | None = None
    """What every Ray pod gets, the head's too (a role's or the head's own `pod` adds to it):
    environment, volumes, labels, resources; and the job's priority class, scheduler and image
    pull secrets."""
    model: ModelSpec
    algorithm: AlgorithmSpec
    dataset: DatasetSpec
    reward: RewardSpec
    roles: Roles
    head: HeadSpec = Field(default_factory=HeadSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    liveness: LivenessSpec = Field(default_factory=LivenessSpec)
    ray_version: str = Field(default="2.60.0", pattern=r"^[0-9]+[.][0-9]+[.][0-9]+$")
    """The Ray version of the image (KubeRay's rayVersion)."""
    suspend: bool = False
    """Stop training and release the cluster; checkpoints stay. Unset to resume."""
    active_deadline_seconds: int | None = Field(default=None, ge=1)
    """Seconds the job may run from its start (status.startTime) before it fails
    (DeadlineExceeded); unset: no deadline."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    """Seconds after it finished (status.completionTime) at which the RLHFJob is deleted, with
    what it owns (checkpoints stay); unset: it stays."""
    provisioning_timeout_seconds: int = Field(default=600, ge=1)
    """Seconds the RayCluster may take to become ready after it was created before the job
    fails (ProvisioningTimeout)."""

    cel_rules = (
        CelRule(
            "self.algorithm.name != 'ppo' || has(self.roles.critic)",
            "ppo needs roles.critic",
            ".roles",
        ),
        CelRule(
            f"!{_USES_REWARD_MODEL} || (has(self.roles.reward) && has(self.model.reward))",
            "reward.type model needs roles.reward and model.reward",
            ".reward",
        ),
        CelRule(
            f"!{_USES_REWARD_MODEL} || {_HAS_TOKENIZER}",
            "a reward model scores text, which needs a tokenizer: a randomInit policy has none, "
            "set model.tokenizer",
            ".model.tokenizer",
        ),
        CelRule(
            "!has(self.algorithm.stopStrings) || size(self.algorithm.stopStrings) == 0"
            f" || {_HAS_TOKENIZER}",
            "algorithm.stopStrings needs a tokenizer: a randomInit policy has none, "
            "set model.tokenizer",
            ".algorithm.stopStrings",
        ),
        *(
            immutable(field)
            for field in ("image", "pods", "model", "algorithm", "dataset", "reward", "checkpoint")
        ),
        *(_mounts_name_a_volume(place) for place in POD_PLACES),
        *(_mounts_avoid_the_checkpoint(mounts) for mounts in _MOUNT_LISTS),
    )

    def pod_places(self) -> dict[str, PodOverrides]:
        """The pod overrides the job sets, by field path (`spec.pods`, `spec.head.pod`,
        `spec.roles.trainer.pod`, ...): what the job policy checks."""
        places: dict[str, PodOverrides | None] = {"spec.pods": self.pods}
        for place in POD_PLACES:
            owner: Any = self
            for part in place.split("."):
                owner = getattr(owner, part) if owner is not None else None
            places[f"spec.{place}.pod"] = owner.pod if owner is not None else None
        return {path: pod for path, pod in places.items() if pod is not None}

    def pod_overrides(self, group: str) -> PodOverrides:
        """What the pods of `group` (``head`` or a role) get: their own over spec.pods."""
        owner: HeadSpec | RoleSpec | None = (
            self.head if group == "head" else getattr(self.roles, group)
        )
        assert owner is not None, f"no {group} in the job"
        return (self.pods or PodOverrides()).overlaid(owner.pod)


# ---------------------------------------------------------------------------------------------
# Status


class Phase(StrEnum):
    PENDING = "Pending"
    PROVISIONING = "Provisioning"
    RUNNING = "Running"
    RECOVERING = "Recovering"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"

    @property
    def terminal(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


class ConditionType(StrEnum):
    """The conditions the operator keeps on a job, one of each at most."""

    CLUSTER_READY = "ClusterReady"
    DASHBOARD_REACHABLE = "DashboardReachable"
    TRAINER_RUNNING = "TrainerRunning"
    HEALTHY = "Healthy"
    DEGRADED = "Degraded"
    DRAINING = "Draining"
    ADMITTED = "Admitted"
    SUSPENDED = "Suspended"
    COMPLETE = "Complete"
    FAILED = "Failed"


class Condition(ApiModel):
    """A Kubernetes-style condition: the latest observation of one aspect of the job."""

    model_config = ConfigDict(strict=False)  # timestamps arrive as text

    type: str = Field(
        max_length=316,
        description="What the condition is about: " + ", ".join(ConditionType) + ".",
    )
    status: Literal["True", "False", "Unknown"]
    """Whether it holds: True, False or Unknown."""
    reason: str = Field(default="", max_length=1024)
    """Why, in one CamelCase word (for example Ready, Unschedulable, TrainerHung)."""
    message: str = Field(default="", max_length=32768)
    """Why, for humans."""
    last_transition_time: datetime | None = None
    """When status last changed (RFC 3339)."""
    observed_generation: int | None = None
    """The job's metadata.generation when the condition was set."""


class CheckpointRef(ApiModel):
    """A complete checkpoint the trainer reported in its heartbeat."""

    model_config = ConfigDict(strict=False)  # timestamps arrive as text
    step: int
    """The training step it holds: a resumed run continues after it."""
    path: str
    """Its directory on the checkpoint volume."""
    time: datetime | None = None
    """When the operator first saw it reported (RFC 3339)."""


class Progress(ApiModel):
    """How fast the job trains and when it should end, from the trainer's heartbeat."""

    model_config = ConfigDict(strict=False)  # timestamps arrive as text

    steps_per_second: float | None = None
    """Training steps per second: a moving average over the steps the operator saw advance
    (time between attempts, a restart's, is left out)."""
    eta: datetime | None = None
    """When the last step should finish at that rate (RFC 3339)."""
    reward_mean: float | None = None
    """Mean reward of the last step the trainer reported."""
    tokens_per_second: float | None = None
    """Generation throughput of the last step's rollout, in tokens per second."""
    step_time: datetime | None = None
    """When the trainer reported status.currentStep: the next rate is measured from it."""


class RestartRecord(ApiModel):
    """One climb of the recovery ladder: why, from which checkpoint, and how fast."""

    model_config = ConfigDict(strict=False)  # timestamps arrive as text

    time: datetime
    """When the operator decided to restart (RFC 3339)."""
    reason: str
    """Why, as a restart reason: for example TrainerFailed, TrainerHung, HeadLost."""
    message: str = ""
    """What the operator saw, for humans."""
    resumed_from_step: int | None = None
    """The checkpoint's step the restart resumed from; unset: there was none (step 0)."""
    detection_seconds: float | None = None
    """Seconds from the trainer's last sign of life (its exit, its last heartbeat, the head's
    last Ready) to the operator's decision."""
    resumed_time: datetime | None = None
    """When the restarted trainer first finished a step past its checkpoint (RFC 3339)."""

    @property
    def failure_time(self) -> datetime:
        """When the failure happened, as far as the operator can tell."""
        return self.time - timedelta(seconds=self.detection_seconds or 0)


MAX_RESTART_HISTORY = 20


class RLHFJobStatus(ApiModel):
    """What the operator last observed. Written only by the operator."""

    model_config = ConfigDict(strict=False)  # timestamps arrive as text

    phase: Phase = Phase.PENDING
    """Pending: accepted, no cluster yet (or resuming after a suspend). Provisioning: the
    RayCluster is being created and its pods started. Running: the trainer runs. Recovering:
    a failure was detected and the job climbs the recovery ladder. Suspended: spec.suspend is
    set, the cluster is released, checkpoints stay. Succeeded and Failed are terminal: the
    cluster is released and the phase never changes again."""
    conditions: list[Condition] = Field(default_factory=list, max_length=32)
    """The latest observation of each aspect of the job, one entry per type."""
    observed_generation: int | None = None
    """The metadata.generation the operator last acted on; behind metadata.generation while a
    change of the spec is not applied yet."""
    current_step: int | None = None
    """The last training step the trainer finished (from its heartbeat)."""
    total_steps: int | None = None
    """Training steps of the whole run: spec.algorithm.totalSteps, or what the trainer computed
    from epochs."""
    last_checkpoint: CheckpointRef | None = None
    """The newest complete checkpoint; a restart resumes from it."""
    progress: Progress | None = None
    """Steps per second, the estimated end and the latest reward (from the heartbeat)."""
    trainer_replicas: int | None = None
    """Trainer replicas the running trainer trains with, when an elastic trainer runs below
    roles.trainer.replicas (the job is then Degraded); unset: all of them."""
    trainer_short_since: datetime | None = None
    """Since when fewer trainer pods than the trainer needs have been Ready (RFC 3339): an
    elastic trainer's replacement timeout counts from it."""
    resizes: int = 0
    """Times the trainer was restarted on a different number of replicas (not failures: they
    count against no restart budget)."""
    restart_count: int = 0
    """Restarts so far; the job fails (RestartsExhausted) when one more would exceed
    spec.recovery.maxRestarts."""
    restart_history: list[RestartRecord] = Field(
        default_factory=list, max_length=MAX_RESTART_HISTORY
    )
    """The most recent restarts, oldest first."""
    last_heartbeat_time: datetime | None = None
    """When the trainer last renewed its heartbeat Lease (RFC 3339)."""
    submission_id: str | None = None
    """The Ray job of the current attempt, once submitted."""
    ray_cluster_name: str | None = None
    """The RayCluster the operator created for the job."""
    dashboard_url: str | None = None
    """The Ray dashboard of the job's cluster; only the job's pods and the operator may reach
    it."""
    start_time: datetime | None = None
    """When the operator started the job: first created its RayCluster (RFC 3339)."""
    completion_time: datetime | None = None
    """When the job became Succeeded or Failed (RFC 3339)."""
    message: str = ""
    """What is happening, for humans."""


class ObjectMeta(BaseModel):
    """The parts of metadata the platform reads; the rest passes through untouched."""

    model_config = ConfigDict(
        extra="allow",
        populate_by_name=True,
        alias_generator=to_camel,
        use_attribute_docstrings=True,
    )

    name: str = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=NAME_PATTERN,
        description=f"The job's name: a DNS-1035 label of at most {MAX_NAME_LENGTH} characters, "
        "since it names the RayCluster and, with a suffix, every object made for the job.",
    )
    namespace: str = "default"
    """Where the job and everything made for it live."""
    uid: str | None = None
    """Set by the API server; the objects made for the job are owned through it."""
    generation: int | None = None
    """Set by the API server; counts changes of the spec."""
    labels: dict[str, str] = Field(default_factory=dict)
    """The job's own labels; the Ray pods do not inherit them."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """The job's own annotations."""


class RLHFJob(ApiModel):
    """A whole RLHFJob object as stored by the API server (or written in a file)."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["rlhf.dev/v1alpha1"] = API_VERSION  # type: ignore[assignment]
    """The API group and version."""
    kind: Literal["RLHFJob"] = KIND  # type: ignore[assignment]
    """The kind of object."""
    metadata: ObjectMeta
    spec: RLHFJobSpec
    status: RLHFJobStatus | None = None
