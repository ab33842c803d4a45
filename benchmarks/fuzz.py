"""Fuzzing the RLHFJob API with hypothesis: generated jobs, valid and hostile, through every layer.

    python benchmarks/fuzz.py [--cases 1000] [--seed 0] [--out benchmarks/results/fuzz.json]

A case starts from a valid job (an example in `examples/`, or the invalid-case table's base job)
and sets one field (`Case.field`) to a value hypothesis draws:

* a *hostile* value, invalid whatever the rest of the job says: out of bounds, bad syntax, the
  wrong type, a required field removed;
* an *arbitrary* value of the field's kind, which may break a rule that ties fields together
  (a micro-batch larger than a step) or not.

Properties (`check_case`, `check_decide`):

* a hostile value is refused by the models (`rlhfjob.config.parse_job`, what `rlhfjob validate`
  and the operator run) and by the generated CRD offline (`tests/crd_validator.py`, the API
  server's checks), each naming the field;
* whatever the value, the two agree: both accept the job, or both refuse it naming a common
  field;
* an accepted job builds (`rlhf_operator.builder.build_owned_objects`), and its RayCluster
  passes KubeRay's CRD schema when the local cluster's cache holds that CRD;
* `rlhf_operator.lifecycle.decide` returns a plan for an accepted job in any observed state
  (`observed_states`), and the status it plans passes the CRD's status schema.

The targets come from the generated CRD (every scalar and list-of-scalars field of `spec`) plus
the fields whose syntax lives in CEL (quantities, label maps, tolerations, the job's name). This
module is the fuzzer's library too: `tests/test_fuzz.py` runs it CI-sized and
`e2e/tests/test_fuzz_api.py` against a real API server.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

import re2
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the offline CRD validator lives with the tests
# Hypothesis keeps caches in ./.hypothesis by default: not in the repository.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "rlhfjob-hypothesis")

from crd_validator import validate, validate_object  # noqa: E402

from rlhf_operator import builder, names  # noqa: E402
from rlhf_operator.lifecycle import Plan, decide  # noqa: E402
from rlhf_operator.network import NetworkSettings  # noqa: E402
from rlhf_operator.views import (  # noqa: E402
    ClusterView,
    HeartbeatView,
    Observed,
    RayJobView,
    RoleView,
)
from rlhfjob import api, cel, crdgen  # noqa: E402
from rlhfjob.api import RLHFJob  # noqa: E402
from rlhfjob.config import InvalidJobError, parse_job  # noqa: E402
from rlhfjob.contract import EngineCount  # noqa: E402
from rlhfjob.valid_cases import valid_job  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "fuzz.json"
JOB_UID = "00000000-0000-4000-8000-00000000f022"
"""Given to accepted jobs before building, so the owned objects carry owner references."""
RAY_TOKEN = "fuzz-token"
OPERATOR_NAMESPACE = "rlhfjob-system"

# ---------------------------------------------------------------------------------------------
# The jobs a case starts from, and the schema


@cache
def crd() -> dict[str, Any]:
    return crdgen.build_crd()


def root_schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@cache
def bases() -> tuple[tuple[str, str], ...]:
    """(name, JSON text) of every valid job a case may start from."""
    found = [("valid_job", valid_job("fuzz"))]
    for path in sorted((REPO / "examples").glob("*.yaml")):
        document = yaml.safe_load(path.read_text())
        document["metadata"] = {"name": "fuzz"}
        found.append((path.stem, document))
    return tuple((name, json.dumps(document)) for name, document in found)


@cache
def kuberay_crd() -> dict[str, Any] | None:
    """KubeRay's RayCluster CRD from the local cluster's binary cache, if it was ever built."""
    try:
        from rlhf_local.paths import cache_dir
    except ImportError:
        return None
    paths = sorted((cache_dir() / "bin").glob("kuberay-*/crds/ray.io_rayclusters.yaml"))
    if not paths:
        return None
    return yaml.load(paths[-1].read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


# ---------------------------------------------------------------------------------------------
# Targets: a field, how to set it, and what to draw for it

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class Target:
    """One field a case may set: where, the blame for a hostile value, and the two strategies."""

    field: str
    """The field every layer must name for a hostile value (`spec.algorithm.groupSize`)."""
    path: Path_
    """Where the value goes in the job document."""
    hostile: st.SearchStrategy[Any] | None
    arbitrary: st.SearchStrategy[Any]
    also: tuple[tuple[Path_, Any], ...] = ()
    """Other fields set with it (`policy` removed with `randomInit` set)."""
    hostile_field: Callable[[Any], str] | None = None
    """The blamed field when it depends on the value drawn (a label map's bad value)."""


_DELETE = object()
"""Drawn for a field to remove it (required fields: hostile; optional ones: arbitrary)."""

_WRONG_TYPES: dict[str, list[Any]] = {
    "integer": ["7", 1.5, True],
    "number": ["0.5", True],
    "boolean": ["true", 1],
    "string": [5, True],
    "array": ["x", {"a": 1}],
}


def _text(max_size: int = 24) -> st.SearchStrategy[str]:
    return st.text(max_size=max_size)


def _matches(pattern: str, value: str) -> bool:
    """Whether the API server's regular expressions (Go's RE2) match."""
    return re2.search(pattern, value) is not None


def _string_strategies(schema: dict[str, Any]) -> tuple[st.SearchStrategy[Any], list[Any]]:
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    pattern, enum = schema.get("pattern"), schema.get("enum")

    def fits(value: str) -> bool:
        return low <= len(value) <= (high if high is not None else len(value)) and (
            pattern is None or _matches(pattern, value)
        )

    if enum:
        arbitrary: st.SearchStrategy[Any] = st.sampled_from(enum)
        hostile = [_text().filter(lambda v: v not in enum)]
        return arbitrary, hostile
    draws = [_text(max_size=min(high or 40, 40))]
    hostile: list[Any] = []
    if pattern:
        draws.append(st.from_regex(pattern, fullmatch=True))
        # Random text rarely matches a pattern, and a match with a space around it seldom does.
        hostile.append(_text().filter(lambda v: not fits(v)))
        hostile.append(
            st.from_regex(pattern, fullmatch=True)
            .flatmap(lambda v: st.sampled_from([f"{v} ", f" {v}", f"{v}\n", f"{v}\t"]))
            .filter(lambda v: not fits(v))
        )
    if low:
        hostile.append(st.just(""))
    if high is not None:
        hostile.append(st.integers(high + 1, high + 40).map(lambda n: "a" * n))
    return st.one_of(*draws), hostile


def _number_strategies(
    schema: dict[str, Any], integer: bool
) -> tuple[st.SearchStrategy[Any], list[Any]]:
    low, high = schema.get("minimum"), schema.get("maximum")
    exclusive_low = bool(schema.get("exclusiveMinimum"))
    exclusive_high = bool(schema.get("exclusiveMaximum"))
    hostile: list[Any] = []
    if integer:
        lo = -(2**40) if low is None else int(low) + (1 if exclusive_low else 0)
        hi = 2**40 if high is None else int(high) - (1 if exclusive_high else 0)
        arbitrary: st.SearchStrategy[Any] = st.one_of(
            st.integers(lo, min(hi, lo + 16)), st.integers(lo, hi)
        )
        if low is not None:
            hostile.append(st.integers(lo - 1000, lo - 1))
        if high is not None:
            hostile.append(st.integers(hi + 1, hi + 1000))
        return arbitrary, hostile
    arbitrary = st.floats(
        min_value=low,
        max_value=high,
        exclude_min=exclusive_low and low is not None,
        exclude_max=exclusive_high and high is not None,
        allow_nan=False,
        allow_infinity=False,
    )
    if low is not None:
        hostile.append(st.floats(1e-3, 1e3).map(lambda d: low - d))
        if exclusive_low:
            hostile.append(st.just(low))
    if high is not None:
        hostile.append(st.floats(1e-3, 1e3).map(lambda d: high + d))
        if exclusive_high:
            hostile.append(st.just(high))
    return arbitrary, hostile


def _scalar_strategies(schema: dict[str, Any]) -> tuple[st.SearchStrategy[Any], list[Any]]:
    """(arbitrary, hostile strategies) for a scalar schema node."""
    kind = schema.get("type")
    if kind == "string":
        arbitrary, hostile = _string_strategies(schema)
    elif kind in ("integer", "number"):
        arbitrary, hostile = _number_strategies(schema, integer=kind == "integer")
    elif kind == "boolean":
        arbitrary, hostile = st.booleans(), []
    else:
        raise ValueError(f"not a scalar schema: {schema}")
    hostile.append(st.sampled_from(_WRONG_TYPES[kind]))
    return arbitrary, hostile


def _schema_targets(
    node: dict[str, Any], path: tuple[str, ...], required: bool
) -> Iterator[Target]:
    """A target for every scalar and list-of-scalars field under `node` (a structural schema)."""
    name = ".".join(path)
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        if required and len(path) > 1:
            yield Target(name, path, st.just(_DELETE), st.just(_DELETE))
        for key, child in node["properties"].items():
            yield from _schema_targets(child, (*path, key), key in node.get("required", ()))
        return
    if node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-int-or-string"):
        return  # free-form objects and quantities: hand-written targets
    if node.get("type") == "object":
        return  # maps: hand-written targets
    if node.get("type") == "array":
        items = node.get("items", {})
        if "properties" in items:
            return  # lists of objects: hand-written targets (tolerations)
        item_arbitrary, item_hostile = _scalar_strategies(items)
        max_items = node.get("maxItems")
        hostile = [st.one_of(*item_hostile).map(lambda v: [v])]
        if max_items is not None:
            hostile.append(st.lists(item_arbitrary, min_size=max_items + 1, max_size=max_items + 1))
        hostile.append(st.sampled_from(_WRONG_TYPES["array"]))

        def item_blame(value: Any, name: str = name, items: dict[str, Any] = items) -> str:
            if isinstance(value, list) and len(value) == 1 and validate(items, value[0]):
                return f"{name}[0]"
            return name

        yield Target(
            name,
            path,
            st.one_of(*hostile),
            st.one_of(st.lists(item_arbitrary, max_size=3), st.just(_DELETE)),
            hostile_field=item_blame,
        )
        return
    arbitrary, hostile = _scalar_strategies(node)
    if required:
        hostile.append(st.just(_DELETE))
    else:
        arbitrary = st.one_of(arbitrary, st.just(_DELETE))
    yield Target(name, path, st.one_of(*hostile), arbitrary)


# Syntax that lives in CEL rules or needs a value of a certain shape.

_QUANTITY = st.one_of(
    st.integers(0, 10**6),
    st.from_regex(cel.QUANTITY_PATTERN, fullmatch=True).filter(lambda v: not v.startswith("-")),
    st.sampled_from(["500m", "4", "0.5", "16Gi", "1e3", "100Ki", "2E"]),
)
_BAD_QUANTITY = st.one_of(
    _text().filter(lambda v: not re2.fullmatch(cel.QUANTITY_PATTERN, v)),
    st.integers(-(10**6), -1),
    st.sampled_from(["-1", "-500m", "1.2.3", "16GB", "16Gii", "1e", "4 ", " 4", "", 1.5, True]),
)
_LABEL_KEY = st.from_regex(api.QUALIFIED_NAME_PATTERN, fullmatch=True).filter(
    lambda v: len(v) <= api.MAX_QUALIFIED_NAME_LENGTH
)
_BAD_LABEL_KEY = st.one_of(
    _text().filter(lambda v: not _valid_label_key(v)),
    st.sampled_from(["", "a b", "-a", "a-", "Example.com/a", "a/b/c", "x" * 64, "/a", "a/"]),
)
_LABEL_VALUE = st.from_regex(api.LABEL_VALUE_PATTERN, fullmatch=True).filter(lambda v: len(v) <= 63)
_BAD_LABEL_VALUE = st.one_of(
    _text().filter(lambda v: not _valid_label_value(v)),
    st.sampled_from(["-a", "a-", "a b", "x" * 64, "ä"]),
)


def _valid_label_key(value: str) -> bool:
    return len(value) <= api.MAX_QUALIFIED_NAME_LENGTH and _matches(
        api.QUALIFIED_NAME_PATTERN, value
    )


def _valid_label_value(value: str) -> bool:
    return len(value) <= 63 and _matches(api.LABEL_VALUE_PATTERN, value)


def _node_selector_targets(path: tuple[str, ...]) -> Iterator[Target]:
    name = ".".join(path)
    arbitrary = st.dictionaries(
        st.one_of(_LABEL_KEY, _text(8)), st.one_of(_LABEL_VALUE, _text(8)), max_size=3
    )
    yield Target(
        name,
        path,
        st.tuples(_BAD_LABEL_KEY, _LABEL_VALUE).map(lambda kv: {kv[0]: kv[1]}),
        arbitrary,
    )
    yield Target(
        name,
        path,
        st.tuples(_LABEL_KEY, _BAD_LABEL_VALUE).map(lambda kv: {kv[0]: kv[1]}),
        arbitrary,
        hostile_field=lambda value: f"{name}.{next(iter(value))}",
    )


_TOLERATION_KEY = st.one_of(_LABEL_KEY, st.just("nvidia.com/gpu"))
_TOLERATION = st.one_of(
    st.fixed_dictionaries(
        {"key": _TOLERATION_KEY, "operator": st.just("Exists")},
        optional={"effect": st.sampled_from(["NoSchedule", "PreferNoSchedule"])},
    ),
    st.fixed_dictionaries(
        {"key": _TOLERATION_KEY, "operator": st.just("Equal"), "value": _LABEL_VALUE},
        optional={"effect": st.sampled_from(["NoSchedule", "PreferNoSchedule", "NoExecute"])},
    ),
    st.fixed_dictionaries(
        {"key": _TOLERATION_KEY, "effect": st.just("NoExecute")},
        optional={"tolerationSeconds": st.integers(-10, 10**6), "value": _LABEL_VALUE},
    ),
    st.just({"operator": "Exists"}),
)
"""Valid tolerations; every hostile one below changes one field of one of these."""
_HOSTILE_TOLERATION_FIELDS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "key": _BAD_LABEL_KEY.filter(bool).map(lambda v: {"key": v, "operator": "Exists"}),
    "value": _BAD_LABEL_VALUE.map(lambda v: {"key": "pool", "value": v}),
    "operator": st.one_of(
        _text()
        .filter(lambda v: v not in ("Exists", "Equal"))
        .map(lambda v: {"key": "pool", "operator": v}),
        _LABEL_VALUE.map(lambda v: {"operator": "Equal", "value": v}),
    ),
    "effect": _text()
    .filter(lambda v: v not in ("NoSchedule", "PreferNoSchedule", "NoExecute"))
    .map(lambda v: {"key": "pool", "operator": "Exists", "effect": v}),
    "tolerationSeconds": st.one_of(
        st.integers(0, 600).map(
            lambda s: {"key": "pool", "effect": "NoSchedule", "tolerationSeconds": s}
        ),
        st.just({"key": "pool", "effect": "NoExecute", "tolerationSeconds": "60"}),
    ),
}


