"""Every attack of `rlhf_local.attacks`, tried against the real API server with the chart's
admission policy and the CRD installed: each must be refused, by the layer the attack names,
naming its field. The same attacks against the operator's own check: `tests/security/`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from rlhf_local.attacks import ATTACKS, BORROWED_ACCOUNT, INSTALLATION, Attack, attack_job
from rlhf_local.harness import wait_for
from rlhf_local.operator_process import (
    OPERATOR_NAMESPACE,
    apply_admission_policy,
    chart_service_account,
    refusal,
    remove_admission_policy,
)
from rlhf_local.testing import RESTRICTED, LocalCluster, fresh_namespace

pytestmark = pytest.mark.e2e

LAYERS = {
    "policy": "the chart's ValidatingAdmissionPolicy (rendered from the job policy)",
    "crd": "the CRD's CEL rules",
}
ACCEPTED = ("persistentVolumeClaim",)


@pytest.fixture(scope="module")
def team(local_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A team's namespace with the chart's admission policy bound to it and to the operator's
    namespace, of the installation the attacks are tried on (Kueue on, one image registry
    listed); the operator's own ServiceAccount is listed as allowed, so only the rule against it
    can refuse it."""
    account = chart_service_account()
    local_cluster.kubectl("create", "namespace", OPERATOR_NAMESPACE, check=False)
    probe = Attack("probe", "", ATTACKS[0].spec, "")  # refused by the admission policy alone
    with contextlib.contextmanager(fresh_namespace)(local_cluster, request, RESTRICTED) as name:
        applied = apply_admission_policy(
            local_cluster,
            f"watchNamespaces={{{OPERATOR_NAMESPACE},{name}}}",
            f"jobPolicy.allowedServiceAccounts={{rlhf-trainer,{account}}}",
            *INSTALLATION,
        )
        try:
            job = attack_job(probe, name, account)
            wait_for(lambda: refusal(local_cluster, job), 60, "the admission policy to take effect")
            yield name
        finally:
            remove_admission_policy(local_cluster, applied)


def _job(attack: Attack, team: str) -> dict:
    namespace = OPERATOR_NAMESPACE if attack.namespace == "operator" else team
    return attack_job(attack, namespace, chart_service_account())


@pytest.mark.parametrize(
    "attack",
    [pytest.param(a, id=a.id, marks=pytest.mark.attack(a.what, LAYERS[a.layer])) for a in ATTACKS],
)
def test_the_api_server_refuses_the_attack_naming_the_field(
    attack: Attack, local_cluster: LocalCluster, team: str
) -> None:
    refused = refusal(local_cluster, _job(attack, team))
    assert refused is not None, "accepted"
    assert attack.field in refused, refused
    by_admission = "ValidatingAdmissionPolicy" in refused
    assert by_admission == (attack.layer == "policy"), refused


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"serviceAccountName": "rlhf-trainer"},
        {"checkpoint": {"volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}}},
        {"pods": {"priorityClassName": "research-high", "imagePullSecrets": [{"name": "reg"}]}},
        {"roles": {"trainer": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}}},
        {"serviceAccountName": BORROWED_ACCOUNT},
        {"pods": {"extraResources": {"ephemeral-storage": "1Gi"}}},
    ],
    ids=[
        "example",
        "listed-account",
        "pvc",
        "own-priority-and-pull-secret",
        "gpu-toleration",
        "operator-account-name-elsewhere",
        "native-resource",
    ],
)
def test_what_the_policy_allows_passes(spec: dict, local_cluster: LocalCluster, team: str) -> None:
    """The controls: without its attack, the same job is accepted, so the attack is what the
    API server refuses (the operator's account in another namespace is another account)."""
    assert refusal(local_cluster, _job(Attack("allowed", "", spec, ""), team)) is None
