"""The generated CRD: fresh, structural, and enforcing the same rules as the models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_validator import validate_object

from rlhfjob import crdgen
from rlhfjob.invalid_cases import INVALID_CASES, valid_job

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


def test_kubectl_explain_documents_every_spec_field(crd: dict[str, Any]) -> None:
    spec = _schema(crd)["properties"]["spec"]
    undocumented = [
        path
        for path, node in _walk(spec)
        if path.rsplit("/", 2)[-2:-1] == ["properties"] and not node.get("description")
    ]
    assert not undocumented, f"fields without a description: {undocumented}"


def test_optional_fields_are_nullable_and_quantities_int_or_string(crd: dict[str, Any]) -> None:
    spec = _schema(crd)["properties"]["spec"]["properties"]
    assert spec["activeDeadlineSeconds"]["nullable"] is True
    trainer = spec["roles"]["properties"]["trainer"]["properties"]
    assert trainer["cpu"]["x-kubernetes-int-or-string"] is True
    assert trainer["affinity"]["x-kubernetes-preserve-unknown-fields"] is True
    # Nested defaults only apply when the parent exists, so defaulted parents are spelled out.
    assert spec["liveness"]["default"]["heartbeatTimeoutSeconds"] == 60


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