def _toleration_targets(path: tuple[str, ...]) -> Iterator[Target]:
    name = ".".join(path)
    arbitrary = st.lists(_TOLERATION, max_size=2)
    for key, hostile in _HOSTILE_TOLERATION_FIELDS.items():
        yield Target(f"{name}[0].{key}", path, hostile.map(lambda t: [t]), arbitrary)


def _quantity_target(path: tuple[str, ...]) -> Target:
    return Target(".".join(path), path, _BAD_QUANTITY, _QUANTITY)


_NAME = st.one_of(
    st.from_regex(api.NAME_PATTERN, fullmatch=True).filter(lambda v: len(v) <= 63),
    _text(8),
)
_BAD_NAME = st.one_of(
    _text(60).filter(
        lambda v: not (len(v) <= api.MAX_NAME_LENGTH and _matches(api.NAME_PATTERN, v))
    ),
    st.integers(api.MAX_NAME_LENGTH + 1, 63).map(lambda n: "a" * n),
    st.sampled_from(["my.job", "1-job", "MyJob", "job-", "-job", "job_1"]),
)


# Rules that tie a field to another, to the model or to a name the trainer must have (issue 28).

_SEGMENT = st.from_regex(r"[a-z0-9_-]{1,8}", fullmatch=True)


def _path_with_a_bad_segment(absolute: bool) -> st.SearchStrategy[str]:
    """A path with a `.`, `..` or empty segment somewhere (a clean path otherwise)."""
    parts = st.tuples(
        st.lists(_SEGMENT, max_size=3),
        st.sampled_from([".", "..", ""]),
        st.lists(_SEGMENT, max_size=3),
        st.booleans(),  # a trailing slash
    )
    return parts.map(
        lambda p: ("/" if absolute else "") + "/".join([*p[0], p[1], *p[2]]) + ("/" if p[3] else "")
    ).filter(lambda v: re2.search(cel.UNCLEAN_PATH, v) is not None)


