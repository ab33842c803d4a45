"""The training loop: a `Trainer` owns one run's actors and turns prompts into policy updates.

One step::

    (re)admit rollout engines -> prompts -> generate (engines) -> rewards
        -> old / reference log-probs and values (ranks) -> advantages (here)
        -> policy and critic update (ranks) -> weight sync (engines)

then, every `checkpoint.intervalSteps`, a checkpoint, and always the heartbeat and the metrics.
Every random choice depends on `algorithm.seed` only (model init, data order, a sampling seed
per step and chunk of prompts), and a checkpoint carries the data position, RNG states,
the model and optimizer state (`rlhf_trainer.state.reshard`) and the policy version, so a resumed
run repeats the uninterrupted one exactly, also when rollout engines were lost and replaced
meanwhile (`rlhf_trainer.rollout.fleet`) and when the actors were adopted from a killed driver (the
checkpoint is loaded into them like into fresh ones). A run that resumes with another number of
ZeRO-3 ranks (`RunContext.zero_ranks`) trains the same global batch and repeats it up to float
rounding (the ranks sum their gradients in another order).

Starting or adopting the actors is `rlhf_trainer.run.startup`'s; what the run takes from its
environment and command line, `rlhf_trainer.run.context.RunContext`; `rlhf_trainer.run.driver` is
the process around it all (CLI, Ray, signals, exit codes).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from torch import Tensor

from rlhf_trainer import topology
from rlhf_trainer.algo.batch import Batch, build_batch
from rlhf_trainer.algo.experience import (
    ESTIMATORS,
    SampledStep,
    StepScores,
    on_response_columns,
)
from rlhf_trainer.algo.formulas import kl_estimate
from rlhf_trainer.algo.losses import REFERENCE_KL, old_logprobs_needed
from rlhf_trainer.data.prompts import DataPosition
from rlhf_trainer.elastic import first_line
from rlhf_trainer.masked import masked_mean
from rlhf_trainer.ranks.group import Scores
from rlhf_trainer.rewards.model import RewardCapacityError
from rlhf_trainer.rollout.fleet import RolloutCapacityError
from rlhf_trainer.run import metrics as m
from rlhf_trainer.run import startup
from rlhf_trainer.run.ahead import BatchAhead
from rlhf_trainer.run.checkpoints import RunCheckpoints, RunState
from rlhf_trainer.run.context import RunContext
from rlhf_trainer.run.curves import EVALUATION_KIND, plot_reward_curve, read_step_log
from rlhf_trainer.run.evaluation import Evaluator, is_due
from rlhf_trainer.run.heartbeat import make_heartbeat
from rlhf_trainer.run.reporting import Reporter, sample_rows
from rlhf_trainer.run.sampling import Sampler
from rlhf_trainer.run.startup import Inputs as Inputs  # re-exported: callers load inputs from here
from rlhf_trainer.run.startup import NonRetryableError as NonRetryableError
from rlhf_trainer.run.startup import check_model_config as check_model_config
from rlhf_trainer.run.startup import load_inputs as load_inputs
from rlhf_trainer.run.steps import StepResult, progress_line, step_result
from rlhf_trainer.state.bucket import TieredCheckpoints
from rlhf_trainer.state.checkpoint import RngState, capture_rng_state, restore_rng_state
from rlhfjob import contract
from rlhfjob.api import AlgorithmSpec, RLHFJob

STEP_LOG = "metrics.jsonl"
REWARD_CURVE = "reward_curve.png"
CAPACITY_LOST = (RolloutCapacityError, RewardCapacityError)
"""A role the steps need fell below its minimum (its pods drained or lost): the trainer ranks
are fine, so the last step trained can still be checkpointed."""


@dataclass(frozen=True)
class StepStart:
    """What a step changes before its update, as it was when the step began: put back when
    the step fails before the update, so the trainer is exactly at its last step again."""

    data: DataPosition
    next_sampled: SampledStep | None
    rng: RngState


def needs_old_logprobs(algorithm: AlgorithmSpec, sampled: SampledStep, version: int) -> bool:
    """Whether the step computes the old log-probs: not when every sample is this policy's and
    the update makes them (`old_logprobs_needed`); a sample of another version needs them."""
    stale = any(v != version for v in sampled.rollout.policy_versions)
    return stale or old_logprobs_needed(algorithm)


def rollout_batch(sampled: SampledStep) -> Batch:
    """The rollout as tensors, with the behaviour's log-probs when the engines gave them."""
    rollout = sampled.rollout
    batch = build_batch(rollout.prompts, rollout.responses, rollout.action_masks)
    if rollout.logprobs:  # the behaviour policy's, for the decoupled objective
        columns = batch.action_mask.shape[1]
        behaviour = on_response_columns(rollout.prompts, rollout.logprobs, columns)
        batch = batch.with_fields(behaviour_logprobs=behaviour)
    return batch


