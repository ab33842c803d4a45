"""What a researcher sees, keeps and compares of a run: held-out evaluation, experiment
tracking and the exported model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhfjob.api.base import HTTP_URL_PATTERN, ApiModel
from rlhfjob.api.pods import ObjectName
from rlhfjob.cel import CelRule

MLFLOW_SECRET_KEYS = (
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
)
"""The keys of `tracking.mlflow.credentialsSecret`, each optional, read into the driver's
environment under the same names (MLflow's client reads them there)."""
WANDB_SECRET_KEY = "WANDB_API_KEY"
"""The key of `tracking.wandb.apiKeySecret`, read into the driver's environment."""


class EvaluationSpec(ApiModel):
    """A held-out evaluation on the job's rollout engines: before the first step, every
    `intervalSteps` and after the last, scored by the job's reward. Its time is its own phase
    (`evaluate`); results go to the step log, the metrics, the reward curve and the status."""

    source: str | None = Field(default=None, min_length=1, max_length=4096)
    """A held-out dataset in the form of `dataset.source` (JSON lines or Parquet, the same
    `promptField`). Unset: `heldOutPrompts`."""
    held_out_prompts: int | None = Field(default=None, ge=1, le=100000)
    """Hold out this many prompts of `dataset.source` (chosen by `algorithm.seed`), evaluated
    and never trained on. Unset: `source`."""
    interval_steps: int = Field(default=10, ge=1)
    """Evaluate every this many steps (and always before the first and after the last)."""
    greedy: bool = True
    """Score one greedy response per prompt: `score` (the mean reward) and `accuracy` (the
    fraction of prompts whose reward reaches `passThreshold`)."""
    samples: int = Field(default=0, ge=0, le=64)
    """Also sample this many responses per prompt at `temperature`: pass@k (the fraction of
    prompts with a response reaching `passThreshold`) and mean@k. 0: none."""
    temperature: float = Field(default=1.0, gt=0, le=2)
    """Sampling temperature of the `samples`."""
    pass_threshold: float = Field(default=1.0, ge=-1e6, le=1e6)
    """A response passes when its reward is at least this (1 for a 0/1 correctness reward)."""
    max_prompts: int | None = Field(default=None, ge=1, le=100000)
    """Evaluate at most this many prompts of the held-out set (its first ones). Unset: all."""
    max_response_length: int | None = Field(default=None, ge=1, le=1048576)
    """Longest evaluated response in tokens. Unset: `algorithm.maxResponseLength`."""
    data_source_field: str = Field(default="data_source", min_length=1, max_length=256)
    """A record field whose values split the results (one score per value); records without
    it count as `default`."""

    cel_rules = (
        CelRule(
            "has(self.source) != has(self.heldOutPrompts)",
            "set exactly one of evaluation.source and evaluation.heldOutPrompts",
            ".source",
        ),
        CelRule(
            "self.greedy || self.samples > 0",
            "evaluation needs greedy or samples > 0",
            ".samples",
        ),
    )


class MlflowSpec(ApiModel):
    """An MLflow tracking server the run logs to (egress the installation must approve)."""

    tracking_uri: str = Field(max_length=2048, pattern=HTTP_URL_PATTERN)
    """The server's URL, for example `http://mlflow.mlflow.svc:5000`."""
    experiment: str | None = Field(default=None, min_length=1, max_length=256)
    """The experiment's name. Unset: the job's namespace."""
    credentials_secret: ObjectName | None = None
    """A Secret in the job's namespace with MLFLOW_TRACKING_USERNAME and
    MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN, given to the head's container only."""


class WandbSpec(ApiModel):
    """Weights & Biases: online with an API key, else offline files beside the step log."""

    project: str = Field(min_length=1, max_length=128)
    """The W&B project."""
    entity: str | None = Field(default=None, min_length=1, max_length=128)
    """The team or user. Unset: the key's default entity."""
    base_url: str = Field(default="https://api.wandb.ai", max_length=2048, pattern=HTTP_URL_PATTERN)
    """The W&B server (egress the installation must approve, when a key is given)."""
    api_key_secret: ObjectName | None = None
    """A Secret in the job's namespace with WANDB_API_KEY, given to the head's container only.
    Unset: offline mode (files under `<checkpoint dir>/wandb`, to `wandb sync` later)."""


class TrackingSpec(ApiModel):
    """Where the run's metrics go besides the step log: TensorBoard event files always (beside
    the step log, uploaded with checkpoints), MLflow and W&B when set. Every step metric, the
    evaluations, the spec as parameters and a table of sampled responses. A tracker that is down
    never stops training: the driver retries in the background and reports the loss."""

    mlflow: MlflowSpec | None = None
    wandb: WandbSpec | None = None
    table_interval_steps: int = Field(default=10, ge=1)
    """Log a table of sampled prompts, responses and rewards every this many steps."""
    table_rows: int = Field(default=8, ge=0, le=256)
    """Rows of that table. 0: no table."""


class ExportSpec(ApiModel):
    """The trained policy as a plain Hugging Face directory (safetensors, config, tokenizer with
    its chat template, generation config), written at the job's end under
    `<checkpoint dir>/export/` and, with a bucket, uploaded beside the checkpoints."""

    enabled: bool = True
    """Export at the end of training."""
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    """The weights' dtype. Unset: `model.dtype`."""
