"""Invalid evaluation, tracking and export settings. Part of
`rlhfjob.invalid_cases.INVALID_CASES`."""

from __future__ import annotations

from rlhfjob.invalid_case import InvalidCase
from rlhfjob.invalid_case import spec_patch as _spec

RESEARCH_CASES: list[InvalidCase] = [
    InvalidCase(
        "evaluation-without-prompts",
        _spec(evaluation={"intervalSteps": 5}),
        "spec.evaluation.source",
        "set exactly one of evaluation.source and evaluation.heldOutPrompts",
    ),
    InvalidCase(
        "evaluation-with-both-prompt-sources",
        _spec(evaluation={"source": "/data/test.jsonl", "heldOutPrompts": 100}),
        "spec.evaluation.source",
        "set exactly one of evaluation.source and evaluation.heldOutPrompts",
    ),
    InvalidCase(
        "evaluation-scoring-nothing",
        _spec(evaluation={"heldOutPrompts": 16, "greedy": False}),
        "spec.evaluation.samples",
        "evaluation needs greedy or samples > 0",
    ),
    InvalidCase(
        "evaluation-interval-zero",
        _spec(evaluation={"heldOutPrompts": 16, "intervalSteps": 0}),
        "spec.evaluation.intervalSteps",
    ),
    InvalidCase(
        "evaluation-too-many-samples",
        _spec(evaluation={"heldOutPrompts": 16, "samples": 65}),
        "spec.evaluation.samples",
    ),
    InvalidCase(
        "mlflow-uri-not-a-url",
        _spec(tracking={"mlflow": {"trackingUri": "mlflow:5000"}}),
        "spec.tracking.mlflow.trackingUri",
    ),
    InvalidCase(
        "wandb-without-project",
        _spec(tracking={"wandb": {"entity": "team"}}),
        "spec.tracking.wandb.project",
    ),
    InvalidCase(
        "tracking-secret-not-a-name",
        _spec(tracking={"wandb": {"project": "p", "apiKeySecret": "Not_A_Name"}}),
        "spec.tracking.wandb.apiKeySecret",
    ),
    InvalidCase(
        "export-dtype-unknown",
        _spec(export={"dtype": "int8"}),
        "spec.export.dtype",
    ),
]