class Trainer:
    """The actors of one run and the training loop over them, in three parts that own their
    state: `sampler` (prompts to scored batches), `ahead` (the batch generated ahead) and
    `checkpoints` (find, restore, save, upload).

    `context` is what the driver read from its environment and command line (a run outside
    the operator without it). With `detached` (the driver's way) the actors outlive this
    process: a later driver of the same job and spec that resumes from a checkpoint adopts
    them instead of starting new ones (`rlhf_trainer.run.startup`); `shutdown` kills them.
    """

    def __init__(
        self,
        job: RLHFJob,
        inputs: Inputs,
        stop: threading.Event,
        context: RunContext | None = None,
        *,
        detached: bool = True,
    ) -> None:
        context = context if context is not None else RunContext()
        self.job, self.spec, self.algorithm = job, job.spec, job.spec.algorithm
        self.inputs, self.stop = inputs, stop
        self.total_steps = topology.total_steps(self.spec, len(inputs.prompts))
        self.run_dir = Path(contract.checkpoint_dir(job))
        self.metrics = m.TrainerMetrics(jsonl_path=self.run_dir / STEP_LOG, attempt=context.attempt)
        self.heartbeat = make_heartbeat(
            context.job_name,
            context.job_namespace,
            interval_seconds=self.spec.liveness.heartbeat_interval_seconds,
            lease_duration_seconds=self.spec.liveness.heartbeat_timeout_seconds,
            attempt=context.attempt,
            total_steps=self.total_steps,
            on_stop_request=self._stop_requested,
        )
        self.reporter = Reporter(job, self.metrics, self.heartbeat, self.run_dir, self.log)
        self.checkpoints = RunCheckpoints(
            TieredCheckpoints.for_job(job, self.run_dir, self.metrics.record_upload),
            self.metrics,
            self.heartbeat,
            self.phase,
            self.log,
            background=self.spec.checkpoint.background,
            total_steps=self.total_steps,
        )
        self.store = self.checkpoints.store
        self.stop_requested_at: datetime | None = None
        """When the operator asked this run to checkpoint and stop (a drain), if it did."""
        self.step = 0
        self.version = 0
        """Policy version: the number of updates so far; every weight sync carries it."""
        self.capacity_lost: Exception | None = None
        """Engines lost after a step's update: the step counts, the run stops after it."""
        resume_from = context.resume_from
        self.resume_checkpoint = self.checkpoints.find(resume_from) if resume_from else None
        self._start_actors(context, detached)
        self.sampler = Sampler(
            self.spec, inputs, self.fleet, self.metrics, self.phase, self.actors.reward_models
        )
        self.ahead = BatchAhead(self.sampler, self.total_steps, self.sync_weights, self.log)
        self.evaluator = None
        if self.spec.evaluation is not None and inputs.held_out:
            self.evaluator = Evaluator(
                self.spec.evaluation, inputs.held_out, self.sampler, inputs.reward, self.phase
            )

    def _start_actors(self, context: RunContext, detached: bool) -> None:
        # Beat from the start: booting the actors can take minutes, and the operator must be
        # able to tell a slow start (heartbeats, step 0) from a dead driver (none).
        self.heartbeat.update(step=self.step, phase=contract.PHASE_STARTING)
        self.heartbeat.start()
        try:
            self.actors = startup.start_actors(
                self.spec,
                total_steps=self.total_steps,
                resume=self.resume_checkpoint is not None,
                detached=detached,
                adopt_timeout_s=context.adopt_timeout_s,
                log=self.log,
                on_engines_change=self._report_engines,
                on_reward_models_change=self._report_reward_models,
                zero_ranks=context.zero_ranks_for(self.spec),
            )
        except BaseException:
            self.heartbeat.stop()
            raise
        self.metrics.record_startup(self.actors.seconds)
        if (counts := self.inputs.prompt_counts) is not None:
            self.metrics.record_dataset(counts.kept, counts.truncated, counts.skipped)
        groups = self.actors.groups
        self.policy, self.reference, self.critic = groups.policy, groups.reference, groups.critic
        self.groups = groups.all()
        self.fleet = self.actors.rollout
        for part in self.inputs.reward.model_parts():
            part.attach(self.actors.reward_models)

    def shutdown(self) -> None:
        """Kill this run's actors (a driver leaving on its own: the next attempt starts cold)."""
        self.ahead.shutdown()
        self.actors.shutdown()

    def _report_engines(self, live: int, desired: int) -> None:
        self.metrics.set_rollout_engines(live, desired)
        self.heartbeat.update(rollout_engines=contract.EngineCount(live, desired))

    def _report_reward_models(self, live: int, desired: int) -> None:
        self.metrics.set_reward_models(live, desired)
        self.heartbeat.update(reward_models=contract.EngineCount(live, desired))

    @property
    def has_reference(self) -> bool:
        """A reference role, or a KL term (then the policy ranks hold the reference)."""
        return self.reference is not None or self.algorithm.kl_coef > 0

    def log(self, message: str) -> None:
        print(f"[{self.job.metadata.name}] {message}", flush=True)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.heartbeat.update(phase=name)
        with self.metrics.time_phase(name):
            yield

    # -- state: restore, save, sync -----------------------------------------------------------

    def restore(self, resume_from: str | None = None) -> None:
        """Load a checkpoint into the ranks (fresh or adopted ones): by default the one given
        to the constructor; a path; or `latest` (the newest complete one; none: start over)."""
        if resume_from is None:
            checkpoint = self.resume_checkpoint
        else:
            checkpoint = self.checkpoints.find(resume_from)
        if checkpoint is None:
            return
        state = self.checkpoints.restore(checkpoint, self.groups)
        self.step, self.version = state.step, state.version
        self.sampler.rewind(state.data)
        self.ahead.next = state.next_sampled

    def save_checkpoint(self, upload: bool = False) -> None:
        """A checkpoint of this step (`RunCheckpoints.save`)."""
        state = RunState(self.step, self.version, self.sampler.data.position, self.ahead.next)
        self.checkpoints.save(state, self.groups, upload)

    def sync_weights(self) -> None:
        with self.phase(m.PHASE_SYNC):
            result = self.fleet.sync(self.version)
        self.metrics.record_weight_sync(result.seconds, result.bytes)

    # -- one step -----------------------------------------------------------------------------

    def run_step(self) -> StepResult:
        """Take a batch -> score -> advantages -> update -> sync -> the step's result."""
        step = self.step + 1
        self.metrics.begin_step()
        with self.phase(m.PHASE_SYNC):
            self.fleet.maintain()  # engines back from a lost node get the weights first
        sampled = self.ahead.take(step, self.version)
        self.ahead.start(step + 1)  # generates while this step scores and updates
        batch = rollout_batch(sampled)
        with_old = needs_old_logprobs(self.algorithm, sampled, self.version)
        with self.phase(m.PHASE_REFERENCE):
            scores = self.actors.groups.score(batch, self.has_reference, with_old)
        with self.phase(m.PHASE_ADVANTAGE):
            batch = batch.with_fields(**self._advantages(sampled.rewards, batch, scores))
        with self.phase(m.PHASE_UPDATE):
            policy_metrics, critic_metrics = self.actors.groups.update(batch)
        kl = policy_metrics.pop(REFERENCE_KL, None)  # the update's, when it made the old ones
        self.version += 1
        try:
            if not self.ahead.after_update():  # it may have synced between segments
                self.sync_weights()
        except CAPACITY_LOST as lost:  # the policy has trained this step: it counts
            self.ahead.lose()
            self.capacity_lost = lost
        self.step = step
        if scores.ref_logprobs is not None and scores.old_logprobs is not None:
            # per-token KL(policy || reference) of the rollout
            per_token = kl_estimate(scores.old_logprobs, scores.ref_logprobs, "k3")
            kl = float(masked_mean(per_token, batch.action_mask))
        result = step_result(step, self.version - 1, sampled, kl, policy_metrics, critic_metrics)
        if self.reporter.table_due(step):
            result.samples = sample_rows(sampled, self.inputs.decode, self.reporter.table_rows)
        return result

    def _advantages(self, rewards: Tensor, batch: Batch, scores: Scores) -> dict[str, Tensor]:
        """The per-row tensors the update needs, advantages included (the algorithm's estimator)."""
        step_scores = StepScores(
            rewards, batch.action_mask, scores.old_logprobs, scores.ref_logprobs, scores.values
        )
        estimated = ESTIMATORS[self.algorithm.name].estimate(step_scores, self.algorithm)
        fields = {} if scores.old_logprobs is None else {"old_logprobs": scores.old_logprobs}
        if scores.ref_logprobs is not None:
            fields["ref_logprobs"] = scores.ref_logprobs
        return fields | estimated

    def record(self, result: StepResult) -> dict[str, Any]:
        """Publish a step: metrics, step log, heartbeat, trackers."""
        return self.reporter.step(result)

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> bool:
        """Train to the last step, or until a stop is requested. Returns whether it finished.

        A stopped run first finishes its step and checkpoints it (unless it just did).
        """
        interval = self.spec.checkpoint.interval_steps
        self.heartbeat.update(step=self.step, phase=m.PHASE_GENERATE)
        self.sync_weights()  # the engines start from other weights (or a stale version)
        if self.step == 0:
            self.evaluate()  # the policy as it starts: the baseline
        while self.step < self.total_steps and not self.stop.is_set():
            self.checkpoints.announce_if_written()  # written beside the last step
            start = StepStart(self.sampler.data.position, self.ahead.next, capture_rng_state())
            try:
                result = self.run_step()
            except CAPACITY_LOST as lost:  # before the update: back to the last step
                self._go_back(start)
                self._leave(lost)
                break  # asked to stop: checkpointed below
            # Log the step before checkpointing it, so every checkpointed step has its line
            # (the checkpoint's own time is counted in the next step's record).
            self.log(progress_line(self.record(result), self.total_steps))
            if self.capacity_lost is not None:  # after the update: the step counts
                after_update, self.capacity_lost = self.capacity_lost, None
                self._leave(after_update)
                break
            self.evaluate()  # when due: the engines hold this step's weights
            if self.step % interval == 0 or self.step == self.total_steps:
                self.save_checkpoint(upload=self.step == self.total_steps)
        self._save_last()
        if self.stop_requested_at is not None:
            self.heartbeat.update(checkpoint_saved_step=self.checkpoints.checkpointed_step)
        finished = self.step >= self.total_steps
        if finished and self.spec.export.enabled:
            with self.phase(m.PHASE_CHECKPOINT):
                self.checkpoints.export(self.spec, contract.export_dir(self.job), self.reporter)
        return finished

    def evaluate(self) -> None:
        """The held-out evaluation of this step's policy, when `spec.evaluation` says it is due:
        into the step log, the metrics, the heartbeat (the status) and the driver's log."""
        if self.evaluator is None or not is_due(self.spec.evaluation, self.step, self.total_steps):
            return
        self.reporter.evaluation(self.evaluator.evaluate(self.step))

    def _save_last(self) -> None:
        """The last step checkpointed (unless it just was), written and in the bucket."""
        if self.step > 0 and self.checkpoints.last_saved_step != self.step:
            self.save_checkpoint(upload=True)
        self.checkpoints.wait()
        self.checkpoints.finish_uploads()

    def _go_back(self, start: StepStart) -> None:
        """A step failed before its update: put back what it took (its prompts, the batch
        generated ahead, the RNG), so the trainer is exactly at its last step again."""
        self.ahead.settle()
        self.sampler.rewind(start.data)
        self.ahead.next = start.next_sampled
        restore_rng_state(start.rng)

    def _leave(self, lost: Exception) -> None:
        """A role the steps need fell below its minimum; the trainer ranks are fine and at
        `step`. Asked to stop (a drain, which evicts the rollout pods on the node at once), the
        run stops there; else it checkpoints that step, then fails (a restart resumes from
        it, losing no step)."""
        self.log(f"no step after {self.step}: {first_line(lost)}")
        if self.stop.is_set():
            return
        try:
            if self.step > 0 and self.checkpoints.last_saved_step != self.step:
                self._save_last()
        except Exception as error:  # the failure to report is the lost capacity
            self.log(f"could not checkpoint step {self.step} on the way out: {error}")
        raise lost

    def _stop_requested(self, when: datetime) -> None:
        """The operator's drain (heartbeat thread): stop like on SIGTERM, after this step."""
        self.stop_requested_at = when
        self.log(f"the operator asked for a checkpoint and a stop: finishing step {self.step + 1}")
        self.stop.set()

    def finish(self) -> None:
        """Say on the Lease that the driver is leaving, and draw the reward curve next to the
        step log. The heartbeat beats on (drawing can take seconds: matplotlib's first import)
        until `stop_heartbeat`, once the actors are down."""
        self.heartbeat.update(phase=contract.PHASE_EXITING)
        self.reporter.close()
        records = read_step_log(self.run_dir / STEP_LOG)
        if records:
            evaluations = read_step_log(self.run_dir / STEP_LOG, EVALUATION_KIND)
            png = plot_reward_curve(
                records, self.run_dir / REWARD_CURVE, self.job.metadata.name, evaluations
            )
            self.log(f"step log {self.run_dir / STEP_LOG}, reward curve {png}")

    def stop_heartbeat(self) -> None:
        """The last renewal (still `exiting`): nothing is left for the driver but to leave."""
        self.heartbeat.stop()
