"""The heartbeat renews its Lease with progress annotations, from a thread, surviving errors."""

from __future__ import annotations

import copy
import re
import threading
from datetime import UTC, datetime, timedelta

import pytest
from kubernetes.client import ApiClient, V1Lease, V1LeaseSpec, V1ObjectMeta
from kubernetes.client.exceptions import ApiException

from rlhf_trainer.run import heartbeat as hb
from rlhf_trainer.run.heartbeat import Heartbeat, NoopHeartbeat, make_heartbeat
from rlhfjob import contract
from rlhfjob.contract import LeaseReport

NAME, NAMESPACE = "job-a-heartbeat", "team-a"
WAIT_SECONDS = 10.0
MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|\+00:00)$")


class FakeLeaseApi:
    """Test double for ``CoordinationV1Api``: in-memory Leases with optimistic concurrency.

    ``replace`` rejects a stale ``resourceVersion`` with 409 like the API server does. Tests can
    queue exceptions for the next calls and wait for a number of successful replacements.
    """

    def __init__(self) -> None:
        self.leases: dict[tuple[str, str], V1Lease] = {}
        self.replacements = 0
        self.fail_next_reads: list[Exception] = []
        self.before_replace: list[V1Lease] = []  # concurrent writes to apply before a replace
        self._changed = threading.Condition()

    def add_lease(
        self, annotations: dict[str, str] | None = None, holder: str | None = None
    ) -> None:
        self.leases[(NAMESPACE, NAME)] = V1Lease(
            metadata=V1ObjectMeta(
                name=NAME, namespace=NAMESPACE, resource_version="1", annotations=annotations
            ),
            spec=V1LeaseSpec(holder_identity=holder),
        )

    def lease(self) -> V1Lease:
        return self.leases[(NAMESPACE, NAME)]

    def read_namespaced_lease(self, name: str, namespace: str) -> V1Lease:
        if self.fail_next_reads:
            raise self.fail_next_reads.pop(0)
        if (namespace, name) not in self.leases:
            raise ApiException(status=404, reason="Not Found")
        return copy.deepcopy(self.leases[(namespace, name)])

    def replace_namespaced_lease(self, name: str, namespace: str, body: V1Lease) -> V1Lease:
        with self._changed:
            if self.before_replace:
                self._store(self.before_replace.pop(0))
            stored = self.leases[(namespace, name)]
            if body.metadata.resource_version != stored.metadata.resource_version:
                raise ApiException(status=409, reason="Conflict")
            self._store(body)
            self.replacements += 1
            self._changed.notify_all()
            return copy.deepcopy(self.lease())

    def _store(self, lease: V1Lease) -> None:
        stored = copy.deepcopy(lease)
        version = int(self.lease().metadata.resource_version) + 1
        stored.metadata.resource_version = str(version)
        self.leases[(NAMESPACE, NAME)] = stored

    def wait_for_replacements(self, count: int) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.replacements >= count, WAIT_SECONDS)


