"""The RLHFJob models: defaults, the examples, and every invalid case named by field."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhfjob.api import Phase, RLHFJob, RLHFJobSpec
from rlhfjob.config import InvalidJobError, load_job, parse_job
from rlhfjob.invalid_cases import INVALID_CASES, valid_job

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


def test_there_are_at_least_25_invalid_cases() -> None:
    assert len(INVALID_CASES) >= 25
    assert len({case.id for case in INVALID_CASES}) == len(INVALID_CASES)


@pytest.mark.parametrize("case", INVALID_CASES, ids=lambda case: case.id)
def test_models_reject_invalid_job_naming_the_field(case) -> None:
    with pytest.raises(InvalidJobError) as raised:
        parse_job(case.job(), source=case.id)
    blamed = [line for line in raised.value.problems if line.startswith(f"{case.field}:")]
    assert blamed, f"expected a problem on {case.field}, got {raised.value.problems}"
    if case.rule_message:
        assert case.rule_message in blamed[0]


def test_valid_base_job_is_accepted_with_defaults() -> None:
    job = parse_job(valid_job())
    assert job.metadata.namespace == "default"
    assert job.spec.algorithm.group_size == 8
    assert job.spec.checkpoint.keep_last == 3
    assert job.spec.recovery.max_restarts == 3
    assert job.spec.liveness.heartbeat_timeout_seconds == 60
    assert job.spec.roles.reference is None
    assert list(job.spec.roles.enabled()) == ["trainer", "rollout"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_and_round_trip(path: Path) -> None:
    job = load_job(path)
    again = RLHFJobSpec.model_validate(job.spec.wire())
    assert again == job.spec


def test_wire_form_is_camel_case_without_nulls() -> None:
    wire = parse_job(valid_job()).spec.wire()
    assert "groupSize" in wire["algorithm"]
    assert "group_size" not in wire["algorithm"]
    assert "reference" not in wire["roles"]


def test_load_job_reports_yaml_and_shape_errors(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed")
    with pytest.raises(InvalidJobError, match=r"broken\.yaml"):
        load_job(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string")
    with pytest.raises(InvalidJobError, match="one YAML mapping"):
        load_job(scalar)


def test_several_problems_are_all_reported() -> None:
    document = valid_job()
    document["spec"]["algorithm"].update(groupSize=0, klCoef=-1)
    with pytest.raises(InvalidJobError) as raised:
        parse_job(document)
    fields = {line.split(":")[0] for line in raised.value.problems}
    assert {"spec.algorithm.groupSize", "spec.algorithm.klCoef"} <= fields


def test_every_defaulted_section_is_valid_on_its_own() -> None:
    """A default that breaks a rule would fail with no field to blame; keep them consistent."""
    for field in RLHFJobSpec.model_fields.values():
        if field.default_factory is not None:
            field.default_factory()  # type: ignore[call-arg]  # raises if the default is invalid


def test_terminal_phases() -> None:
    assert {phase for phase in Phase if phase.terminal} == {Phase.SUCCEEDED, Phase.FAILED}


def test_status_parses_what_the_operator_writes() -> None:
    document = valid_job()
    document["status"] = {
        "phase": "Running",
        "currentStep": 3,
        "restartHistory": [{"time": "2026-01-01T00:00:00Z", "reason": "TrainerHung"}],
    }
    job = RLHFJob.model_validate(document)
    assert job.status is not None
    assert job.status.phase is Phase.RUNNING
    assert job.status.restart_history[0].reason == "TrainerHung"