def _clean_path(absolute: bool) -> st.SearchStrategy[str]:
    return st.lists(_SEGMENT, min_size=1, max_size=4).map(
        lambda parts: ("/" if absolute else "") + "/".join(parts)
    )


_A_VOLUME = ((("spec", "pods", "volumes"), [{"name": "fuzz-data", "emptyDir": {}}]),)


def _mount(**fields: Any) -> list[dict[str, Any]]:
    return [{"name": "fuzz-data", **fields}]


def _path_targets() -> Iterator[Target]:
    """Paths compared as strings must be clean: the checkpoint's, a bucket prefix, mounts."""
    yield Target(
        "spec.checkpoint.path",
        ("spec", "checkpoint", "path"),
        _path_with_a_bad_segment(absolute=True),
        _clean_path(absolute=True).map(lambda v: "/mnt" + v),
    )
    yield Target(
        "spec.checkpoint.objectStore.prefix",
        ("spec", "checkpoint", "objectStore"),
        _path_with_a_bad_segment(absolute=False)
        .filter(lambda v: not v.startswith("/"))
        .map(lambda v: {"bucket": "fuzz-bucket", "prefix": v if v.endswith("/") else v + "/"}),
        _clean_path(absolute=False).map(lambda v: {"bucket": "fuzz-bucket", "prefix": v + "/"}),
    )
    yield Target(
        "spec.pods.volumeMounts[0].mountPath",
        ("spec", "pods", "volumeMounts"),
        _path_with_a_bad_segment(absolute=True)
        .filter(lambda v: len(v) >= 2)
        .map(lambda v: _mount(mountPath="/data" + v)),
        _clean_path(absolute=True).map(lambda v: _mount(mountPath="/data" + v)),
        also=_A_VOLUME,
    )
    yield Target(
        "spec.pods.volumeMounts[0].subPath",
        ("spec", "pods", "volumeMounts"),
        _path_with_a_bad_segment(absolute=False)
        .filter(lambda v: not v.startswith("/"))
        .map(lambda v: _mount(mountPath="/data/fuzz", subPath=v)),
        _clean_path(absolute=False).map(lambda v: _mount(mountPath="/data/fuzz", subPath=v)),
        also=_A_VOLUME,
    )


