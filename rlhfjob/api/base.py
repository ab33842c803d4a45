"""Names, patterns and limits of the API, the Ray container's reserved environment, and the
helpers every model uses: CEL rules checked in Python, int-or-string, free-form objects, `ApiModel`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

from rlhfjob import cel
from rlhfjob.api import kubeschema
from rlhfjob.cel import CelRule

GROUP = "rlhf.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLHFJob"
PLURAL = "rlhfjobs"
SINGULAR = "rlhfjob"
SHORT_NAMES = ["rlhf"]
DERIVED_NAME_SUFFIXES = (
    "-config",
    "-trainer",
    "-heartbeat",
    "-ray-auth",
    "-ray-head",
    "-head-api",
    "-head-svc",
)
"""What is appended to a job's name to name the objects made for it: its ConfigMap,
ServiceAccount, heartbeat Role, Ray token Secret and NetworkPolicies (`rlhf_operator.names`), and
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


MAX_SPEC_BYTES = 128 * 1024
"""The most a job's spec may take as JSON (128 KiB; examples take 1-5 KiB). The operator parses
a spec at every change, writes it into the job's ConfigMap and its pod overrides into every
Ray group of the RayCluster: a spec of megabytes would stall the operator for every tenant and
bring the RayCluster near etcd's limit on an object (1.5 MiB)."""
MAX_RANDOM_INIT_BYTES = 64 * 1024
"""The most `model.randomInit` may take as JSON (64 KiB; a Hugging Face config is 1-2 KiB)."""


def json_size(value: Any) -> int | None:
    """Bytes of `value` as compact JSON, as the API server stores it; None where it cannot be
    written (nested deeper than Python's recursion limit: no spec is)."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
    except (RecursionError, ValueError):
        return None
    return len(text.encode())


def size_error(field: str, value: Any, limit: int, what: str) -> PydanticCustomError | None:
    """The refusal of `value` (the field `field`, empty for the node itself) when it takes more
    than `limit` bytes as JSON; `what` says what it usually holds."""
    size = json_size(value)
    if size is not None and size <= limit:
        return None
    taken = "is nested too deeply" if size is None else f"takes {size} bytes as JSON"
    return _problems_error([(field, f"{taken}, more than the {limit} allowed ({what})")])


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{value}'" for value in values) + "]"


def _problems_error(problems: list[tuple[str, str]]) -> PydanticCustomError:
    """One error for every (field, message) problem of a node, each blaming its field, as the
    API server reports them all. Pydantic takes one error from a validator, so the first is the
    error and the others ride in its context (`also`); `rlhfjob.config.describe_errors` writes
    a line for each."""
    (field, message), *others = [(field.lstrip("."), message) for field, message in problems]
    return PydanticCustomError(
        "cel_rule", "{message}", {"message": message, "field": field, "also": others}
    )


def _rule_error(rules: list[CelRule]) -> PydanticCustomError:
    """The error of a node's broken rules, each blaming the field it names."""
    return _problems_error([(rule.field_path or "", rule.message) for rule in rules])


def _checked(rules: tuple[CelRule, ...], schema: dict[str, Any] | None = None) -> AfterValidator:
    """An after-validator that evaluates a field's own CEL `rules` (those of its schema)."""

    def check(value: Any) -> Any:
        if broken := cel.broken(rules, value, schema):
            raise _rule_error(broken)
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

_AFFINITY_SCHEMA = kubeschema.load_schema(kubeschema.AFFINITY_PATH)


def _check_affinity(value: dict[str, Any]) -> dict[str, Any]:
    if problems := kubeschema.schema_problems(_AFFINITY_SCHEMA, value):
        raise _problems_error(problems)
    return value


Affinity = Annotated[
    dict[str, Any], WithJsonSchema(_AFFINITY_SCHEMA), AfterValidator(_check_affinity)
]
"""A Kubernetes affinity, checked against Kubernetes' own schema (`rlhfjob.api.kubeschema`)."""

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
CONTEXT_WINDOW_KEYS = ("max_position_embeddings", "n_positions")
"""Where a transformers config keeps its context window (most model types; GPT-2 and its kin)."""
_RANDOM_INIT_SCHEMA = _open_object(
    {
        "model_type": {"type": "string", "description": "The Hugging Face model type (qwen2)."},
        **{
            key: {
                "type": "integer",
                "description": "The context window: maxPromptLength + maxResponseLength must fit.",
            }
            for key in CONTEXT_WINDOW_KEYS
        },
    },
    _RANDOM_INIT_RULES,
)


def _bounded_random_init(value: Any) -> Any:
    """Refuse a `randomInit` above `MAX_RANDOM_INIT_BYTES` before anything reads it."""
    if isinstance(value, dict) and (
        error := size_error("", value, MAX_RANDOM_INIT_BYTES, "a Hugging Face config is 1-2 KiB")
    ):
        raise error
    return value


RandomInitConfig = Annotated[
    dict[str, Any],
    BeforeValidator(_bounded_random_init),
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
VOLUME_SOURCES_SCHEMA = kubeschema.load_schema(kubeschema.VOLUME_SOURCES_PATH)
"""Kubernetes' own schemas of the volume sources an installation allows by default."""
_VOLUME_SCHEMA = _open_object(
    {
        "name": {"type": "string", "description": "Not allowed: the operator names the volume."},
        **VOLUME_SOURCES_SCHEMA["properties"],
    },
    _VOLUME_RULES,
)


def _one_volume_source(value: dict[str, Any]) -> dict[str, Any]:
    """A volume's sources: exactly one Kubernetes volume source, an object, of Kubernetes' own
    schema where the API knows its type. Anything less reaches the pod as a volume without a
    source, which Kubernetes makes an empty directory (`kubeschema.KUBERNETES_VOLUME_SOURCES`)."""
    # Not expressible in CEL: the server shows a rule only the declared properties.
    if not value:
        raise ValueError("a volume needs a source (for example persistentVolumeClaim)")
    if len(value) > 1:
        raise ValueError(
            f"a volume has one source (for example persistentVolumeClaim), not {len(value)}: "
            + ", ".join(sorted(value))
        )
    ((kind, source),) = value.items()
    if kind not in kubeschema.KUBERNETES_VOLUME_SOURCES:
        raise ValueError(
            f"a volume needs a source: {kind!r} is no Kubernetes volume source (for example "
            "persistentVolumeClaim, nfs, csi, emptyDir)"
        )
    if not isinstance(source, dict):
        raise _problems_error([(f".{kind}", "must be an object: the volume source's fields")])
    if problems := kubeschema.schema_problems(VOLUME_SOURCES_SCHEMA, value):
        raise _problems_error(problems)
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
        if broken := cel.broken(self.cel_rules, wire, schema, defs):
            raise _rule_error(broken)
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
