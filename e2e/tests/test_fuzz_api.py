"""The fuzzer against the real API server: generated jobs judged as the offline layers judge them.

`benchmarks/fuzz.py` makes the jobs (a valid job with one field set to a hostile or an arbitrary
value) and the models and the offline CRD check judge them; here the server, with server-side
dry runs (nothing is stored), must refuse each hostile job naming its field, accept exactly the
jobs the models accept, and accept the RayCluster the operator would build for each of those.
"""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from kubernetes.client.exceptions import ApiException

from rlhf_local.paths import load_benchmark
from rlhf_local.testing import LocalCluster
from rlhfjob import api
from rlhfjob.contract.kuberay import RAY_CLUSTERS, RAY_GROUP, RAY_VERSION

pytestmark = pytest.mark.e2e


fuzz = load_benchmark("fuzz")

# A job policy (the chart's ValidatingAdmissionPolicy) may be bound while these run; what it
# refuses is no matter of the schema.
POLICY_FIELDS = ("spec.serviceAccountName", "spec.checkpoint.volume")


def _refusal(call, *args: object) -> str | None:
    """None when the server took the dry-run create, else its message and details."""
    try:
        call(*args, dry_run="All", field_validation="Strict")
    except ApiException as error:
        if error.status not in (400, 422):
            raise
        body = json.loads(error.body)
        return str(body.get("message", "")) + json.dumps(body.get("details", {}))
    return None


@settings(
    max_examples=50,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # one namespace serves every example: dry runs
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
    ],
)
@given(case=fuzz.cases())
def test_the_server_judges_generated_jobs_as_the_models_do(
    local_cluster: LocalCluster, namespace: str, case
) -> None:
    assume(not case.target.startswith(POLICY_FIELDS))
    verdict = fuzz.judge(case)
    body = copy.deepcopy(case.document)
    body.setdefault("metadata", {})["namespace"] = namespace
    custom = local_cluster.custom
    refused = _refusal(
        custom.create_namespaced_custom_object, api.GROUP, api.VERSION, namespace, api.PLURAL, body
    )
    where = case.describe()
    if case.hostile:
        assert refused is not None, f"{where}: the server accepted a hostile value"
        assert case.target in refused, f"{where}: the server did not name it: {refused}"
    assert (refused is None) == verdict.accepted, (
        f"{where}: the models {'accept' if verdict.accepted else 'refuse'} it "
        f"({sorted(verdict.model_fields)}), the server: {refused or 'accepted'}"
    )
    if refused is not None and not case.hostile:
        assert any(field in refused for field in verdict.model_fields), (
            f"{where}: the models blame {sorted(verdict.model_fields)}, the server: {refused}"
        )
    if verdict.job is not None:
        cluster = fuzz.ray_cluster(verdict.job, namespace)
        rejected = _refusal(
            custom.create_namespaced_custom_object,
            RAY_GROUP,
            RAY_VERSION,
            namespace,
            RAY_CLUSTERS,
            cluster,
        )
        assert rejected is None, f"{where}: the RayCluster was refused: {rejected}"