def _context_window_target() -> Target:
    """Prompt plus response beyond a `randomInit` model's window: the response length is blamed.
    Every base asks for at least 16 tokens, so a window below that is too small for any."""
    model = st.fixed_dictionaries(
        {"model_type": st.sampled_from(["llama", "qwen2", "gpt2"]), "vocab_size": st.just(16)}
    )
    window = st.sampled_from(api.CONTEXT_WINDOW_KEYS)

    def random_init(window_size: st.SearchStrategy[int]) -> st.SearchStrategy[dict[str, Any]]:
        return st.tuples(model, window, window_size).map(lambda t: {**t[0], t[1]: t[2]})

    return Target(
        "spec.algorithm.maxResponseLength",
        ("spec", "model", "randomInit"),
        random_init(st.integers(1, 15)),
        random_init(st.integers(1, 10**6)),
        also=((("spec", "model", "policy"), _DELETE),),
    )


def _synthetic_task_target() -> Target:
    """A synthetic task must be one the trainer has (`api.SYNTHETIC_TASKS`)."""
    return Target(
        "spec.dataset.source",
        ("spec", "dataset", "source"),
        _text(16).filter(lambda v: v not in api.SYNTHETIC_TASKS).map(lambda v: f"synthetic:{v}"),
        st.sampled_from(api.SYNTHETIC_TASKS).map(lambda v: f"synthetic:{v}"),
    )


