"""Every attack of `rlhf_local.attacks`, refused by the operator's own check (the layer that
holds where no admission policy is installed, and at every reconcile of a running job): the
job policy names the field, or, for what the CRD refuses, the API models do."""

from __future__ import annotations

import pytest

from rlhf_local.attacks import ALLOWED_REGISTRY, ATTACKS, Attack, attack_job
from rlhf_local.operator_process import OPERATOR_NAMESPACE
from rlhf_operator.policy import JobPolicy
from rlhfjob.config import InvalidJobError, parse_job

ACCOUNT = "rlhfjob"
"""The chart's ServiceAccount for the operator (release `rlhfjob`)."""
POLICY = JobPolicy(
    operator_namespace=OPERATOR_NAMESPACE,
    operator_service_account=ACCOUNT,
    # The operator's own account listed too: only the rule against it may refuse it.
    allowed_service_accounts=("rlhf-trainer", ACCOUNT),
    # The installation attacked (`attacks.INSTALLATION`): Kueue on, one registry listed.
    kueue=True,
    allowed_image_registries=(ALLOWED_REGISTRY,),
)
LAYERS = {
    "policy": "the operator's job policy check, at every reconcile (rlhf_operator.policy)",
    "crd": "the API models the operator parses a job with (rlhfjob.api)",
}


def _namespace(attack: Attack) -> str:
    return OPERATOR_NAMESPACE if attack.namespace == "operator" else "team-a"


@pytest.mark.parametrize(
    "attack",
    [pytest.param(a, id=a.id, marks=pytest.mark.attack(a.what, LAYERS[a.layer])) for a in ATTACKS],
)
def test_the_operator_refuses_the_attack_naming_the_field(attack: Attack) -> None:
    document = attack_job(attack, _namespace(attack), ACCOUNT)
    if attack.layer == "crd":
        with pytest.raises(InvalidJobError) as refused:
            parse_job(document)
        assert f"{attack.field}:" in str(refused.value), str(refused.value)
        return
    problems = POLICY.problems(parse_job(document))
    assert any(problem.startswith(f"{attack.field}") for problem in problems), problems


def test_the_same_job_without_an_attack_is_accepted() -> None:
    """The control: the example itself, and with a listed ServiceAccount, passes."""
    for spec in ({}, {"serviceAccountName": "rlhf-trainer"}):
        clean = Attack("clean", "", spec, "")
        assert POLICY.problems(parse_job(attack_job(clean, "team-a", ACCOUNT))) == []
