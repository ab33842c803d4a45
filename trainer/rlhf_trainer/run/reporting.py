"""Where a run's numbers go: the Prometheus series and the JSON step log, the Lease (the
operator's status), the driver's log, and the experiment trackers (`spec.tracking`).

One `Reporter` per run, so each step, evaluation and export is published the same way to all of
them. A tracker never costs a step: its calls only enqueue (`rlhf_trainer.run.tracking`); calls
it gives up are counted in a series and on the Lease, from which the operator makes an Event.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_trainer.algo.experience import SampledStep
from rlhf_trainer.run import metrics as m
from rlhf_trainer.run.evaluation import headline
from rlhf_trainer.run.heartbeat import Heartbeat, NoopHeartbeat
from rlhf_trainer.run.steps import StepResult
from rlhf_trainer.run.tracking import Tracker, TrackingConfig
from rlhfjob.api import RLHFJob

TRACKER_CLOSE_TIMEOUT_S = 30.0
"""How long the driver's exit waits for the trackers to flush."""


def tracking_config(job: RLHFJob, run_dir: Path) -> TrackingConfig:
    """`spec.tracking` for the trackers: a run named after the job and its UID (a restart
    resumes it; a new job of the same name gets its own), MLflow's experiment after the
    namespace unless named."""
    tracking = job.spec.tracking.model_dump(by_alias=True, exclude_none=True, mode="json")
    if "mlflow" in tracking:
        tracking["mlflow"].setdefault("experiment", job.metadata.namespace)
    meta = job.metadata
    name = f"{meta.name}-{meta.uid[:8]}" if meta.uid else meta.name
    return TrackingConfig.from_spec(tracking, run_dir=run_dir, run_name=name, run_id=meta.uid)


def sample_rows(
    sampled: SampledStep, decode: Callable[[list[int]], str] | None, count: int
) -> list[dict[str, Any]]:
    """The first `count` responses of a step as a table: prompt, response, reward (text with
    the job's tokenizer, else token ids)."""
    rollout = sampled.rollout
    show = decode or (lambda ids: " ".join(map(str, ids)))
    return [
        {
            "prompt": show(rollout.prompts[row]),
            "response": show(rollout.responses[row]),
            "reward": float(sampled.task_rewards[row]),
        }
        for row in range(min(count, len(rollout.responses)))
    ]


class Reporter:
    """Publishes steps, evaluations and the export of one run everywhere they go."""

    def __init__(
        self,
        job: RLHFJob,
        metrics: m.TrainerMetrics,
        heartbeat: Heartbeat | NoopHeartbeat,
        run_dir: Path,
        log: Callable[[str], None],
    ) -> None:
        self.metrics = metrics
        self.heartbeat = heartbeat
        self.log = log
        self.with_staleness = job.spec.algorithm.max_staleness > 0
        self._failures = 0
        self._lock = threading.Lock()
        config = tracking_config(job, run_dir)
        self.table_rows = config.table_rows
        self.tracker = Tracker(config, on_failure=self._tracker_failed)
        self.tracker.log_params(job.spec.model_dump(by_alias=True, exclude_none=True, mode="json"))
        log(f"tracking to {', '.join(self.tracker.backends)}")

    def table_due(self, step: int) -> bool:
        return self.table_rows > 0 and self.tracker.table_due(step)

    def step(self, result: StepResult) -> dict[str, Any]:
        """Publish a step's metrics, append its JSON line and tell the heartbeat and the
        trackers; the step's record."""
        # Standard fields have their own arguments; the other numbers go to the log only.
        extra: dict[str, float | dict[str, int]] = {
            f"policy_{k}": v for k, v in result.policy.items() if k != "policy_loss"
        }
        extra |= {k: v for k, v in result.critic.items() if k != "value_loss"}
        extra |= result.sampling
        if self.with_staleness:
            extra["staleness"] = {str(lag): count for lag, count in result.staleness.items()}
        record = self.metrics.end_step(
            result.step,
            reward_mean=result.reward_mean,
            reward_std=result.reward_std,
            kl=result.kl,
            policy_loss=result.policy.get("policy_loss"),
            value_loss=result.critic.get("value_loss"),
            policy_version_lag=result.version_lag,
            reward_components=result.reward_components,
            extra=extra,
        )
        self.heartbeat.update(
            step=result.step,
            reward_mean=result.reward_mean,
            tokens_per_second=record["generated_tokens_per_second"],
        )
        self.tracker.log_metrics(result.step, record)
        if result.samples:
            self.tracker.log_table(result.step, result.samples)
        return record

    def evaluation(self, evaluated: dict[str, Any]) -> dict[str, Any]:
        """A held-out evaluation: the step log and series, the Lease, the trackers, the log."""
        record = self.metrics.record_evaluation(evaluated)
        figures = m.evaluation_figures(record)
        self.heartbeat.update(
            eval_step=record["step"],
            eval_score=figures.get("score"),
            eval_accuracy=figures.get("accuracy"),
            eval_pass_at_k=next((v for k, v in figures.items() if k.startswith("pass@")), None),
        )
        by_source = {
            f"eval/{source}/{name}": value
            for source, values in (record.get("by_source") or {}).items()
            for name, value in values.items()
        }
        tracked = {f"eval/{name}": value for name, value in figures.items()} | by_source
        self.tracker.log_metrics(record["step"], tracked)
        self.log(headline(record))
        return record

    def exported(self, step: int, path: str) -> None:
        self.heartbeat.update(export_step=step, export_path=path)
        self.log(f"policy of step {step} exported to {path}")

    def close(self, failed: bool = False) -> None:
        """Flush the trackers (bounded: a tracker that is down does not hold the exit)."""
        if not self.tracker.close(TRACKER_CLOSE_TIMEOUT_S, failed=failed):
            self.log("tracking: not every tracker flushed before the driver left")

    def _tracker_failed(self, backend: str, error: str) -> None:
        with self._lock:
            self._failures += 1
            failures = self._failures
        self.metrics.record_tracking_failure(backend)
        self.heartbeat.update(tracking_failures=failures)
        self.log(f"tracking: {backend} gave up a call ({error}); training goes on")