_NODE_SELECTOR_TERM = st.fixed_dictionaries(
    {
        "matchExpressions": st.lists(
            st.fixed_dictionaries(
                {
                    "key": _LABEL_KEY,
                    "operator": st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist"]),
                },
                optional={"values": st.lists(_LABEL_VALUE, max_size=2)},
            ),
            max_size=2,
        )
    }
)
_AFFINITY = st.fixed_dictionaries(
    {
        "nodeAffinity": st.fixed_dictionaries(
            {
                "requiredDuringSchedulingIgnoredDuringExecution": st.fixed_dictionaries(
                    {"nodeSelectorTerms": st.lists(_NODE_SELECTOR_TERM, min_size=1, max_size=2)}
                )
            }
        )
    }
)
_REQUIRED_TERMS = "nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"


def _affinity_with(change: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A valid affinity broken one way: a misspelt field, a wrong type, a required one gone."""

    def broken(affinity: dict[str, Any]) -> dict[str, Any]:
        terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        if change == "misspelt":
            terms["nodeSelectorTerm"] = terms["nodeSelectorTerms"]
        elif change == "type":
            terms["nodeSelectorTerms"] = "pool=gpu"
        else:
            del terms["nodeSelectorTerms"]
        return affinity

    return broken


def _affinity_targets(path: tuple[str, ...]) -> Iterator[Target]:
    """A Kubernetes affinity, checked against Kubernetes' own schema (`rlhfjob.api.kubeschema`)."""
    name = ".".join(path)
    blamed = {
        "misspelt": "nodeSelectorTerm",
        "type": "nodeSelectorTerms",
        "gone": "nodeSelectorTerms",
    }
    for change, field_ in blamed.items():
        yield Target(
            f"{name}.{_REQUIRED_TERMS}.{field_}",
            path,
            _AFFINITY.map(_affinity_with(change)),
            _AFFINITY,
        )


_VOLUME_SOURCES = st.sampled_from(
    [
        {"persistentVolumeClaim": {"claimName": "ckpt"}},
        {"nfs": {"server": "nfs.local", "path": "/exports", "readOnly": False}},
        {"emptyDir": {"sizeLimit": "10Gi"}},
        {"csi": {"driver": "fuse.example.com", "volumeAttributes": {"bucket": "ckpt"}}},
    ]
)
_BROKEN_VOLUME_SOURCES = {
    "persistentVolumeClaim.claimname": {"persistentVolumeClaim": {"claimname": "ckpt"}},
    "nfs.server": {"nfs": {"path": "/exports"}},
    "nfs.readOnly": {"nfs": {"server": "nfs.local", "path": "/exports", "readOnly": "yes"}},
    "emptyDir.sizeLimit": {"emptyDir": {"sizeLimit": "lots"}},
    "csi.volumeAttributes.bucket": {"csi": {"driver": "d", "volumeAttributes": {"bucket": 1}}},
}
"""Volume sources broken one way each (a misspelt or missing field, a wrong type, a size that
is no quantity), by the field to blame."""


def _volume_source_targets() -> Iterator[Target]:
    """The checkpoint volume's source, checked against Kubernetes' own schema
    (`rlhfjob.api.kubeschema`)."""
    path = ("spec", "checkpoint", "volume")
    for blamed, source in _BROKEN_VOLUME_SOURCES.items():
        yield Target(f"{'.'.join(path)}.{blamed}", path, st.just(source), _VOLUME_SOURCES)


@cache
def targets() -> tuple[Target, ...]:
    """Every field a case may set."""
    spec = root_schema()["properties"]["spec"]
    found = list(_schema_targets(spec, ("spec",), required=True))
    found.append(Target("metadata.name", ("metadata", "name"), _BAD_NAME, _NAME))
    roles = [("spec", "roles", role) for role in spec["properties"]["roles"]["properties"]]
    for parent in [*roles, ("spec", "head")]:
        found.append(_quantity_target((*parent, "cpu")))
        found.append(_quantity_target((*parent, "memory")))
    # Every role shares these types: three places are enough, and keep the mix balanced.
    for parent in [("spec", "roles", "trainer"), ("spec", "roles", "rollout"), ("spec", "head")]:
        found.extend(_node_selector_targets((*parent, "nodeSelector")))
        found.extend(_toleration_targets((*parent, "tolerations")))
    for role in ("trainer", "rollout"):
        found.extend(_affinity_targets(("spec", "roles", role, "affinity")))
    found.append(
        Target(
            "spec.model.randomInit.model_type",
            ("spec", "model", "randomInit"),
            st.sampled_from([{"hidden_size": 32}, {"model_type": ""}, {"model_type": 5}]),
            st.just({"model_type": "llama", "vocab_size": 16, "hidden_size": 32}),
            also=((("spec", "model", "policy"), _DELETE),),
        )
    )
    found.extend(_volume_source_targets())
    found.extend(_path_targets())
    found.append(_context_window_target())
    found.append(_synthetic_task_target())
    return tuple(found)


# ---------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    base: str
    target: str
    """The field set (for a hostile value: the field every layer must name)."""
    value: Any
    hostile: bool
    document: dict[str, Any] = field(repr=False, compare=False)
    template: str = ""
    """The target's field as catalogued (`target` may add a map key)."""

    def describe(self) -> str:
        kind = "hostile" if self.hostile else "arbitrary"
        value = "<removed>" if self.value is _DELETE else json.dumps(self.value)[:120]
        return f"{self.base}: {kind} {self.target} = {value}"


def _set(document: dict[str, Any], path: Path_, value: Any) -> None:
    node: Any = document
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if value is _DELETE:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


@st.composite
def cases(draw: st.DrawFn, hostile: bool | None = None) -> Case:
    """A job one field away from a valid one; `hostile` None draws both kinds."""
    base, text = draw(st.sampled_from(bases()))
    target = draw(st.sampled_from(targets()))
    if hostile is None:
        hostile = draw(st.sampled_from([True, False]))
    hostile = hostile and target.hostile is not None
    strategy = target.hostile if hostile and target.hostile is not None else target.arbitrary
    value = draw(strategy)
    document = json.loads(text)
    _set(document, target.path, value)
    for path, other in target.also:
        _set(document, path, other)
    blamed = target.field
    if hostile and target.hostile_field is not None:
        blamed = target.hostile_field(value)
    return Case(base, blamed, value, hostile, document, target.field)


# ---------------------------------------------------------------------------------------------
# Properties


class PropertyError(AssertionError):
    """A layer disagreed with another, or with what the case requires."""


@dataclass
class Verdict:
    accepted: bool
    model_fields: set[str]
    crd_fields: set[str]
    job: RLHFJob | None = None


def _fields(problems: list[str]) -> set[str]:
    return {line.split(":", 1)[0] for line in problems}


SECONDS: Counter[str] = Counter()
"""Time spent in each layer (models, crd, build, decide), for the benchmark."""


def _timed(layer: str, started: float) -> None:
    SECONDS[layer] += time.perf_counter() - started


def judge(case: Case) -> Verdict:
    """What the models and the generated CRD make of the case's job (no property checked)."""
    started = time.perf_counter()
    try:
        job: RLHFJob | None = parse_job(case.document, source=case.describe())
        model_problems: list[str] = []
    except InvalidJobError as error:
        job, model_problems = None, error.problems
    _timed("models", started)
    started = time.perf_counter()
    crd_problems = validate_object(crd(), case.document)
    _timed("crd", started)
    return Verdict(job is not None, _fields(model_problems), _fields(crd_problems), job)


def check_case(case: Case) -> Verdict:
    """The offline layers judge the case alike, name a hostile field; an accepted job builds."""
    verdict = judge(case)
    models_accept = verdict.job is not None
    crd_accepts = not verdict.crd_fields
    if models_accept != crd_accepts:
        raise PropertyError(
            f"{case.describe()}: the models {'accept' if models_accept else 'refuse'} it "
            f"({sorted(verdict.model_fields)}), the CRD {'accepts' if crd_accepts else 'refuses'}"
            f" it ({sorted(verdict.crd_fields)})"
        )
    if case.hostile:
        for layer, named in (("models", verdict.model_fields), ("CRD", verdict.crd_fields)):
            if case.target not in named:
                raise PropertyError(
                    f"{case.describe()}: the {layer} do not name {case.target}: {sorted(named)}"
                )
    elif not models_accept and not verdict.model_fields & verdict.crd_fields:
        raise PropertyError(
            f"{case.describe()}: refused for different fields: models "
            f"{sorted(verdict.model_fields)}, CRD {sorted(verdict.crd_fields)}"
        )
    if verdict.job is not None:
        check_build(verdict.job)
    return verdict


def owned_objects(job: RLHFJob, namespace: str | None = None) -> list[dict[str, Any]]:
    """What the operator applies for `job`, as if read from the API server (it has a uid), in
    `namespace` (default: the job's)."""
    stored = job.model_copy(deep=True)
    stored.metadata.uid = JOB_UID
    if namespace is not None:
        stored.metadata.namespace = namespace
    return builder.build_owned_objects(stored, RAY_TOKEN, NetworkSettings(OPERATOR_NAMESPACE))


def ray_cluster(job: RLHFJob, namespace: str | None = None) -> dict[str, Any]:
    return next(o for o in owned_objects(job, namespace) if o["kind"] == "RayCluster")


def check_build(job: RLHFJob) -> None:
    """An accepted job builds, and its RayCluster passes KubeRay's CRD (when at hand)."""
    started = time.perf_counter()
    objects = owned_objects(job)
    for manifest in objects:
        name = manifest["metadata"]["name"]
        if len(name) > 63:
            raise PropertyError(f"{manifest['kind']} name longer than 63: {name}")
    cluster = next(o for o in objects if o["kind"] == "RayCluster")
    schema = kuberay_crd()
    errors = validate_object(schema, cluster) if schema is not None else []
    _timed("build", started)
    if errors:
        raise PropertyError(f"{job.metadata.name}: KubeRay's CRD refuses the RayCluster: {errors}")


# ---------------------------------------------------------------------------------------------
# Observed states for lifecycle.decide

T0 = datetime(2026, 1, 1, tzinfo=UTC)
_SECONDS = st.integers(0, 200_000)
_TIMES = _SECONDS.map(lambda s: T0 + timedelta(seconds=s))
_MAYBE_TIME = st.none() | _TIMES
_MESSAGES = st.one_of(_text(60), st.integers(1000, 40_000).map(lambda n: "m" * n))
"""Messages of errors and Ray jobs, some far longer than a status may hold."""
_CONDITION_TYPES = [
    "ClusterReady",
    "TrainerRunning",
    "DashboardReachable",
    "Healthy",
    "Suspended",
    "Degraded",
    "Ready",
]


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


_STATUS = st.fixed_dictionaries(
    {},
    optional={
        "phase": st.sampled_from([phase.value for phase in api.Phase]),
        "restartCount": st.integers(0, 6),
        "startTime": _TIMES.map(_iso),
        "completionTime": _TIMES.map(_iso),
        "lastHeartbeatTime": _TIMES.map(_iso),
        "submissionId": _text(12),
        "currentStep": st.integers(0, 100),
        "totalSteps": st.integers(0, 100),
        "message": _text(40),
        "lastCheckpoint": st.fixed_dictionaries({"step": st.integers(0, 100), "path": _text(20)}),
        "conditions": st.lists(
            st.fixed_dictionaries(
                {
                    "type": st.sampled_from(_CONDITION_TYPES),
                    "status": st.sampled_from(["True", "False", "Unknown"]),
                },
                optional={"lastTransitionTime": _TIMES.map(_iso), "reason": _text(10)},
            ),
            max_size=6,
            unique_by=lambda c: c["type"],
        ),
        "restartHistory": st.lists(
            st.fixed_dictionaries(
                {
                    "time": _TIMES.map(_iso),
                    "reason": st.sampled_from(["TrainerHung", "TrainerFailed"]),
                },
                optional={
                    "resumedFromStep": st.integers(0, 50),
                    "detectionSeconds": st.floats(0, 100),
                },
            ),
            max_size=api.MAX_RESTART_HISTORY,
        ),
    },
)


@st.composite
def observed_states(draw: st.DrawFn, job: RLHFJob) -> Observed:
    """What the reconciler could see for `job`: any status, cluster, Ray job and heartbeat."""
    document = job.model_dump(by_alias=True, mode="json", exclude_none=True)
    document["metadata"].update(uid=JOB_UID, generation=draw(st.integers(1, 3)))
    status = draw(st.none() | _STATUS)
    if status is not None:
        document["status"] = status
    seen_job = RLHFJob.model_validate(document)
    attempts = [names.submission_id(seen_job, attempt) for attempt in range(4)]
    roles = list(seen_job.spec.roles.enabled())
    cluster = st.builds(
        ClusterView,
        name=st.just(names.ray_cluster_name(seen_job)),
        created=_TIMES,
        ready=st.booleans(),
        deleting=st.booleans(),
        dashboard=st.none() | st.just("http://head:8265"),
        head_not_ready_since=_MAYBE_TIME,
        head_created=_MAYBE_TIME,
        roles=st.dictionaries(
            st.sampled_from(roles),
            st.builds(RoleView, st.integers(0, 4), st.integers(0, 4)),
            max_size=len(roles),
        ),
    )
    ray_job = st.builds(
        RayJobView,
        submission_id=st.sampled_from(attempts) | _text(12),
        status=st.sampled_from(["PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED"]),
        message=_MESSAGES,
        exit_code=st.none() | st.integers(-9, 255),
        ended=_MAYBE_TIME,
    )
    counts = st.none() | st.builds(EngineCount, st.integers(0, 8), st.integers(0, 8))
    heartbeat = st.builds(
        HeartbeatView,
        renewed=_TIMES,
        step=st.none() | st.integers(0, 100),
        step_changed=_MAYBE_TIME,
        total_steps=st.none() | st.integers(0, 100),
        phase=st.none() | st.sampled_from(["generate", "update", "checkpoint"]),
        checkpoint_step=st.none() | st.integers(0, 100),
        checkpoint_path=st.none() | _text(20),
        attempt=st.none() | st.integers(0, 5),
        rollout_engines=counts,
        reward_models=counts,
        checkpoint_requested_at=_MAYBE_TIME,
        checkpoint_saved_step=st.none() | st.integers(0, 100),
    )
    return Observed(
        job=seen_job,
        now=draw(_TIMES),
        created=draw(_TIMES),
        cluster=draw(st.none() | cluster),
        ray_job=draw(st.none() | ray_job),
        previous_ray_job=draw(st.none() | ray_job),
        dashboard_error=draw(st.none() | _MESSAGES),
        heartbeat=draw(st.none() | heartbeat),
        scheduling_problem=draw(st.none() | _MESSAGES),
        submit_error=draw(st.none() | _MESSAGES),
    )


def check_decide(seen: Observed) -> Plan:
    """`decide` plans for any observed state, and the status it plans passes the CRD."""
    started = time.perf_counter()
    plan = decide(seen)
    status_schema = root_schema()["properties"]["status"]
    errors = validate(status_schema, plan.status.wire(), "status")
    _timed("decide", started)
    if errors:
        raise PropertyError(f"decide planned a status the CRD refuses: {errors[:3]}")
    return plan


# ---------------------------------------------------------------------------------------------
# The benchmark


@dataclass
class Tally:
    cases: int = 0
    hostile: int = 0
    arbitrary: int = 0
    valid: int = 0
    invalid: int = 0
    decided: int = 0
    crashes: int = 0
    disagreements: int = 0
    fields: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def failed(self, case: Case, error: BaseException, crash: bool) -> None:
        if crash:
            self.crashes += 1
            detail = "".join(traceback.format_exception_only(type(error), error)).strip()
            self.failures.append(f"crash: {case.describe()}: {detail}"[:600])
        else:
            self.disagreements += 1
            self.failures.append(str(error)[:600])


def _one(tally: Tally, case: Case, data: st.DataObject) -> None:
    """Check one case (and, accepted, one observed state of it); count it once it is through."""
    try:
        verdict = check_case(case)
    except PropertyError as error:
        tally.failed(case, error, crash=False)
        verdict = None
    except Exception as error:  # a layer raised instead of judging
        tally.failed(case, error, crash=True)
        verdict = None
    decided = False
    if verdict is not None and verdict.job is not None:
        seen = data.draw(observed_states(verdict.job))  # may end the example (too much data)
        try:
            check_decide(seen)
            decided = True
        except PropertyError as error:
            tally.failed(case, error, crash=False)
        except Exception as error:
            tally.failed(case, error, crash=True)
    tally.cases += 1
    tally.hostile += case.hostile
    tally.arbitrary += not case.hostile
    tally.fields[case.template] += 1
    if verdict is not None:
        tally.valid += verdict.accepted
        tally.invalid += not verdict.accepted
    tally.decided += decided


def run(cases_wanted: int, seed: int) -> dict[str, Any]:
    """`cases_wanted` cases, half of them hostile."""
    tally = Tally()
    SECONDS.clear()
    started = time.perf_counter()
    for hostile, wanted in ((True, cases_wanted // 2), (False, cases_wanted - cases_wanted // 2)):

        @hypothesis_seed(seed)
        @settings(
            max_examples=wanted,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=cases(hostile=hostile), data=st.data())
        def one(case: Case, data: st.DataObject) -> None:
            _one(tally, case, data)

        one()
    seconds = time.perf_counter() - started
    command = f"python benchmarks/fuzz.py --cases {cases_wanted} --seed {seed}"
    return {
        "benchmark": "fuzz",
        "command": command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "seed": seed,
        "cases": tally.cases,
        "crashes": tally.crashes,
        "disagreements": tally.disagreements,
        "hostile": tally.hostile,
        "arbitrary": tally.arbitrary,
        "valid": tally.valid,
        "invalid": tally.invalid,
        "decide_states": tally.decided,
        "fields": len(tally.fields),
        "cases_by_field": _kinds(tally),
        "targets": len(targets()),
        "bases": [name for name, _ in bases()],
        "kuberay_crd_checked": kuberay_crd() is not None,
        "seconds": round(seconds, 1),
        "ms_per_case": round(1000 * seconds / max(tally.cases, 1), 1),
        "ms_per_case_by_layer": {
            layer: round(1000 * spent / max(tally.cases, 1), 1)
            for layer, spent in sorted(SECONDS.items())
        },
        "note": (
            "models: rlhfjob.config.parse_job; crd: tests/crd_validator.py on the generated CRD; "
            "build: build_owned_objects and KubeRay's CRD; decide: lifecycle.decide and the "
            "status schema. The rest is hypothesis drawing the cases. CEL results are remembered "
            "(rlhfjob.cel.broken), so a case costs what its changed field costs."
        ),
        "failures": tally.failures[:20],
    }


def _kinds(tally: Tally) -> dict[str, int]:
    """Cases per kind of field (the last part of its path, map keys and indices dropped)."""
    kinds: Counter[str] = Counter()
    for name, count in tally.fields.items():
        kinds[name.split("[")[0].rsplit(".", 1)[-1]] += count
    return dict(kinds.most_common(12))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = run(args.cases, args.seed)
    text = json.dumps(result, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    return 1 if result["crashes"] or result["disagreements"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
