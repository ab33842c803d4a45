"""The generated CRD: fresh, structural, and enforcing the same rules as the models."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from crd_validator import validate_object

from rlhfjob import cel, crdgen
from rlhfjob.invalid_cases import INVALID_CASES, MODEL_ONLY_CASES
from rlhfjob.valid_cases import valid_job

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return crdgen.build_crd()


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crds_are_fresh() -> None:
    assert crdgen.main(["check"]) == 0, "crds/ is stale: run `task crds` and commit the result"


def test_generation_is_deterministic() -> None:
    assert crdgen.render_crd() == crdgen.render_crd()


def _walk(node: Any, path: str = ""):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{path}/{index}")


def test_schema_is_structural(crd: dict[str, Any]) -> None:
    for path, node in _walk(_schema(crd)):
        assert "$ref" not in node, path
        assert "$defs" not in node, path
        assert node.get("additionalProperties") is not False, path
        assert not isinstance(node.get("exclusiveMinimum"), int | float) or isinstance(
            node.get("exclusiveMinimum"), bool
        ), path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, f"{path}: only int-or-string"


def test_every_property_has_a_type(crd: dict[str, Any]) -> None:
    for path, node in _walk(_schema(crd)):
        if path.rsplit("/", 2)[-2:-1] == ["properties"]:
            assert "type" in node or node.get("x-kubernetes-int-or-string"), path


DOCUMENTED_BY_KUBERNETES = {"/properties/apiVersion", "/properties/kind", "/properties/metadata"}
"""The API server publishes every CRD with TypeMeta's `apiVersion` and `kind` and ObjectMeta's
`metadata` (descriptions included) in place of the schema's own, so `kubectl explain` shows
Kubernetes' descriptions there, whatever the CRD says."""


def test_kubectl_explain_documents_every_field(crd: dict[str, Any]) -> None:
    undocumented = [
        path
        for path, node in _walk(_schema(crd))
        if path.rsplit("/", 2)[-2:-1] == ["properties"]
        and not node.get("description")
        and not any(path.startswith(exempt) for exempt in DOCUMENTED_BY_KUBERNETES)
    ]
    assert not undocumented, f"fields without a description: {undocumented}"


def test_descriptions_state_scalar_defaults(crd: dict[str, Any]) -> None:
    spec = _schema(crd)["properties"]["spec"]["properties"]
    trainer = spec["roles"]["properties"]["trainer"]["properties"]
    assert trainer["memory"]["description"].endswith(" Default: 16Gi.")
    assert spec["suspend"]["description"].endswith(" Default: false.")
    assert spec["liveness"]["properties"]["heartbeatTimeoutSeconds"]["description"].endswith(
        " Default: 60."
    )
    assert "Default:" not in spec["head"]["description"], "a section's fields say it"
    assert "Default:" not in spec["activeDeadlineSeconds"]["description"], "no default: unset"


