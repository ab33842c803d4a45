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
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import ray
import torch
from torch import Tensor

from rlhf_trainer import topology
from rlhf_trainer.algo.batch import Batch, build_batch
from rlhf_trainer.algo.experience import (
    ESTIMATORS,
    Rollout,
    SampledStep,
    StepScores,
    choose_groups,
    flatten_completions,
    load_sampled,
    on_response_columns,
    save_sampled,
)
from rlhf_trainer.algo.formulas import groups_with_signal, kl_estimate, overlong_penalty
from rlhf_trainer.data.prompts import DataPosition, PromptIterator
from rlhf_trainer.elastic import first_line
from rlhf_trainer.masked import masked_mean
from rlhf_trainer.ranks.actors import CHECKPOINT_WRITES, WorkerGroup
from rlhf_trainer.rewards.model import RewardCapacityError
from rlhf_trainer.rollout.base import SamplingParams, truncate_completions
from rlhf_trainer.rollout.fleet import RolloutCapacityError
from rlhf_trainer.rollout.partial import generate_in_segments
from rlhf_trainer.run import metrics as m
from rlhf_trainer.run import startup
from rlhf_trainer.run.context import RunContext
from rlhf_trainer.run.curves import plot_reward_curve, read_step_log
from rlhf_trainer.run.heartbeat import make_heartbeat
from rlhf_trainer.run.startup import Inputs as Inputs  # re-exported: callers load inputs from here
from rlhf_trainer.run.startup import NonRetryableError as NonRetryableError
from rlhf_trainer.run.startup import check_model_config as check_model_config
from rlhf_trainer.run.startup import load_inputs as load_inputs
from rlhf_trainer.seeds import generation_seed
from rlhf_trainer.state.bucket import TieredCheckpoints
from rlhf_trainer.state.checkpoint import (
    Checkpoint,
    CheckpointError,
    RngState,
    capture_rng_state,
    read_checkpoint,
    restore_rng_state,
)
from rlhfjob import contract
from rlhfjob.api import AlgorithmSpec, RLHFJob

STEP_LOG = "metrics.jsonl"
REWARD_CURVE = "reward_curve.png"
RANKS_KEY = "ranks"
"""Manifest `extra` entry: the ranks of each ZeRO-3 role that wrote the checkpoint."""
NEXT_BATCH_FILE = "next_batch.pt"
"""In a checkpoint of a run with `algorithm.maxStaleness`: the batch generated ahead for the
next step, so that a resumed run trains on exactly what the uninterrupted one would have."""


class WrittenCheckpoint:
    """A checkpoint whose ranks took their snapshots and write them on their own threads: a
    thread of the driver waits for every rank's write, then completes the directory (its
    manifest, the atomic rename, pruning, the upload queue) or, if a write failed, deletes it.
    """

    def __init__(self, step: int, writing: AbstractContextManager[Path], writes: list[Any]):
        self.step = step
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._complete, args=(writing, writes), name=f"checkpoint-{step}", daemon=True
        )
        self._thread.start()

    def _complete(self, writing: AbstractContextManager[Path], writes: list[Any]) -> None:
        try:
            WorkerGroup.wait(writes)
        except BaseException as error:  # a write failed, or a rank died: no checkpoint
            self._error = error
            with contextlib.suppress(BaseException):
                writing.__exit__(type(error), error, error.__traceback__)
            return
        try:
            writing.__exit__(None, None, None)
        except BaseException as error:
            self._error = error

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Until the checkpoint is complete; raises what kept it from completing."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def progress_line(record: dict[str, Any], total_steps: int) -> str:
    """One line per step: step/total, reward, KL, losses, step seconds and its slowest phases."""
    width = len(str(total_steps))
    parts = [
        f"step {record['step']:>{width}}/{total_steps}",
        f"reward {record['reward_mean']:.3f} ±{record['reward_std']:.3f}",
    ]
    components = record.get("reward_components") or {}
    if len(components) > 1:  # what each part of a combined reward scored
        parts[-1] += " (" + ", ".join(f"{n} {v:.3f}" for n, v in components.items()) + ")"
    if record.get("kl") is not None:
        parts.append(f"kl {record['kl']:.4f}")
    if record.get("policy_loss") is not None:
        parts.append(f"loss {record['policy_loss']:+.4f}")
    if record.get("value_loss") is not None:
        parts.append(f"value loss {record['value_loss']:.4f}")
    if record.get("dropped_groups"):  # dynamic sampling
        parts.append(
            f"{record['dropped_groups']} groups dropped in {record['generation_batches']} rollouts"
        )
    slowest = sorted(record.get("phase_seconds", {}).items(), key=lambda item: -item[1])[:3]
    breakdown = ", ".join(f"{name} {seconds:.2f}" for name, seconds in slowest)
    parts.append(f"{record['step_seconds']:.2f} s ({breakdown})")
    return " | ".join(parts)


