"""The pure parsers of what the reconciler reads: Kubernetes and Ray objects in, views out."""

from __future__ import annotations

from datetime import UTC, datetime

from kubernetes.client import V1Lease, V1LeaseSpec, V1ObjectMeta

from rlhf_operator.views import (
    HeartbeatView,
    RayJobView,
    head_not_ready_since,
    heartbeat_from_lease,
    ray_job_view,
)
from rlhfjob.contract import EngineCount

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_a_lease_never_renewed_is_no_heartbeat() -> None:
    assert heartbeat_from_lease(None) is None
    assert heartbeat_from_lease(V1Lease(metadata=V1ObjectMeta(name="job"))) is None


def test_a_lease_reads_as_its_report_and_renew_time() -> None:
    lease = V1Lease(
        metadata=V1ObjectMeta(
            annotations={"rlhf.dev/step": "3", "rlhf.dev/rollout-engines": "1/2", "x": "y"}
        ),
        spec=V1LeaseSpec(renew_time=T0.replace(tzinfo=None)),  # the client may drop the zone
    )
    assert heartbeat_from_lease(lease) == HeartbeatView(
        renewed=T0, step=3, rollout_engines=EngineCount(1, 2)
    )


def test_a_head_not_ready_without_a_transition_time_is_not_ready_since_now() -> None:
    cluster = {"status": {"conditions": [{"type": "HeadPodReady", "status": "False"}]}}
    assert head_not_ready_since(cluster, now=T0) == T0
    assert head_not_ready_since({"status": {}}, now=T0) is None


def test_a_ray_job_reads_its_exit_code_from_the_message_when_ray_gives_none() -> None:
    body = {"status": "FAILED", "message": "Job entrypoint failed with exit code 3", "end_time": 0}
    assert ray_job_view("id", body) == RayJobView(
        "id", "FAILED", "Job entrypoint failed with exit code 3", exit_code=3
    )
    ended = ray_job_view("id", {"status": "SUCCEEDED", "end_time": 1767225600000}).ended
    assert ended == T0
