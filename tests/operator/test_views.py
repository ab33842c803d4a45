"""The pure parsers of what the reconciler reads: Kubernetes and Ray objects in, views out."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes.client import (
    CoreV1Event,
    CoreV1EventSeries,
    V1ContainerState,
    V1ContainerStateRunning,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1Lease,
    V1LeaseSpec,
    V1ObjectMeta,
    V1ObjectReference,
    V1Pod,
    V1PodCondition,
    V1PodStatus,
)

from rlhf_operator import names
from rlhf_operator.parsers import (
    api_status,
    apply_refusal,
    cluster_view,
    cluster_warning,
    head_not_ready_since,
    heartbeat_from_lease,
    ray_job_view,
    scheduling_problem,
    startup_problem,
)
from rlhf_operator.texts import CAUSE_LIMIT
from rlhf_operator.views import ClusterWarning, HeartbeatView, RayJobView, RoleView
from rlhfjob.config import parse_job
from rlhfjob.contract import DASHBOARD_ANNOTATION, EngineCount
from rlhfjob.contract import kuberay as ray
from rlhfjob.valid_cases import valid_job

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


# -- why a cluster does not come up: the API server's refusals and KubeRay's Warnings ----------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"kind":"Status","reason":"Invalid","message":"x is invalid","code":422}',
         ("Invalid", "x is invalid")),
        (b'{"reason":"Forbidden","message":"no"}', ("Forbidden", "no")),
        ("<html>bad gateway</html>", ("", "")),
        (None, ("", "")),
        ('{"reason": 5, "message": ["x"]}', ("", "")),
        ("[1, 2]", ("", "")),
    ],
)  # fmt: skip
def test_only_the_status_reason_and_message_are_read(body: Any, expected: tuple[str, str]) -> None:
    assert api_status(body) == expected


TOKEN = "s3cr3t-token-value"
SECRET = {
    "apiVersion": "v1",
    "kind": "Secret",
    "metadata": {"name": "job-ray-auth", "namespace": "ns"},
    "data": {"auth_token": base64.b64encode(TOKEN.encode()).decode()},
    "stringData": {"other": "plain-secret-words"},
}


def test_a_refused_secret_never_quotes_its_values() -> None:
    encoded = SECRET["data"]["auth_token"]  # type: ignore[index]
    message = f'Secret "job-ray-auth" is invalid: data: {encoded} / {TOKEN} / plain-secret-words'
    refusal = apply_refusal(SECRET, 422, "Invalid", message)
    assert TOKEN not in refusal.text and encoded not in refusal.text
    assert "plain-secret-words" not in refusal.text
    assert refusal.text == (
        'the API server refused the Secret job-ray-auth (422 Invalid): Secret "job-ray-auth" '
        "is invalid: data: [redacted] / [redacted] / [redacted]"
    )
    assert refusal.permanent


@pytest.mark.parametrize(
    ("code", "permanent"), [(400, True), (422, True), (403, False), (409, False)]
)
def test_bad_requests_and_invalid_objects_are_refused_for_good_others_for_now(
    code: int, permanent: bool
) -> None:
    refusal = apply_refusal({"kind": "RayCluster", "metadata": {"name": "job"}}, code, "", "no")
    assert refusal.permanent is permanent
    assert refusal.text == f"the API server refused the RayCluster job ({code}): no"


def test_a_refusal_is_one_trimmed_line_and_never_empty() -> None:
    long = apply_refusal({"kind": "Role"}, 403, "Forbidden", "a\n  b " + "x" * 5000)
    assert long.message.startswith("a b x") and len(long.message) == CAUSE_LIMIT
    assert long.message.endswith("...") and long.name == "?"
    assert (
        apply_refusal({}, 409, "", "").text == "the API server refused the object ? (409): HTTP 409"
    )


CLUSTER = {"metadata": {"name": "job", "uid": "uid-1", "creationTimestamp": "2026-01-01T00:00:00Z"}}
QUOTA = (
    'Failed to create head Pod ns/job-head-x, pods "job-head-x" is forbidden: exceeded quota: '
    "pods, requested: pods=1, used: pods=0, limited: pods=0"
)
PSA = (
    'Failed to create worker Pod for the cluster ns/job, pods "job-trainer-worker-x" is '
    'forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false'
)
INVALID = 'Failed to create head Pod ns/job-head-x, Pod "job-head-x" is invalid: spec.volumes[1]'


def event(
    reason: str = "FailedToCreateHeadPod",
    message: str = QUOTA,
    first: float = 10,
    last: float | None = None,
    uid: str | None = "uid-1",
    type_: str = "Warning",
    **fields: Any,
) -> CoreV1Event:
    return CoreV1Event(
        metadata=V1ObjectMeta(name="e"),
        involved_object=V1ObjectReference(kind="RayCluster", name="job", uid=uid),
        type=type_,
        reason=reason,
        message=message,
        first_timestamp=at(first),
        last_timestamp=at(first if last is None else last),
        **fields,
    )


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def pod(created: float, deleting: bool = False) -> V1Pod:
    return V1Pod(
        metadata=V1ObjectMeta(
            name=f"pod-{created}",
            creation_timestamp=at(created),
            deletion_timestamp=at(created) if deleting else None,
        )
    )


@pytest.mark.parametrize(
    ("events", "pods", "expected"),
    [
        ([], [], None),
        ([event(type_="Normal")], [], None),
        ([event(reason="FailedScheduling")], [], None),
        ([event()], [], ("FailedToCreateHeadPod", QUOTA, False)),
        ([event(reason="FailedToCreateWorkerPod", message=PSA)], [],
         ("FailedToCreateWorkerPod", PSA, True)),
        ([event(message=INVALID)], [], ("FailedToCreateHeadPod", INVALID, True)),
        ([event(message="(combined from similar events): " + QUOTA)], [],
         ("FailedToCreateHeadPod", QUOTA, False)),
        # Another RayCluster of the same name, before this one: not this cluster's trouble.
        ([event(uid="uid-0")], [], None),
        ([event(uid=None, first=-30)], [], None),
        # KubeRay created a pod since: the failure is over.
        ([event(first=10)], [pod(20)], None),
        ([event(first=10)], [pod(20, deleting=True)], ("FailedToCreateHeadPod", QUOTA, False)),
        ([event(first=30)], [pod(20)], ("FailedToCreateHeadPod", QUOTA, False)),
        # The newest one speaks.
        ([event(message=PSA, first=10), event(message=QUOTA, first=5, last=40)], [],
         ("FailedToCreateHeadPod", QUOTA, False)),
        # KubeRay's own validation refused the spec: never over, whatever the pods.
        ([event(reason="InvalidRayClusterSpec", message="bad spec")], [pod(20)],
         ("InvalidRayClusterSpec", "bad spec", True)),
    ],
)  # fmt: skip
def test_kuberays_newest_warning_on_the_cluster_says_why_pods_are_missing(
    events: list[Any], pods: list[Any], expected: tuple[str, str, bool] | None
) -> None:
    found = cluster_warning(events, CLUSTER, pods, now=at(100))
    if expected is None:
        assert found is None
        return
    assert found is not None
    assert (found.reason, found.message, found.permanent) == expected
    assert found.text == f"KubeRay {expected[0]}: {expected[1]}"


def test_a_warning_reads_its_times_from_whatever_the_event_carries() -> None:
    aggregated = event(first=10, last=20, count=7)
    found = cluster_warning([aggregated], CLUSTER, [], now=at(100))
    assert found == ClusterWarning("FailedToCreateHeadPod", QUOTA, at(10), at(20), 7)
    # events.k8s.io style: eventTime and a series, no first/last timestamps; naive times are UTC
    series = CoreV1Event(
        metadata=V1ObjectMeta(name="e"),
        involved_object=V1ObjectReference(kind="RayCluster", name="job"),
        type="Warning",
        reason="FailedToCreateWorkerPod",
        message=PSA,
        event_time=at(30).replace(tzinfo=None),
        series=CoreV1EventSeries(count=3, last_observed_time=at(50)),
    )
    found = cluster_warning([series], CLUSTER, [], now=at(100))
    assert found is not None
    assert (found.first_seen, found.last_seen, found.count) == (at(30), at(50), 3)
    bare = CoreV1Event(
        metadata=V1ObjectMeta(name="e"),
        involved_object=V1ObjectReference(),
        type="Warning",
        reason="FailedToCreateHeadPod",
    )
    found = cluster_warning([bare], {}, [], now=at(100))
    assert found == ClusterWarning("FailedToCreateHeadPod", "", at(100), at(100), 1)


@pytest.mark.parametrize(
    "junk",
    [None, object(), "text", 5, SimpleNamespace(metadata=None, involved_object=None),
     SimpleNamespace(involved_object="junk", type="Warning", reason="FailedToCreateHeadPod",
                     first_timestamp="garbage", message=None, count="many", series=5)],
)  # fmt: skip
def test_a_bad_event_is_no_cause_not_a_crash(junk: Any) -> None:
    found = cluster_warning([junk], {"metadata": "junk"}, [None, object()], now=at(1))
    assert found is None or found.first_seen == at(1)


def test_the_scheduler_speaks_in_the_same_way() -> None:
    stuck = V1Pod(
        metadata=V1ObjectMeta(name="job-head-x"),
        status=V1PodStatus(
            conditions=[
                V1PodCondition(
                    type="PodScheduled",
                    status="False",
                    reason="Unschedulable",
                    message="0/6 nodes are available:\n 6 Insufficient nvidia.com/gpu.",
                )
            ]
        ),
    )
    assert scheduling_problem([stuck]) == (
        "the scheduler cannot place pod job-head-x: 0/6 nodes are available: "
        "6 Insufficient nvidia.com/gpu."
    )
    assert scheduling_problem([V1Pod(), object()]) is None


def _pod_with(name: str, *, init: list[Any] | None = None, main: list[Any] | None = None) -> Any:
    return V1Pod(
        metadata=V1ObjectMeta(name=name),
        status=V1PodStatus(init_container_statuses=init, container_statuses=main),
    )


def _container(name: str, reason: str | None, message: str | None = None) -> V1ContainerStatus:
    state = (
        V1ContainerState(waiting=V1ContainerStateWaiting(reason=reason, message=message))
        if reason
        else V1ContainerState(running=V1ContainerStateRunning())
    )
    return V1ContainerStatus(name=name, image="x", image_id="", ready=False, restart_count=0,
                             state=state)  # fmt: skip


def test_the_kubelet_speaks_for_a_container_that_cannot_start() -> None:
    missing = _container("ray-head", "CreateContainerConfigError",
                         'secret "hf-token" not found')  # fmt: skip
    assert startup_problem([_pod_with("job-head-x", main=[missing])]) == (
        "container ray-head of pod job-head-x cannot start: CreateContainerConfigError: "
        'secret "hf-token" not found'
    )
    # An init container's pull failure counts too, and a reason may come without words.
    pull = _container("wait-gcs", "ImagePullBackOff")
    assert startup_problem([_pod_with("w", init=[pull])]) == (
        "container wait-gcs of pod w cannot start: ImagePullBackOff"
    )
    # Starting normally is no cause; nor is a pod with no statuses or a junk object.
    creating = _container("ray-worker", "ContainerCreating")
    running = _container("ray-worker", None)
    assert startup_problem([_pod_with("a", main=[creating, running]), V1Pod(), object()]) is None
    # The first pod with a cause speaks, on one line, trimmed like every cause.
    long = _container("c", "CrashLoopBackOff", "back-off\n" + "x" * 2 * CAUSE_LIMIT)
    found = startup_problem([_pod_with("a", main=[creating]), _pod_with("b", main=[long])])
    assert found is not None and found.startswith("container c of pod b cannot start: Crash")
    assert "\n" not in found and len(found) < 2 * CAUSE_LIMIT


def test_a_bad_raycluster_reads_as_not_known_not_as_a_crash() -> None:
    job = parse_job({**valid_job("job"), "metadata": {"name": "job", "namespace": "ns"}})
    body = {
        "metadata": {"creationTimestamp": "yesterday", "annotations": ["x"]},
        "spec": {"workerGroupSpecs": [{"groupName": "trainer", "replicas": None}, "junk", {}]},
        "status": {"state": "ready", "conditions": ["junk", {"type": "HeadPodReady",
                                                              "status": "False"}]},
    }  # fmt: skip
    view = cluster_view(job, body, [V1Pod(), object()], now=T0)
    assert view is not None
    assert (view.name, view.created, view.ready) == ("job", T0, True)
    assert view.roles == {"trainer": RoleView(0, 0)}
    assert view.head_not_ready_since == T0
    assert cluster_view(job, {"status": "junk"}, [], now=T0) is not None


@pytest.mark.attack(
    "a RayCluster annotation points the operator, with the job's token, at another address",
    "the operator asks the head Service; the annotation is a test hook (a --dev- flag)",
)
def test_the_dashboard_annotation_is_trusted_only_by_the_test_hook() -> None:
    """Whoever may annotate a RayCluster must not choose where the job's token is sent."""
    job = parse_job({**valid_job("job"), "metadata": {"name": "job", "namespace": "ns"}})
    body = {"metadata": {"name": "job", "annotations": {DASHBOARD_ANNOTATION: "http://evil:1"}}}
    view = cluster_view(job, body, [], now=T0)
    assert view is not None and view.dashboard == names.dashboard_url(job)
    hooked = cluster_view(job, body, [], now=T0, dashboard_from_annotation=True)
    assert hooked is not None and hooked.dashboard == "http://evil:1"


def test_head_pods_are_counted_without_those_being_deleted() -> None:
    def head(created: float, deleting: bool = False) -> V1Pod:
        made = pod(created, deleting)
        made.metadata.labels = {ray.LABEL_NODE_TYPE: ray.NODE_HEAD}
        return made

    job = parse_job({**valid_job("job"), "metadata": {"name": "job", "namespace": "ns"}})
    body = {"metadata": {"name": "job"}, "status": {}}
    pods = [head(1), head(2), head(3, deleting=True), pod(4), object()]
    view = cluster_view(job, body, pods, now=T0)
    assert view is not None and view.head_pods == 2