@dataclass
class Scores:
    """The ranks' view of a rollout: log-probs before the update, the reference's, values."""

    old_logprobs: Tensor
    ref_logprobs: Tensor | None
    values: Tensor | None


def shaped_rewards(rewards: Tensor, rollout: Rollout, algorithm: AlgorithmSpec) -> Tensor:
    """The rewards with DAPO's overlong penalty added, when the spec asks for it."""
    shaping = algorithm.overlong_shaping
    if shaping is None:
        return rewards
    lengths = torch.tensor([len(response) for response in rollout.responses])
    penalty = overlong_penalty(
        lengths, algorithm.max_response_length, shaping.buffer_length, shaping.penalty
    )
    return rewards + penalty


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


@dataclass
class StepResult:
    step: int
    reward_mean: float
    reward_std: float
    kl: float | None
    policy: dict[str, float]
    critic: dict[str, float]
    version_lag: int
    reward_components: dict[str, float] = field(default_factory=dict)
    """Each part's mean score before weighting (one entry for a single-source reward)."""
    sampling: dict[str, int] = field(default_factory=dict)
    """What dynamic sampling did: rollouts generated, groups dropped and refilled."""
    staleness: dict[int, int] = field(default_factory=dict)
    """How many samples lagged the policy by how many updates (`{0: n}` on-policy)."""


