"""The fuzzer (`benchmarks/fuzz.py`), CI-sized: generated jobs, valid and hostile, judged alike
by the models and the generated CRD; accepted ones build; `decide` plans for any observed state.

The examples are derandomized, so a run is repeatable; `python benchmarks/fuzz.py` explores more.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf_local.paths import load_benchmark
from rlhfjob.config import parse_job

fuzz = load_benchmark("fuzz")

CI = settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@settings(CI, max_examples=100)
@given(case=fuzz.cases())
def test_generated_jobs_are_judged_alike_by_models_and_crd(case) -> None:
    fuzz.check_case(case)


@settings(CI, max_examples=40)
@given(case=fuzz.cases(hostile=True))
def test_hostile_values_are_refused_naming_their_field(case) -> None:
    assert not fuzz.check_case(case).accepted


@settings(CI, max_examples=60)
@given(data=st.data())
def test_decide_plans_for_any_observed_state(data: st.DataObject) -> None:
    _, text = data.draw(st.sampled_from(fuzz.bases()))
    job = parse_job(json.loads(text))
    fuzz.check_decide(data.draw(fuzz.observed_states(job)))


def test_every_base_is_valid_and_builds() -> None:
    for name, text in fuzz.bases():
        fuzz.check_build(parse_job(json.loads(text), source=name))


def test_targets_cover_the_fields_whose_syntax_lives_in_cel() -> None:
    fields = {target.field for target in fuzz.targets()}
    for expected in (
        "metadata.name",
        "spec.image",
        "spec.algorithm.groupSize",
        "spec.algorithm.stopStrings",
        "spec.roles.trainer.cpu",
        "spec.head.memory",
        "spec.roles.rollout.nodeSelector",
        "spec.roles.trainer.tolerations[0].key",
        "spec.roles.trainer.tolerations[0].tolerationSeconds",
        "spec.model.randomInit.model_type",
        "spec.reward.remote.url",
        "spec.checkpoint.path",
        "spec.checkpoint.objectStore.prefix",
        "spec.pods.volumeMounts[0].mountPath",
        "spec.pods.volumeMounts[0].subPath",
        "spec.algorithm.maxResponseLength",
        "spec.dataset.source",
    ):
        assert expected in fields, expected


def test_a_planted_disagreement_is_found() -> None:
    """The properties bite: a CRD that forgot the image pattern disagrees with the models."""
    case = fuzz.Case(
        "valid_job",
        "spec.image",
        "Example.com/Trainer",
        True,
        {**json.loads(fuzz.bases()[0][1])},
    )
    case.document["spec"]["image"] = case.value
    fuzz.check_case(case)  # both refuse it
    crd = json.loads(json.dumps(fuzz.crd()))
    del crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "image"
    ]["pattern"]
    real = fuzz.crd
    fuzz.crd = lambda: crd
    try:
        with pytest.raises(fuzz.PropertyError, match="the CRD accepts it"):
            fuzz.check_case(case)
    finally:
        fuzz.crd = real