def test_optional_fields_are_nullable_and_quantities_int_or_string(crd: dict[str, Any]) -> None:
    spec = _schema(crd)["properties"]["spec"]["properties"]
    assert spec["activeDeadlineSeconds"]["nullable"] is True
    trainer = spec["roles"]["properties"]["trainer"]["properties"]
    assert trainer["cpu"]["x-kubernetes-int-or-string"] is True
    # An affinity carries Kubernetes' own schema (rlhfjob.api.kubeschema), not a free-form object.
    affinity = trainer["affinity"]
    assert "x-kubernetes-preserve-unknown-fields" not in affinity
    required = affinity["properties"]["nodeAffinity"]["properties"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert required["required"] == ["nodeSelectorTerms"]
    # Nested defaults only apply when the parent exists, so defaulted parents are spelled out.
    assert spec["liveness"]["default"]["heartbeatTimeoutSeconds"] == 60


def test_the_embedded_kubernetes_schemas_are_fresh() -> None:
    """`rlhfjob/api/kubernetes-*.json` are what the pinned Kubernetes client gives."""
    from rlhfjob import kubegen

    for path, text in kubegen.generate().items():
        assert path.read_text() == text, f"{path.name}: run `task crds`"


def test_the_volume_sources_the_models_know_are_the_pinned_clients() -> None:
    """A volume must have exactly one of them (`base._one_volume_source`)."""
    from kubernetes.client import V1Volume

    from rlhfjob.api.kubeschema import KUBERNETES_VOLUME_SOURCES

    fields = V1Volume.model_json_schema(by_alias=True)["properties"]
    assert set(KUBERNETES_VOLUME_SOURCES) == set(fields) - {"name"}


def test_volumes_carry_the_schema_of_the_sources_an_installation_allows(
    crd: dict[str, Any],
) -> None:
    from rlhfjob.api.kubeschema import VOLUME_SOURCES

    spec = _schema(crd)["properties"]["spec"]["properties"]
    for volume in (
        spec["checkpoint"]["properties"]["volume"],
        spec["pods"]["properties"]["volumes"]["items"],
    ):
        assert set(VOLUME_SOURCES) < set(volume["properties"])
        assert volume["x-kubernetes-preserve-unknown-fields"] is True  # others: the policy's
        claim = volume["properties"]["persistentVolumeClaim"]
        assert claim["required"] == ["claimName"]
        size = volume["properties"]["emptyDir"]["properties"]["sizeLimit"]
        assert size["x-kubernetes-int-or-string"] is True and size["maxLength"] == 64


def test_status_subresource_and_printer_columns(crd: dict[str, Any]) -> None:
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    names = [column["name"] for column in version["additionalPrinterColumns"]]
    assert names[:5] == ["Phase", "Step", "Total", "Restarts", "Checkpoint"]
    assert names[-1] == "Age"
    status = _schema(crd)["properties"]["status"]["properties"]
    for column in version["additionalPrinterColumns"]:
        root, *rest = column["jsonPath"].lstrip(".").split(".")
        if root == "status":
            node = {"properties": status}
            for part in rest:
                node = node["properties"][part]


def test_transition_rules_make_running_fields_immutable(crd: dict[str, Any]) -> None:
    spec = _schema(crd)["properties"]["spec"]
    rules = {entry["rule"] for entry in spec["x-kubernetes-validations"]}
    for field in ("model", "algorithm", "dataset", "image"):
        assert any(f"self.{field} == oldSelf.{field}" in rule for rule in rules), field
    rollout = spec["properties"]["roles"]["properties"]["rollout"]
    rollout_rules = " ".join(e["rule"] for e in rollout["x-kubernetes-validations"])
    assert "oldSelf.gpus" in rollout_rules
    assert "oldSelf.replicas" not in rollout_rules, "rollout replicas must stay elastic"


@pytest.mark.parametrize(
    ("old", "new", "allowed"),
    [
        ({"pods": {"a": 1}}, {"pods": {"a": 1}}, True),
        ({}, {}, True),
        ({"pods": {"a": 1}}, {"pods": {"a": 2}}, False),
        ({"pods": {"a": 1}}, {}, False),  # removed, to be set again in a second step
        ({}, {"pods": {"a": 1}}, False),  # set after creation
    ],
)
def test_an_immutable_field_can_be_neither_changed_nor_removed_nor_added(
    old: dict[str, Any], new: dict[str, Any], allowed: bool
) -> None:
    rule = cel.immutable("pods").rule
    program = celpy.Environment().program(celpy.Environment().compile(rule))
    activation = {"self": celpy.json_to_cel(new), "oldSelf": celpy.json_to_cel(old)}
    assert bool(program.evaluate(activation)) is allowed


@pytest.mark.parametrize("case", INVALID_CASES, ids=lambda case: case.id)
def test_crd_rejects_invalid_job_naming_the_field(crd: dict[str, Any], case) -> None:
    errors = validate_object(crd, case.job())
    blamed = [line for line in errors if line.startswith(f"{case.field}:")]
    assert blamed, f"expected an error on {case.field}, got {errors}"
    if case.rule_message:
        assert case.rule_message in blamed[0]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_crd_accepts_examples(crd: dict[str, Any], path: Path) -> None:
    assert validate_object(crd, yaml.safe_load(path.read_text())) == []


def test_crd_accepts_the_base_valid_job(crd: dict[str, Any]) -> None:
    assert validate_object(crd, valid_job()) == []


@pytest.mark.parametrize("case", MODEL_ONLY_CASES, ids=lambda case: case.id)
def test_model_only_cases_pass_the_crd(crd: dict[str, Any], case) -> None:
    """What the server cannot see: should the CRD learn to refuse it, move it to INVALID_CASES."""
    assert validate_object(crd, case.job()) == []


def _rules(crd: dict[str, Any]):
    for path, node in _walk(_schema(crd)):
        for entry in node.get("x-kubernetes-validations", []):
            yield path, node, entry


_STRING_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
_SELECTION = re.compile(r"\.\s*([A-Za-z_][A-Za-z0-9_]*)\b(?!\s*\()")


def test_no_rule_selects_a_reserved_word_unescaped(crd: dict[str, Any]) -> None:
    """`self.function` is refused by cel-go's parser (kubectl-validate, API servers before
    1.32): a property named like a CEL reserved word is written `self.__function__`."""
    offending = []
    for path, _, entry in _rules(crd):
        code = _STRING_LITERAL.sub("''", entry["rule"])
        for name in _SELECTION.findall(code):
            if name in cel.RESERVED_WORDS:
                offending.append(f"{path}: {entry['rule']}")
    assert not offending, offending
    rules = " ".join(entry["rule"] for _, _, entry in _rules(crd))
    assert "self.__function__" in rules  # the scan sees selections at all


def test_escaping_follows_kubernetes() -> None:
    assert cel.escape("function") == "__function__"
    assert cel.escape("in") == "__in__"
    assert cel.escape("model_type") == "model_type"
    assert cel.escape("a.b-c/d") == "a__dot__b__dash__c__slash__d"
    assert cel.escape("a__b") == "a__underscores__b"
    assert cel.escape("1st") is None
    assert cel.escape("a b") is None
    schema = {
        "type": "object",
        "properties": {
            "function": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    }
    value = {"function": "m:f", "labels": {"function": "x", "a.b": "y"}, "free": {"k": 1}}
    assert cel.cel_view(value, schema) == {
        "__function__": "m:f",
        "labels": {"function": "x", "a.b": "y"},  # map keys are data, never escaped
        "free": {},  # undeclared fields are invisible to CEL
    }


def test_every_rule_on_an_object_names_a_declared_field(crd: dict[str, Any]) -> None:
    """The server blames a rule's fieldPath; on an object it must name one of its fields."""
    missing = []
    for path, node, entry in _rules(crd):
        if "properties" not in node or "oldSelf" in entry["rule"]:
            continue  # a rule on a scalar or a map blames that field itself
        target: dict[str, Any] | None = node
        for part in entry.get("fieldPath", "").lstrip(".").split("."):
            target = (target or {}).get("properties", {}).get(part) if part else None
        if target is None:
            missing.append(f"{path}: {entry['message']} ({entry.get('fieldPath')})")
    assert not missing, missing


_PERL_CLASSES = re.compile(r"\\[dDwWsSbB]")


def test_regular_expressions_avoid_classes_whose_meaning_differs(crd: dict[str, Any]) -> None:
    """`\\d`, `\\w`, `\\s` and `\\b` are ASCII for the API server (Go's RE2) and Unicode
    for pydantic (Rust's regex): a pattern using them accepts different text in the two."""
    found = []
    for path, node in _walk(_schema(crd)):
        pattern = node.get("pattern")
        if isinstance(pattern, str) and _PERL_CLASSES.search(pattern):
            found.append(f"{path}: {pattern}")
    for path, _, entry in _rules(crd):
        if _PERL_CLASSES.search(entry["rule"]):
            found.append(f"{path}: {entry['rule']}")
    assert not found, found


def test_metadata_name_fits_every_derived_name(crd: dict[str, Any]) -> None:
    name = _schema(crd)["properties"]["metadata"]["properties"]["name"]
    assert name["maxLength"] == 53
    assert name["pattern"].startswith("^[a-z]")
