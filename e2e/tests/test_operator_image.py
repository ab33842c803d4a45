"""The operator from its container image runs a job, as its Deployment would in a cluster.

The image (`task images`, built beside the unit tier in CI and found here by its inputs' hash)
runs under the chart's securityContext with the chart's ServiceAccount token mounted where
Kubernetes mounts it (`rlhf_local.operator_image`). The session's operator process steps aside
meanwhile, so exactly one operator reconciles the job.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf_local import images
from rlhf_local.jobs import FINISH_AT_ONCE, Jobs, job_manifest
from rlhf_local.operator_image import ImageOperatorProcess, service_account_volume
from rlhf_local.operator_process import OperatorProcess
from rlhf_local.testing import LocalCluster

pytestmark = pytest.mark.e2e


@pytest.fixture
def image_operator(
    local_cluster: LocalCluster, operator: OperatorProcess, tmp_path: Path
) -> Iterator[ImageOperatorProcess]:
    ref = images.ensure_image("operator")
    volume, host, port = service_account_volume(local_cluster, tmp_path / "serviceaccount")
    handle = ImageOperatorProcess(
        kubeconfig=tmp_path / "unused",  # none: it finds the API server as a pod does
        log_path=tmp_path / "operator.log",
        image=ref.tag,
        service_account_dir=volume,
        api_host=host,
        api_port=port,
    )
    operator.stop()
    try:
        handle.start()
        yield handle
    finally:
        handle.stop()
        operator.start()


def test_the_operator_image_runs_a_job_to_success(
    local_cluster: LocalCluster, namespace: str, image_operator: ImageOperatorProcess
) -> None:
    jobs = Jobs(local_cluster, namespace)
    jobs.create(job_manifest("from-image", namespace, FINISH_AT_ONCE))
    job = jobs.wait_phase("from-image", "Succeeded", 240, image_operator)
    assert job["status"]["rayClusterName"] == "from-image"
    for reason in ("Provisioning", "Submitted", "Succeeded"):
        assert reason in jobs.event_reasons("from-image")

    # It ran as the chart says: its uid, a read-only root, no capability, no escalation.
    store = images.Store.default()
    inspected = json.loads(store.podman("inspect", image_operator.container).stdout)[0]
    config, host = inspected["Config"], inspected["HostConfig"]
    assert config["User"] == "65532:65532"
    assert host["ReadonlyRootfs"] is True
    assert not host.get("CapAdd") and {"CAP_SETUID", "CAP_NET_RAW"} <= set(host["CapDrop"])
    assert "no-new-privileges" in host["SecurityOpt"]
