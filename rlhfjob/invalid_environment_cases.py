"""Invalid agentic settings (`spec.environment`). Part of `rlhfjob.invalid_cases.INVALID_CASES`."""

from __future__ import annotations

from rlhfjob.invalid_case import RANDOM_INIT, InvalidCase
from rlhfjob.invalid_case import spec_patch as _spec

SANDBOX = {"urls": ["http://sandbox.team.svc:8470"]}
CALCULATOR = {"name": "multiplication", "tools": ["calculator"], "sandbox": SANDBOX}
"""A valid `environment`: the calculator task, its tool in the team's sandbox."""

ENVIRONMENT_CASES: list[InvalidCase] = [
    InvalidCase(
        "environment-unknown",
        _spec(environment={"name": "chess"}),
        "spec.environment.name",
        "the trainer has no such environment",
    ),
    InvalidCase(
        "environment-name-not-a-factory",
        _spec(environment={"name": "my module:make"}),
        "spec.environment.name",
    ),
    InvalidCase(
        "environment-tools-without-sandbox",
        _spec(environment={"name": "tool-calling", "tools": ["python"]}),
        "spec.environment.sandbox",
        "environment.tools run in a sandbox: set environment.sandbox",
    ),
    InvalidCase(
        "environment-tool-name-with-a-space",
        _spec(environment=CALCULATOR | {"tools": ["my tool"]}),
        "spec.environment.tools[0]",
    ),
    InvalidCase(
        "environment-sandbox-url-not-http",
        _spec(environment=CALCULATOR | {"sandbox": {"urls": ["sandbox:8470"]}}),
        "spec.environment.sandbox.urls[0]",
    ),
    InvalidCase(
        "environment-sandbox-without-urls",
        _spec(environment=CALCULATOR | {"sandbox": {"urls": []}}),
        "spec.environment.sandbox.urls",
    ),
    InvalidCase(
        "environment-max-turns-zero",
        _spec(environment=CALCULATOR | {"maxTurns": 0}),
        "spec.environment.maxTurns",
    ),
    InvalidCase(
        "environment-tool-timeout-zero",
        _spec(environment=CALCULATOR | {"toolTimeoutSeconds": 0}),
        "spec.environment.toolTimeoutSeconds",
    ),
    InvalidCase(
        "environment-with-a-batch-ahead",
        _spec(environment=CALCULATOR, algorithm={"maxStaleness": 1}),
        "spec.algorithm.maxStaleness",
        "spec.environment generates its trajectories on-policy",
    ),
    InvalidCase(
        "environment-with-partial-rollouts",
        _spec(environment=CALCULATOR, algorithm={"maxStaleness": 1, "partialRolloutTokens": 4}),
        "spec.algorithm.maxStaleness",
        "algorithm.maxStaleness (and partialRolloutTokens) cannot be combined with it",
    ),
    InvalidCase(
        "environment-without-a-tokenizer",
        _spec(environment=CALCULATOR, model=RANDOM_INIT),
        "spec.model.tokenizer",
        "spec.environment renders messages with a chat template, which needs a tokenizer",
    ),
    InvalidCase(
        "environment-trajectory-past-the-window",
        _spec(
            environment=CALCULATOR | {"maxTrajectoryTokens": 4096},
            model={
                "policy": None,
                "tokenizer": "/models/tokenizer",
                "randomInit": {"model_type": "llama", "max_position_embeddings": 2048},
            },
        ),
        "spec.environment.maxTrajectoryTokens",
        "algorithm.maxPromptLength + environment.maxTrajectoryTokens exceed",
    ),
]
