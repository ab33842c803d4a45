"""Invalid rewards: each reward type and what it needs. Part of
`rlhfjob.invalid_cases.INVALID_CASES`."""

from __future__ import annotations

from rlhfjob.invalid_case import InvalidCase
from rlhfjob.invalid_case import spec_patch as _spec

REWARD_CASES: list[InvalidCase] = [
    # --- The reward: its type and what each type needs.
    InvalidCase("reward-missing", _spec(reward=None), "spec.reward"),
    InvalidCase(
        "reward-function-missing",
        _spec(reward={"function": None}),
        "spec.reward.function",
        "type function needs function (module:function)",
    ),
    InvalidCase(
        "reward-function-malformed",
        _spec(reward={"function": "just a name"}),
        "spec.reward.function",
    ),
    InvalidCase(
        "reward-model-without-role",
        _spec(reward={"type": "model", "function": None}),
        "spec.reward",
        "reward.type model needs roles.reward and model.reward",
    ),
    InvalidCase(
        "reward-model-component-without-role",
        _spec(
            reward={
                "type": "combined",
                "function": None,
                "components": [{"function": "tasks:score"}, {"type": "model", "weight": 0.5}],
            }
        ),
        "spec.reward",
        "reward.type model needs roles.reward and model.reward",
    ),
    InvalidCase(
        "reward-remote-without-url",
        _spec(reward={"type": "remote", "function": None}),
        "spec.reward.remote",
        "type remote needs remote (url)",
    ),
    InvalidCase(
        "reward-remote-url-not-http",
        _spec(reward={"type": "remote", "function": None, "remote": {"url": "ftp://rm/score"}}),
        "spec.reward.remote.url",
    ),
    InvalidCase(
        "reward-remote-zero-concurrency",
        _spec(
            reward={
                "type": "remote",
                "function": None,
                "remote": {"url": "http://rm:8000/score", "maxConcurrency": 0},
            }
        ),
        "spec.reward.remote.maxConcurrency",
    ),
    InvalidCase(
        "reward-remote-timeout-too-long",
        _spec(
            reward={
                "type": "remote",
                "function": None,
                "remote": {"url": "http://rm:8000/score", "timeoutSeconds": 3601},
            }
        ),
        "spec.reward.remote.timeoutSeconds",
    ),
    InvalidCase(
        "reward-combined-without-components",
        _spec(reward={"type": "combined", "function": None}),
        "spec.reward.components",
        "type combined needs components",
    ),
    InvalidCase(
        "reward-components-without-combined",
        _spec(reward={"components": [{"function": "tasks:score"}]}),
        "spec.reward.components",
        "components must be empty unless type is combined",
    ),
    InvalidCase(
        "reward-component-remote-without-url",
        _spec(reward={"type": "combined", "function": None, "components": [{"type": "remote"}]}),
        "spec.reward.components[0].remote",
        "type remote needs remote (url)",
    ),
]