class Trainer:
    """The actors of one run and the training loop over them.

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
        spec = job.spec
        context = context if context is not None else RunContext()
        self.job = job
        self.spec = spec
        self.algorithm = spec.algorithm
        self.inputs = inputs
        self.stop = stop
        self.context = context
        self.total_steps = topology.total_steps(spec, len(inputs.prompts))
        self.run_dir = Path(contract.checkpoint_dir(job))
        self.data = self._prompt_iterator(DataPosition())
        self.attempt = context.attempt
        self.metrics = m.TrainerMetrics(jsonl_path=self.run_dir / STEP_LOG, attempt=self.attempt)
        self.store = TieredCheckpoints.for_job(job, self.run_dir, self.metrics.record_upload)
        self.heartbeat = make_heartbeat(
            context.job_name,
            context.job_namespace,
            interval_seconds=spec.liveness.heartbeat_interval_seconds,
            lease_duration_seconds=spec.liveness.heartbeat_timeout_seconds,
            attempt=self.attempt,
            total_steps=self.total_steps,
            on_stop_request=self._stop_requested,
        )
        self.stop_requested_at: datetime | None = None
        """When the operator asked this run to checkpoint and stop (a drain), if it did."""
        self.step = 0
        self.version = 0
        """Policy version: the number of updates so far; every weight sync carries it."""
        self.checkpointed_step: int | None = None
        """The step of the newest complete checkpoint of this run."""
        self.written_checkpoint: WrittenCheckpoint | None = None
        """A background checkpoint not known complete yet (`checkpoint.background`)."""
        self.ahead: Future[SampledStep] | None = None
        """The next step's batch being generated while this step trains (`maxStaleness`)."""
        self.next_sampled: SampledStep | None = None
        """The next step's batch, generated ahead (or read back from the checkpoint)."""
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._update_done = threading.Event()
        """Set once this step's update is done: the batch generated ahead in segments
        (`partialRolloutTokens`) then syncs the weights at its next boundary."""
        self._synced_ahead = False
        """Whether that sync happened (then the step does not sync again); of the batch ahead
        being generated, stale once it was taken."""
        self._segment_sync_s = 0.0
        """Seconds such syncs took, which the generation's token rate leaves out."""
        self.capacity_lost: Exception | None = None
        """Engines lost after a step's update: the step counts, the run stops after it."""
        resume_from = context.resume_from
        self.resume_checkpoint = self._find_checkpoint(resume_from) if resume_from else None
        # Beat from the start: booting the actors can take minutes, and the operator must be
        # able to tell a slow start (heartbeats, step 0) from a dead driver (none).
        self.heartbeat.update(step=self.step, phase=contract.PHASE_STARTING)
        self.heartbeat.start()
        try:
            self.actors = startup.start_actors(
                spec,
                total_steps=self.total_steps,
                resume=self.resume_checkpoint is not None,
                detached=detached,
                adopt_timeout_s=context.adopt_timeout_s,
                log=self.log,
                on_engines_change=self._report_engines,
                on_reward_models_change=self._report_reward_models,
                zero_ranks=context.zero_ranks_for(spec),
            )
        except BaseException:
            self.heartbeat.stop()
            raise
        self.metrics.record_startup(self.actors.seconds)
        if inputs.prompt_counts is not None:
            counts = inputs.prompt_counts
            self.metrics.record_dataset(counts.kept, counts.truncated, counts.skipped)
        groups = self.actors.groups
        self.policy, self.reference, self.critic = groups.policy, groups.reference, groups.critic
        self.groups = groups.all()
        self.fleet = self.actors.rollout
        for part in inputs.reward.model_parts():
            part.attach(self.actors.reward_models)

    def shutdown(self) -> None:
        """Kill this run's actors (a driver leaving on its own: the next attempt starts cold)."""
        if self._ahead_pool is not None:  # a batch generated ahead is of no use now
            self._ahead_pool.shutdown(wait=False, cancel_futures=True)
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

    def _prompt_iterator(self, position: DataPosition) -> PromptIterator:
        return PromptIterator(
            self.inputs.prompts,
            self.algorithm.seed,
            position=position,
            shuffle=self.spec.dataset.shuffle,
        )

    # -- checkpoints and weight sync ----------------------------------------------------------

    def _find_checkpoint(self, resume_from: str) -> Checkpoint | None:
        """A checkpoint path, or `latest` (the newest complete one; None if there is none)."""
        if resume_from == "latest":
            checkpoint = self.store.latest_complete()
            if checkpoint is None:
                self.log(f"no complete checkpoint under {self.run_dir}; starting from step 0")
            return checkpoint
        try:
            return read_checkpoint(Path(resume_from))
        except CheckpointError as error:
            raise NonRetryableError(str(error)) from error

    def restore(self, resume_from: str | None = None) -> None:
        """Load a checkpoint into the ranks (fresh or adopted ones): by default the one given
        to the constructor; a path; or `latest` (the newest complete one; none: start over)."""
        if resume_from is None:
            checkpoint = self.resume_checkpoint
        else:
            checkpoint = self._find_checkpoint(resume_from)
        if checkpoint is None:
            return
        self.log(f"resuming from {checkpoint.path} (step {checkpoint.step})")
        saved_ranks = checkpoint.extra.get(RANKS_KEY, {})
        for group in self.groups:
            saved, now = saved_ranks.get(group.role, group.world_size), group.world_size
            if saved != now:  # rlhf_trainer.state.reshard loads it into any count
                self.log(f"{group.role}: saved by {saved} ranks, loaded into {now}")
        path, step = str(checkpoint.path), checkpoint.step
        WorkerGroup.wait([ref for g in self.groups for ref in g.submit("load", path, step)])
        self.data = self._prompt_iterator(DataPosition.from_json(checkpoint.data_position))
        restore_rng_state(checkpoint.load_rng_state())
        ahead = checkpoint.path / NEXT_BATCH_FILE
        self.next_sampled = load_sampled(ahead) if ahead.exists() else None
        self.step = self.checkpointed_step = checkpoint.step
        self.version = int(checkpoint.extra.get("policy_version", checkpoint.step))
        self.heartbeat.update(
            step=self.step, checkpoint_step=checkpoint.step, checkpoint_path=str(checkpoint.path)
        )

    def save_checkpoint(self, upload: bool = False) -> None:
        """Every rank writes its part of its role's state (`rlhf_trainer.state.reshard`) into one
        directory that appears atomically, and the manifest records each role's ranks; with a
        bucket, it is uploaded in the background when on the upload interval or `upload` says
        so. With `checkpoint.background` the step waits only for the ranks' snapshots (copies
        to host memory): the writes and the completion go on beside training
        (`WrittenCheckpoint`), and the next checkpoint or the run's end waits for them."""
        self.wait_for_checkpoint()
        with self.phase(m.PHASE_CHECKPOINT):
            extra = {
                "policy_version": self.version,
                "total_steps": self.total_steps,
                RANKS_KEY: {group.role: group.world_size for group in self.groups},
            }
            position = self.data.position.to_json()
            writing = self.store.writing(
                self.step, data_position=position, extra=extra, upload=upload
            )
            directory = writing.__enter__()
            try:
                if self.next_sampled is not None:  # generated ahead: part of the state
                    save_sampled(self.next_sampled, directory / NEXT_BATCH_FILE)
                snapshots = [r for g in self.groups for r in g.submit("snapshot", str(directory))]
                WorkerGroup.wait(snapshots)
            except BaseException:
                writing.__exit__(*sys.exc_info())  # removes the directory
                raise
            writes = [
                ref
                for group in self.groups
                for ref in group.submit("wait_saved", concurrency_group=CHECKPOINT_WRITES)
            ]
            self.written_checkpoint = WrittenCheckpoint(self.step, writing, writes)
        if not self.spec.checkpoint.background:
            self.wait_for_checkpoint()

    @property
    def last_saved_step(self) -> int | None:
        """The step of the newest checkpoint taken, complete or still being written."""
        written = self.written_checkpoint
        return written.step if written is not None else self.checkpointed_step

    def wait_for_checkpoint(self) -> None:
        """Wait for the checkpoint being written, if any; then it is the run's newest."""
        written, self.written_checkpoint = self.written_checkpoint, None
        if written is None:
            return
        with self.phase(m.PHASE_CHECKPOINT):
            written.wait()
        self.checkpointed_step = written.step
        self.metrics.record_checkpoint()
        path = str(self.store.step_dir(written.step))
        self.heartbeat.update(checkpoint_step=written.step, checkpoint_path=path)

    def sync_weights(self) -> None:
        with self.phase(m.PHASE_SYNC):
            result = self.fleet.sync(self.version)
        self.metrics.record_weight_sync(result.seconds, result.bytes)

    # -- one step -----------------------------------------------------------------------------

    def run_step(self) -> StepResult:
        step = self.step + 1
        self.metrics.begin_step()
        with self.phase(m.PHASE_SYNC):
            self.fleet.maintain()  # engines back from a lost node get the weights first
        sampled = self._take_sample(step)
        ahead_from = self.data.position
        if self.algorithm.max_staleness and step < self.total_steps:
            self._sample_ahead(step + 1)  # generates while this step scores and updates
        rollout, rewards = sampled.rollout, sampled.rewards
        lags = [self.version - version for version in rollout.policy_versions]
        batch = build_batch(rollout.prompts, rollout.responses)
        if rollout.logprobs:  # the behaviour policy's, for the decoupled objective
            columns = batch.action_mask.shape[1]
            behaviour = on_response_columns(rollout.prompts, rollout.logprobs, columns)
            batch = batch.with_fields(behaviour_logprobs=behaviour)
        with self.phase(m.PHASE_REFERENCE):
            scores = self._score(batch)
        with self.phase(m.PHASE_ADVANTAGE):
            batch = batch.with_fields(**self._advantages(rewards, batch.action_mask, scores))
        with self.phase(m.PHASE_UPDATE):
            policy_metrics, critic_metrics = self._update(batch)
        self.version += 1
        try:
            synced = False
            if self.ahead is not None:  # the engines must be idle to take the new weights
                self._update_done.set()  # (or between segments: `_sync_between_segments`)
                with self.phase(m.PHASE_GENERATE):
                    self.next_sampled, self.ahead = self.ahead.result(), None
                synced = self._synced_ahead
            if not synced:
                self.sync_weights()
        except CAPACITY_LOST as lost:  # the policy has trained this step: it counts
            if self.ahead is not None:  # the batch generated ahead is lost, and its prompts
                self.ahead, self.data = None, self._prompt_iterator(ahead_from)
            self.capacity_lost = lost
        self.step = step

        kl = None
        if scores.ref_logprobs is not None:  # per-token KL(policy || reference) of the rollout
            per_token = kl_estimate(scores.old_logprobs, scores.ref_logprobs, "k3")
            kl = float(masked_mean(per_token, batch.action_mask))
        reported = sampled.task_rewards  # the reward function's, of every sampled response
        return StepResult(
            step=step,
            reward_mean=float(reported.mean()),
            reward_std=float(reported.std()) if len(reported) > 1 else 0.0,
            kl=kl,
            policy=policy_metrics,
            critic=critic_metrics,
            version_lag=max(lags),  # 0: fully on-policy
            reward_components=sampled.reward_components,
            sampling=sampled.report,
            staleness={lag: lags.count(lag) for lag in sorted(set(lags))},
        )

    def _take_sample(self, step: int) -> SampledStep:
        """This step's batch: the one generated ahead, unless a sample in it is older than
        `maxStaleness` allows (an engine that missed a sync), else a new one."""
        sampled, self.next_sampled = self.next_sampled, None
        if sampled is not None:
            oldest = self.version - min(sampled.rollout.policy_versions)
            if oldest <= self.algorithm.max_staleness:
                return sampled
            self.log(f"step {step}: the batch generated ahead is {oldest} updates old; again")
        return self._sample(step)

    def _sample_ahead(self, step: int) -> None:
        """Start generating (and scoring) step `step`'s batch in a thread; the engines keep
        the weights they have, one update behind the step that trains meanwhile (with partial
        rollouts, until that step's update is done)."""
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead")
        self._update_done.clear()
        self._synced_ahead = False
        self.ahead = self._ahead_pool.submit(self._sample, step, ahead=True)

    def _sync_between_segments(self) -> bool:
        """At a segment boundary of the batch generated ahead: once the step's update is done,
        give the engines its weights (once); True from then on."""
        if self._update_done.is_set() and not self._synced_ahead:
            started = time.perf_counter()
            self.sync_weights()
            self._synced_ahead = True
            self._segment_sync_s += time.perf_counter() - started
        return self._synced_ahead

    def _sample(self, step: int, ahead: bool = False) -> SampledStep:
        """This step's rollout and its rewards (with overlong shaping, if the spec asks);
        `ahead`: generated while the step before trains (in segments with partial rollouts).

        With dynamic sampling (DAPO), groups whose rewards are all equal are dropped and
        further prompts sampled, at most `maxGenerationBatches` rollouts in all; groups still
        missing then are filled with dropped ones, so the batch keeps its size.
        """
        algorithm = self.algorithm
        dynamic = algorithm.dynamic_sampling
        group_size = ESTIMATORS[algorithm.name].samples_per_prompt(algorithm)
        rollouts: list[Rollout] = []
        task_rewards: list[Tensor] = []
        rewards: list[Tensor] = []
        breakdowns: list[dict[str, float]] = []
        with_signal = 0
        resumed = 0
        ahead_in_segments = ahead and algorithm.partial_rollout_tokens > 0
        for index in range(dynamic.max_generation_batches if dynamic else 1):
            rollout, resumed_now = self._generate(step, index, ahead)
            resumed += resumed_now
            with self.phase(m.PHASE_REWARD):
                if self.actors.reward_models is not None:
                    self.actors.reward_models.maintain()  # replacements rejoin, without waiting
                scored = torch.tensor(
                    self.inputs.reward(rollout.prompts, rollout.responses, rollout.metadata)
                )
            rollouts.append(rollout)
            task_rewards.append(scored)
            breakdowns.append(dict(self.inputs.reward.last_breakdown))
            rewards.append(shaped_rewards(scored, rollout, algorithm))
            if dynamic is None:
                report = {"resumed_responses": resumed} if ahead_in_segments else {}
                return SampledStep(rollout, rewards[0], scored, breakdowns[0], report)
            with_signal += int(groups_with_signal(rewards[-1], group_size).sum())
            if with_signal >= algorithm.prompts_per_step:
                break
        every_reward = torch.cat(rewards)
        signal = groups_with_signal(every_reward, group_size).tolist()
        groups, refilled = choose_groups(signal, algorithm.prompts_per_step)
        rows = torch.tensor([g * group_size + i for g in groups for i in range(group_size)])
        report = {
            "generation_batches": len(rollouts),
            "dropped_groups": len(signal) - sum(signal),
            "refilled_groups": refilled,
        } | ({"resumed_responses": resumed} if ahead_in_segments else {})
        return SampledStep(
            Rollout.concatenate(rollouts).groups(groups, group_size),
            every_reward[rows],
            torch.cat(task_rewards),
            {name: sum(b[name] for b in breakdowns) / len(breakdowns) for name in breakdowns[0]},
            report,
        )

    def _generate(self, step: int, batch: int = 0, ahead: bool = False) -> tuple[Rollout, int]:
        """The next `promptsPerStep` prompts, each sampled as often as the algorithm asks
        (`groupSize`, ppo once), seeded by step and, with dynamic sampling, rollout `batch`;
        and how many responses resumed under newer weights (partial rollouts, `ahead`)."""
        algorithm = self.algorithm
        items = self.data.next_batch(algorithm.prompts_per_step)  # fitted at load (startup)
        sampling = SamplingParams(
            n=ESTIMATORS[algorithm.name].samples_per_prompt(algorithm),
            temperature=algorithm.temperature,
            top_p=algorithm.top_p,
            max_tokens=algorithm.max_response_length,
            seed=generation_seed(algorithm.seed, step, batch),
            stop_token_ids=self.inputs.stop_token_ids,
            # On-policy the ranks' log-probs before the update are the behaviour's (`_score`);
            # a stale sample's behaviour was the engine's, one update or more before.
            logprobs=algorithm.max_staleness > 0,
        )
        with self.phase(m.PHASE_GENERATE):
            started, synced_before = time.perf_counter(), self._segment_sync_s
            prompts = [item.prompt for item in items]
            resumed = 0
            if ahead and algorithm.partial_rollout_tokens:
                segmented = generate_in_segments(
                    self.fleet.generate,
                    prompts,
                    sampling,
                    algorithm.partial_rollout_tokens,
                    self._sync_between_segments,
                )
                completions, resumed = segmented.completions, segmented.resumed
            else:
                completions = self.fleet.generate(prompts, sampling)
            if algorithm.stop_strings:  # cut after the token that completes a stop string
                assert self.inputs.decode is not None  # start-up refuses stop strings without
                completions = [
                    truncate_completions(group, self.inputs.decode, algorithm.stop_strings)
                    for group in completions
                ]
        rollout = flatten_completions(items, completions)
        seconds = time.perf_counter() - started - (self._segment_sync_s - synced_before)
        self.metrics.record_generation(rollout.num_generated_tokens, seconds)
        return rollout, resumed

    def _score(self, batch: Batch) -> Scores:
        """Old log-probs, reference log-probs and values, computed by the groups side by side."""
        batch_ref = ray.put(batch)
        old = self.policy.submit("logprobs", batch_ref)
        reference: list[Any] = []
        if self.reference is not None:
            reference = self.reference.submit("reference_logprobs", batch_ref)
        elif self.has_reference:
            reference = self.policy.submit("reference_logprobs", batch_ref)
        values = self.critic.submit("values", batch_ref) if self.critic is not None else []
        return Scores(
            old_logprobs=self.policy.unshard(old),
            ref_logprobs=(self.reference or self.policy).unshard(reference) if reference else None,
            values=self.critic.unshard(values) if self.critic is not None else None,
        )

    def _advantages(self, rewards: Tensor, mask: Tensor, scores: Scores) -> dict[str, Tensor]:
        """The per-row tensors the update needs, advantages included (the algorithm's estimator)."""
        step_scores = StepScores(
            rewards, mask, scores.old_logprobs, scores.ref_logprobs, scores.values
        )
        estimated = ESTIMATORS[self.algorithm.name].estimate(step_scores, self.algorithm)
        fields = {"old_logprobs": scores.old_logprobs}
        if scores.ref_logprobs is not None:
            fields["ref_logprobs"] = scores.ref_logprobs
        return fields | estimated

    def _update(self, batch: Batch) -> tuple[dict[str, float], dict[str, float]]:
        """Policy and critic updates, concurrently; returns their group-wide metrics."""
        batch_ref = ray.put(batch)
        policy = self.policy.submit("train", batch_ref)
        critic = self.critic.submit("train", batch_ref) if self.critic is not None else []
        return WorkerGroup.wait(policy)[0], (WorkerGroup.wait(critic)[0] if critic else {})

    def record(self, result: StepResult) -> dict[str, Any]:
        """Publish a step's metrics, append its JSON line and tell the heartbeat."""
        # Standard fields have their own arguments; the other numbers go to the log only.
        extra: dict[str, float | dict[str, int]] = {
            f"policy_{k}": v for k, v in result.policy.items() if k != "policy_loss"
        }
        extra |= {k: v for k, v in result.critic.items() if k != "value_loss"}
        extra |= result.sampling
        if self.algorithm.max_staleness:
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
        return record

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> bool:
        """Train to the last step, or until a stop is requested. Returns whether it finished.

        A stopped run first finishes its step and checkpoints it (unless it just did).
        """
        interval = self.spec.checkpoint.interval_steps
        self.heartbeat.update(step=self.step, phase=m.PHASE_GENERATE)
        self.sync_weights()  # the engines start from other weights (or a stale version)
        while self.step < self.total_steps and not self.stop.is_set():
            if self.written_checkpoint is not None and self.written_checkpoint.done():
                self.wait_for_checkpoint()  # written beside the last step: announce it
            start = StepStart(self.data.position, self.next_sampled, capture_rng_state())
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
            if self.step % interval == 0 or self.step == self.total_steps:
                self.save_checkpoint(upload=self.step == self.total_steps)
        if self.step > 0 and self.last_saved_step != self.step:
            self.save_checkpoint(upload=True)
        self.wait_for_checkpoint()
        self.finish_uploads()
        if self.stop_requested_at is not None:
            self.heartbeat.update(checkpoint_saved_step=self.checkpointed_step)
        return self.step >= self.total_steps

    def _go_back(self, start: StepStart) -> None:
        """A step failed before its update: put back what it took (its prompts, the batch
        generated ahead, the RNG), so the trainer is exactly at its last step again."""
        if self.ahead is not None:  # it draws prompts too: let it end before going back
            with contextlib.suppress(Exception):
                self.ahead.result()
            self.ahead = None
        self.data = self._prompt_iterator(start.data)
        self.next_sampled = start.next_sampled
        restore_rng_state(start.rng)

    def _leave(self, lost: Exception) -> None:
        """A role the steps need fell below its minimum; the trainer ranks are fine and at
        `step`. Asked to stop (a drain, which evicts the rollout pods on the node at once), the
        run stops there; else it checkpoints that step, then fails (a restart resumes from
        it, losing no step)."""
        self.log(f"no step after {self.step}: {first_line(lost)}")
        if self.stop.is_set():
            return
        if self.step > 0 and self.last_saved_step != self.step:
            try:
                self.save_checkpoint(upload=True)
                self.wait_for_checkpoint()
                self.finish_uploads()
            except Exception as error:  # the failure to report is the lost capacity
                self.log(f"could not checkpoint step {self.step} on the way out: {error}")
        raise lost

    def finish_uploads(self) -> None:
        """Before the driver leaves (the end, a drain, SIGTERM), its last checkpoint reaches the
        bucket: queued if the upload interval skipped it, then every upload waited for (a drain
        within its grace period, which the operator enforces)."""
        uploader = self.store.uploader
        if uploader is None or self.checkpointed_step is None:
            return
        if uploader.submitted_step != self.checkpointed_step:
            uploader.submit(self.checkpointed_step)
        with self.phase(m.PHASE_CHECKPOINT):
            self.store.flush()
        self.log(f"checkpoints in the bucket up to step {uploader.uploaded_step}")

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
        records = read_step_log(self.run_dir / STEP_LOG)
        if records:
            png = plot_reward_curve(records, self.run_dir / REWARD_CURVE, self.job.metadata.name)
            self.log(f"step log {self.run_dir / STEP_LOG}, reward curve {png}")

    def stop_heartbeat(self) -> None:
        """The last renewal (still `exiting`): nothing is left for the driver but to leave."""
        self.heartbeat.stop()
