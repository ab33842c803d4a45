"""The operator-trainer contract: every message survives its encoding, and an older or newer
writer's message still decodes (a field added or missing is not an error)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from rlhfjob.contract import (
    EngineCount,
    EventReason,
    ExitCode,
    FailureReason,
    FinalStatus,
    LeaseReport,
    PodEnv,
    RestartReason,
)
from rlhfjob.contract.lease import format_time, parse_time

ROOT = Path(__file__).parent.parent
WHEN = datetime(2026, 3, 1, 12, 0, 0, 250000, tzinfo=UTC)

FULL_REPORT = LeaseReport(
    step=12,
    step_changed=WHEN,
    total_steps=40,
    phase="update",
    checkpoint_step=10,
    checkpoint_path="/ckpt/ns/job/step-10",
    attempt=2,
    rollout_engines=EngineCount(1, 2),
    reward_models=EngineCount(2, 3),
    reward_mean=0.75,
    tokens_per_second=1234.5,
)


# -- the pod environment ----------------------------------------------------------------------


def test_pod_env_round_trips() -> None:
    env = PodEnv(job_name="j", job_namespace="ns", role="rollout", job_config="/c", attempt=3)
    assert PodEnv.from_env(env.to_env()) == env


def test_pod_env_names_and_order_are_the_wire_format() -> None:
    pod = PodEnv(job_name="j", job_namespace="ns", role="head", job_config="/etc/rlhfjob/job.yaml")
    assert list(pod.to_env().items()) == [
        ("RLHF_JOB_NAME", "j"),
        ("RLHF_JOB_NAMESPACE", "ns"),
        ("RLHF_ROLE", "head"),
        ("RLHF_JOB_CONFIG", "/etc/rlhfjob/job.yaml"),
    ]
    submission = PodEnv(job_name="j", job_namespace="ns", attempt=0)
    assert submission.to_env() == {
        "RLHF_JOB_NAME": "j",
        "RLHF_JOB_NAMESPACE": "ns",
        "RLHF_ATTEMPT": "0",
    }


def test_pod_env_reads_a_partial_or_foreign_environment() -> None:
    environ = {"RLHF_JOB_NAME": "j", "RLHF_ATTEMPT": "x", "PATH": "/bin", "RLHF_NEW": "1"}
    assert PodEnv.from_env(environ) == PodEnv(job_name="j")
    assert PodEnv.from_env({}) == PodEnv()


# -- the Lease report -------------------------------------------------------------------------


def test_lease_report_round_trips() -> None:
    assert LeaseReport.from_annotations(FULL_REPORT.to_annotations()) == FULL_REPORT
    assert LeaseReport.from_annotations(LeaseReport().to_annotations()) == LeaseReport()


def test_lease_report_annotations_are_the_wire_format() -> None:
    assert FULL_REPORT.to_annotations() == {
        "rlhf.dev/step": "12",
        "rlhf.dev/step-time": "2026-03-01T12:00:00.250000Z",
        "rlhf.dev/total-steps": "40",
        "rlhf.dev/phase": "update",
        "rlhf.dev/checkpoint-step": "10",
        "rlhf.dev/checkpoint-path": "/ckpt/ns/job/step-10",
        "rlhf.dev/attempt": "2",
        "rlhf.dev/rollout-engines": "1/2",
        "rlhf.dev/reward-models": "2/3",
        "rlhf.dev/reward-mean": "0.75",
        "rlhf.dev/tokens-per-second": "1234.5",
    }


def test_the_preemption_acknowledgement_round_trips() -> None:
    ack = LeaseReport(step=30, checkpoint_requested_at=WHEN, checkpoint_saved_step=30)
    assert ack.to_annotations() == {
        "rlhf.dev/step": "30",
        "rlhf.dev/checkpoint-requested-at": "2026-03-01T12:00:00.250000Z",
        "rlhf.dev/checkpoint-saved-step": "30",
    }
    assert LeaseReport.from_annotations(ack.to_annotations()) == ack


def test_an_older_trainers_lease_decodes_with_the_new_fields_missing() -> None:
    older = {"rlhf.dev/step": "5", "rlhf.dev/attempt": "0"}  # before step-time and engines
    assert LeaseReport.from_annotations(older) == LeaseReport(step=5, attempt=0)


def test_a_newer_trainers_lease_decodes_ignoring_what_it_added() -> None:
    newer = {**FULL_REPORT.to_annotations(), "rlhf.dev/some-future-field": "x", "owner": "op"}
    assert LeaseReport.from_annotations(newer) == FULL_REPORT


def test_unreadable_lease_annotations_count_as_missing() -> None:
    garbled = {
        "rlhf.dev/step": "twelve",
        "rlhf.dev/step-time": "yesterday",
        "rlhf.dev/rollout-engines": "1 of 2",
        "rlhf.dev/phase": "generate",
        "rlhf.dev/reward-mean": "high",
    }
    assert LeaseReport.from_annotations(garbled) == LeaseReport(phase="generate")


def test_lease_report_updates_keep_fields_left_as_none() -> None:
    updated = FULL_REPORT.updated(step=13, phase=None, checkpoint_path=None)
    assert updated == LeaseReport(**{**vars(FULL_REPORT), "step": 13})
    with pytest.raises(TypeError):
        FULL_REPORT.updated(stepp=1)  # a misspelt field is an error, not a silent no-op


def test_engine_counts_take_the_wire_form_too() -> None:
    assert LeaseReport(rollout_engines="1/2") == LeaseReport(rollout_engines=EngineCount(1, 2))  # type: ignore[arg-type]
    assert EngineCount(1, 2) == (1, 2)


def test_times_are_written_the_way_kubernetes_writes_them() -> None:
    assert format_time(WHEN) == "2026-03-01T12:00:00.250000Z"
    assert parse_time(format_time(WHEN)) == WHEN
    assert parse_time("2026-03-01T12:00:00Z") == datetime(2026, 3, 1, 12, tzinfo=UTC)
    assert parse_time(None) is None


# -- the final status line --------------------------------------------------------------------


@pytest.mark.parametrize("code", list(ExitCode))
def test_final_status_round_trips(code: ExitCode) -> None:
    status = FinalStatus.of(code, "some message")
    assert FinalStatus.parse(f"log line\n{status.format()}\n") == status
    assert status.code == int(code)


def test_final_status_is_one_line_whatever_the_message() -> None:
    status = FinalStatus.of(ExitCode.NON_RETRYABLE, "reward 'x:y':\n  module not found")
    assert status.format() == (
        "RLHFJOB_FINAL_STATUS code=3 reason=InvalidJob message=reward 'x:y': module not found"
    )
    assert FinalStatus.parse(status.format()) == status


def test_a_final_status_with_fields_added_or_missing_still_decodes() -> None:
    newer = "RLHFJOB_FINAL_STATUS code=1 reason=Failed step=7 message=rank died: message=x"
    assert FinalStatus.parse(newer) == FinalStatus(1, "Failed", "rank died: message=x")
    older = "RLHFJOB_FINAL_STATUS reason=Failed"
    assert FinalStatus.parse(older) == FinalStatus(None, "Failed", "")
    assert FinalStatus.parse("Killed\n") is None


def test_the_last_final_status_wins() -> None:
    first = FinalStatus.of(ExitCode.FAILED, "first").format()
    last = FinalStatus.of(ExitCode.TERMINATED, "last").format()
    assert FinalStatus.parse(f"{first}\n{last}") == FinalStatus.of(ExitCode.TERMINATED, "last")


# -- the public words -------------------------------------------------------------------------


def test_restart_and_failure_reasons_are_the_documented_words() -> None:
    readme = (ROOT / "README.md").read_text()
    shown_elsewhere = {FailureReason.NON_RETRYABLE, FailureReason.INVALID_SPEC}  # in the message
    for reason in {*RestartReason, *FailureReason} - shown_elsewhere:
        assert f"`{reason}`" in readme, reason
    assert RestartReason("TrainerFailed") is RestartReason.TRAINER_FAILED
    assert f"{RestartReason.HEAD_LOST}" == "HeadLost"  # labels and Events get the bare word


def test_event_reasons_are_the_words_the_operator_always_used() -> None:
    # Dashboards and alerts match on these: moving them into the contract renamed none.
    assert {str(reason) for reason in EventReason} == {
        "Provisioning", "Submitted", "Running", "Succeeded", "Suspended", "Resumed",
        "Degraded", "ReplicasRestored", "BelowReplicas", "AllReplicas",
        "Draining", "Drained", "DrainTimedOut", "NodeDrained", "Resizing",
        "Queued", "Admitted", "Preempted", "QuotaReleased", "OperatorOutdated",
        "Evaluated", "Exported", "TrackingUnavailable",
    }  # fmt: skip


def test_the_final_status_carries_no_terminal_colour_codes() -> None:
    ray_error = "RayTaskError(ValueError): \x1b[36mray::RewardModelActor.score()\x1b[39m failed"
    status = FinalStatus.of(ExitCode.FAILED, ray_error)
    assert status.message == "RayTaskError(ValueError): ray::RewardModelActor.score() failed"
    # A line an older trainer wrote with them is read without them.
    line = f"{status.format().split(' message=')[0]} message={ray_error}"
    parsed = FinalStatus.parse(line)
    assert parsed is not None and parsed.message == status.message
