"""The invalid-job table against the real API server: the generated CRD's schema and CEL rules.

The same cases run against the models and the offline CRD check in the unit tier; here the
server must reject each one and name the field, and accept every valid example.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from rlhf_local.testing import LocalCluster
from rlhfjob import api
from rlhfjob.invalid_cases import INVALID_CASES
from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import valid_job

pytestmark = pytest.mark.e2e

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


def _create(lc: LocalCluster, namespace: str, body: dict) -> None:
    lc.custom.create_namespaced_custom_object(
        api.GROUP, api.VERSION, namespace, api.PLURAL, body, field_validation="Strict"
    )


def test_every_invalid_case_is_rejected_naming_its_field(
    local_cluster: LocalCluster, namespace: str
) -> None:
    failures = []
    for case in INVALID_CASES:
        try:
            _create(local_cluster, namespace, case.job())
        except ApiException as error:
            body = json.loads(error.body)
            text = body.get("message", "") + json.dumps(body.get("details", {}))
            named = case.field in text or (
                # unknown fields are named by the strict decoder as `.spec.<field>`
                "unknown field" in text and case.field.rsplit(".", 1)[-1] in text
            )
            if error.status not in (400, 422) or not named:
                failures.append(f"{case.id}: HTTP {error.status}: {body.get('message')}")
            elif case.rule_message and case.rule_message not in text:
                failures.append(f"{case.id}: rule message missing: {body.get('message')}")
        else:
            failures.append(f"{case.id}: accepted")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_accepted(
    local_cluster: LocalCluster, namespace: str, path: Path, tmp_path: Path
) -> None:
    body = yaml.safe_load(path.read_text())
    body["metadata"]["namespace"] = namespace
    body["spec"]["suspend"] = True  # accepted, never run
    _create(local_cluster, namespace, body)
    # What `rlhfjob render` prints for it, `kubectl apply` takes as it is (a dry run).
    job_file = tmp_path / path.name
    job_file.write_text(yaml.safe_dump(body))
    rendered = subprocess.run(
        [sys.executable, "-m", "rlhfjob_cli", "render", str(job_file)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    applied = local_cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "-f", "-",
        stdin=rendered,
    )  # fmt: skip
    assert "raycluster.ray.io/" in applied and "configmap/" in applied, applied


@pytest.mark.attack(
    "an immutable field removed and re-added to change it",
    "the CRD's transition rules (has(self) == has(oldSelf))",
)
def test_running_fields_are_immutable_but_elastic_replicas_are_not(
    local_cluster: LocalCluster, namespace: str
) -> None:
    pods = {"env": [{"name": "TEAM", "value": "research"}]}
    body = merge_patch(valid_job("immutable"), {"spec": {"suspend": True, "pods": pods}})
    _create(local_cluster, namespace, body)

    def patch(spec: dict) -> None:
        local_cluster.custom.patch_namespaced_custom_object(
            api.GROUP, api.VERSION, namespace, api.PLURAL, "immutable", {"spec": spec}
        )

    with pytest.raises(ApiException) as raised:
        patch({"algorithm": {"groupSize": 16}})
    assert "algorithm is immutable" in raised.value.body
    with pytest.raises(ApiException) as raised:
        patch({"roles": {"rollout": {"gpus": 2}}})
    assert "gpus is immutable" in raised.value.body
    with pytest.raises(ApiException) as raised:  # removed now, to be set again later
        patch({"pods": None})
    assert "pods is immutable" in raised.value.body
    patch({"roles": {"rollout": {"replicas": 3}}})