class FakeNow:
    """Test double for the wall clock."""

    def __init__(self) -> None:
        self.now = datetime(2025, 3, 1, 12, 0, 0, 250000, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def api() -> FakeLeaseApi:
    fake = FakeLeaseApi()
    fake.add_lease()
    return fake


@pytest.fixture
def now() -> FakeNow:
    return FakeNow()


def make(api: FakeLeaseApi, now: FakeNow, **kwargs: object) -> Heartbeat:
    options: dict = {"holder_identity": "driver-0", "lease_duration_seconds": 45, **kwargs}
    return Heartbeat(api, NAME, NAMESPACE, now=now, **options)


def test_annotation_keys_are_stable_and_each_field_says_what_it_means() -> None:
    """The wire names are what running trainers and operators of other versions read: a rename
    is a protocol change, so the list is spelled out here."""
    described = dict(LeaseReport.describe())
    assert list(described) == [
        f"rlhf.dev/{name}"
        for name in ("step", "step-time", "total-steps", "phase", "checkpoint-step",
                     "checkpoint-path", "attempt", "rollout-engines", "reward-models",
                     "reward-mean", "tokens-per-second", "checkpoint-requested-at",
                     "checkpoint-saved-step", "eval-step", "eval-score", "eval-accuracy",
                     "eval-pass-at-k", "export-step", "export-path", "tracking-failures")
    ]  # fmt: skip
    assert all(meaning.strip() for meaning in described.values())
    assert contract.LEASE_STOP_REQUESTED_AT == "rlhf.dev/stop-requested-at"
    assert contract.LEASE_STOP_REQUESTED_AT not in described  # the operator's, not the report's


def test_renew_writes_spec_and_progress_annotations(api: FakeLeaseApi, now: FakeNow) -> None:
    heartbeat = make(api, now, attempt=2, total_steps=100)
    heartbeat.update(step=12, phase="update", checkpoint_step=10, checkpoint_path="/ckpt/step-10")
    assert heartbeat.renew()

    lease = api.lease()
    assert lease.spec.holder_identity == "driver-0"
    assert lease.spec.lease_duration_seconds == 45
    assert lease.spec.renew_time == now.now
    assert lease.metadata.annotations == {
        "rlhf.dev/step": "12",
        "rlhf.dev/step-time": "2025-03-01T12:00:00.250000Z",
        "rlhf.dev/total-steps": "100",
        "rlhf.dev/phase": "update",
        "rlhf.dev/checkpoint-step": "10",
        "rlhf.dev/checkpoint-path": "/ckpt/step-10",
        "rlhf.dev/attempt": "2",
    }
    assert heartbeat.renewals == 1
    assert heartbeat.last_error is None


def test_nothing_reported_yet_writes_no_annotations(api: FakeLeaseApi, now: FakeNow) -> None:
    assert make(api, now).renew()
    assert api.lease().metadata.annotations == {}
    assert api.lease().spec.renew_time == now.now


def test_other_annotations_are_preserved(api: FakeLeaseApi, now: FakeNow) -> None:
    api.add_lease(annotations={"owner": "operator", "rlhf.dev/phase": "old"})
    heartbeat = make(api, now)
    heartbeat.update(phase="generate")
    heartbeat.renew()
    assert api.lease().metadata.annotations == {"owner": "operator", "rlhf.dev/phase": "generate"}


def test_step_time_moves_only_when_the_step_advances(api: FakeLeaseApi, now: FakeNow) -> None:
    heartbeat = make(api, now)
    heartbeat.update(step=1)
    first_report = now.now
    now.advance(30)
    heartbeat.update(step=1, phase="generate")  # same step: still stalled since first_report
    heartbeat.renew()
    annotations = api.lease().metadata.annotations
    assert annotations["rlhf.dev/step-time"] == hb.format_time(first_report)
    assert api.lease().spec.renew_time == now.now  # while the lease itself is fresh

    heartbeat.update(step=2)
    heartbeat.renew()
    assert api.lease().metadata.annotations["rlhf.dev/step-time"] == hb.format_time(now.now)


def test_live_and_desired_rollout_engines_are_reported(api: FakeLeaseApi, now: FakeNow) -> None:
    heartbeat = make(api, now)
    heartbeat.update(step=4, rollout_engines="1/2")
    heartbeat.update(step=5)  # left as None: still one of two
    heartbeat.renew()
    assert api.lease().metadata.annotations[LeaseReport.key("rollout_engines")] == "1/2"
    heartbeat.update(rollout_engines="2/2")
    heartbeat.renew()
    assert api.lease().metadata.annotations[LeaseReport.key("rollout_engines")] == "2/2"
    NoopHeartbeat().update(rollout_engines="0/2")  # the same call works without a Lease


def test_update_keeps_fields_left_as_none(api: FakeLeaseApi, now: FakeNow) -> None:
    heartbeat = make(api, now)
    heartbeat.update(step=3, checkpoint_step=2, checkpoint_path="/c/2")
    heartbeat.update(phase="sync")
    progress = heartbeat.progress
    assert (progress.step, progress.phase, progress.checkpoint_step) == (3, "sync", 2)
    assert progress.checkpoint_path == "/c/2"


def test_a_new_holder_counts_as_a_transition(api: FakeLeaseApi, now: FakeNow) -> None:
    api.add_lease(holder="previous-driver")
    heartbeat = make(api, now)
    heartbeat.renew()
    assert api.lease().spec.holder_identity == "driver-0"
    assert api.lease().spec.lease_transitions == 1
    assert api.lease().spec.acquire_time == now.now

    now.advance(10)
    heartbeat.renew()  # same holder: acquisition unchanged
    assert api.lease().spec.lease_transitions == 1
    assert api.lease().spec.acquire_time == now.now - timedelta(seconds=10)


def test_a_new_holder_reports_only_its_own_fields(api: FakeLeaseApi, now: FakeNow) -> None:
    # Seen in CI: the driver after a resize drain inherited its predecessor's saved step, and
    # the operator's next drain read it as this driver's answer.
    earlier = LeaseReport(attempt=1, step=10, checkpoint_saved_step=10, phase="exiting")
    api.add_lease({**earlier.to_annotations(), "team": "a"}, holder="previous-driver")
    heartbeat = make(api, now)
    heartbeat.update(attempt=2, step=10)
    heartbeat.renew()
    annotations = api.lease().metadata.annotations
    reported = LeaseReport.from_annotations(annotations)
    assert reported == LeaseReport(attempt=2, step=10, step_changed=reported.step_changed)
    assert annotations["team"] == "a"


def test_first_holder_is_not_a_transition(api: FakeLeaseApi, now: FakeNow) -> None:
    make(api, now).renew()
    assert api.lease().spec.lease_transitions == 0


def test_a_concurrent_write_is_retried_on_conflict(api: FakeLeaseApi, now: FakeNow) -> None:
    operator_edit = copy.deepcopy(api.lease())
    operator_edit.metadata.annotations = {"owner": "operator"}
    api.before_replace.append(operator_edit)
    heartbeat = make(api, now)
    heartbeat.update(step=5)

    assert heartbeat.renew()
    assert not api.before_replace  # the operator's write happened and caused a 409...
    assert api.replacements == 1  # ...after which the reread-and-replace went through
    assert api.lease().metadata.annotations == {
        "owner": "operator",
        "rlhf.dev/step": "5",
        "rlhf.dev/step-time": hb.format_time(now.now),
    }


def test_api_errors_are_reported_not_raised(
    api: FakeLeaseApi, now: FakeNow, caplog: pytest.LogCaptureFixture
) -> None:
    heartbeat = make(api, now)
    api.fail_next_reads.append(ApiException(status=500, reason="etcd timeout"))
    assert not heartbeat.renew()
    assert isinstance(heartbeat.last_error, ApiException)
    assert "etcd timeout" in caplog.text
    assert heartbeat.renew()
    assert heartbeat.last_error is None

    missing = Heartbeat(api, "no-such-lease", NAMESPACE, now=now)
    assert not missing.renew()
    assert getattr(missing.last_error, "status", None) == 404


def test_renew_time_serialises_as_micro_time_even_on_a_whole_second(
    api: FakeLeaseApi, now: FakeNow
) -> None:
    now.now = now.now.replace(microsecond=0)
    make(api, now).renew()
    body = ApiClient().sanitize_for_serialization(api.lease())
    assert MICRO_TIME.match(body["spec"]["renewTime"]), body["spec"]["renewTime"]
    assert MICRO_TIME.match(body["spec"]["acquireTime"])


def test_background_thread_keeps_renewing_through_failures(api: FakeLeaseApi, now: FakeNow) -> None:
    heartbeat = make(api, now, interval_seconds=0.01)
    api.fail_next_reads.extend([ApiException(status=503), ApiException(status=503)])
    with heartbeat:
        assert heartbeat.running
        heartbeat.update(step=9)
        assert api.wait_for_replacements(3)
    assert not heartbeat.running
    assert heartbeat.renewals >= 3
    assert api.lease().metadata.annotations["rlhf.dev/step"] == "9"


def test_stop_does_not_wait_for_the_interval(api: FakeLeaseApi, now: FakeNow) -> None:
    heartbeat = make(api, now, interval_seconds=3600)
    heartbeat.start()
    assert api.wait_for_replacements(1)  # renews immediately on start
    heartbeat.stop(timeout_seconds=WAIT_SECONDS)
    assert not heartbeat.running
    with pytest.raises(ValueError, match="interval_seconds"):
        make(api, now, interval_seconds=0)


def test_starting_twice_is_an_error(api: FakeLeaseApi, now: FakeNow) -> None:
    heartbeat = make(api, now, interval_seconds=3600)
    with heartbeat, pytest.raises(RuntimeError, match="already started"):
        heartbeat.start()


def test_noop_heartbeat_when_no_lease_is_configured() -> None:
    heartbeat = make_heartbeat(None)
    assert isinstance(heartbeat, NoopHeartbeat)
    with heartbeat:
        heartbeat.update(step=1, phase="generate")
        assert heartbeat.renew()
        assert not heartbeat.running


def test_make_heartbeat_with_a_client(api: FakeLeaseApi) -> None:
    heartbeat = make_heartbeat(NAME, NAMESPACE, interval_seconds=5, attempt=1, client=api)
    assert isinstance(heartbeat, Heartbeat)
    assert (heartbeat.name, heartbeat.namespace, heartbeat.interval_seconds) == (
        NAME,
        NAMESPACE,
        5,
    )
    assert heartbeat.renew()
    assert "/" in (api.lease().spec.holder_identity or "")  # host/pid by default
    assert api.lease().metadata.annotations == {"rlhf.dev/attempt": "1"}


# -- the operator's stop request (a drain) ----------------------------------------------------

REQUESTED = "2025-03-01T12:00:05.000000Z"


def test_a_stop_request_is_acknowledged_and_passed_on_once(api: FakeLeaseApi, now: FakeNow) -> None:
    heard: list[datetime] = []
    heartbeat = make(api, now, on_stop_request=heard.append)
    assert heartbeat.renew()
    assert heard == []  # no request on the Lease yet
    api.lease().metadata.annotations[contract.LEASE_STOP_REQUESTED_AT] = REQUESTED
    assert heartbeat.renew() and heartbeat.renew()
    assert [contract.lease.format_time(t) for t in heard] == [REQUESTED]
    annotations = api.lease().metadata.annotations
    assert annotations[LeaseReport.key("checkpoint_requested_at")] == REQUESTED  # the answer
    assert annotations[contract.LEASE_STOP_REQUESTED_AT] == REQUESTED  # the operator's to remove


def test_a_request_an_earlier_driver_answered_is_not_obeyed(
    api: FakeLeaseApi, now: FakeNow
) -> None:
    api.add_lease({contract.LEASE_STOP_REQUESTED_AT: REQUESTED,
                   LeaseReport.key("checkpoint_requested_at"): REQUESTED})  # fmt: skip
    heard: list[datetime] = []
    heartbeat = make(api, now, on_stop_request=heard.append)
    assert heartbeat.renew() and heartbeat.renew()  # its answer carried, so not seen anew
    assert heard == []
    # A new request (a later drain) is.
    api.lease().metadata.annotations[contract.LEASE_STOP_REQUESTED_AT] = "2025-03-01T13:00:00Z"
    assert make(api, now, on_stop_request=heard.append).renew()
    assert len(heard) == 1


def test_stop_renews_once_more_so_the_last_checkpoint_is_reported(
    api: FakeLeaseApi, now: FakeNow
) -> None:
    heartbeat = make(api, now, interval_seconds=3600)
    heartbeat.start()
    assert api.wait_for_replacements(1)
    heartbeat.update(checkpoint_step=21, checkpoint_saved_step=21)  # written after the last beat
    heartbeat.stop(timeout_seconds=WAIT_SECONDS)
    annotations = api.lease().metadata.annotations
    assert annotations[LeaseReport.key("checkpoint_step")] == "21"
    assert annotations[LeaseReport.key("checkpoint_saved_step")] == "21"
