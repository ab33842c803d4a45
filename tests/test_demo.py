"""The demo's live line: phase and step, with the reward and throughput the status reports."""

from __future__ import annotations

from rlhf_local.demo import _status_line


def test_the_live_line_shows_reward_and_tokens_per_second_beside_phase_and_step() -> None:
    status = {
        "phase": "Running", "currentStep": 12, "totalSteps": 40, "restartCount": 1,
        "lastCheckpoint": {"step": 10, "path": "/c/10"},
        "progress": {"rewardMean": 0.8125, "tokensPerSecond": 1534.4, "stepsPerSecond": 0.5},
    }  # fmt: skip
    line = _status_line({"status": status})
    assert "phase=Running" in line and "step=12/40" in line
    assert "reward=0.812" in line and "tokens/s=1534" in line
    assert "restarts=1" in line and "checkpoint=10" in line


def test_the_live_line_before_the_first_step() -> None:
    line = _status_line({"status": {"phase": "Provisioning"}})
    assert "reward=- tokens/s=-" in line
