"""The training loop: a `Trainer` owns one run's actors and turns prompts into policy updates.

One step::

    (re)admit rollout engines -> prompts -> generate (engines) -> rewards
        -> old / reference log-probs and values (ranks) -> advantages (here)
        -> policy and critic update (ranks) -> weight sync (engines)

then, every `checkpoint.intervalSteps`, a checkpoint, and always the heartbeat and the metrics.
Every random choice depends on `algorithm.seed` only (model init, data order, a sampling seed
per step and chunk of prompts), and a checkpoint carries the data position, RNG states,
DeepSpeed model and optimizer state and the policy version, so a resumed run repeats the
uninterrupted one exactly, also when rollout engines were lost and replaced meanwhile
(`rlhf_trainer.fleet`) and when the actors were adopted from a killed driver
(`rlhf_trainer.adoption`: the checkpoint is loaded into them like into fresh ones).

`rlhf_trainer.driver` is the process around it (CLI, Ray, signals, exit codes).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
import torch
from torch import Tensor

from rlhf_trainer import metrics as m
from rlhf_trainer import topology
from rlhf_trainer.actors import CriticWorker, PolicyWorker, ReferenceWorker, WorkerGroup
from rlhf_trainer.adoption import adoption_timeout_s, kill_job_actors, spec_digest, spec_json
from rlhf_trainer.algorithms import kl_estimate, masked_mean
from rlhf_trainer.batch import Batch, build_batch
from rlhf_trainer.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    read_checkpoint,
    restore_rng_state,
)
from rlhf_trainer.colocated import ColocatedRollout
from rlhf_trainer.curves import plot_reward_curve, read_step_log
from rlhf_trainer.data import DataPosition, PromptItem, PromptIterator, load_prompts
from rlhf_trainer.engines import EngineLauncher, ModelSource, engine_id_from_name
from rlhf_trainer.experience import (
    Rollout,
    flatten_completions,
    grpo_advantages,
    ppo_advantages,
)
from rlhf_trainer.fleet import RolloutFleet
from rlhf_trainer.heartbeat import make_heartbeat
from rlhf_trainer.models import model_config
from rlhf_trainer.rewards import RewardFunctionError, RuleReward
from rlhf_trainer.rollout import SamplingParams
from rlhf_trainer.seeds import step_seed
from rlhfjob import contract
from rlhfjob.api import RLHFJob, RLHFJobSpec, RoleSpec

STEP_LOG = "metrics.jsonl"
REWARD_CURVE = "reward_curve.png"
SYNTHETIC_DATASET_SIZE = 1024
"""Prompts drawn for a `synthetic:<task>` dataset."""
SETUP_TIMEOUT_S = 600.0
"""How long actors may take to start (a cold start builds every model)."""
ADOPTED_ENGINE_GRACE_S = 2.0
"""After a warm restart, how long to wait for engines beyond the minimum before training."""


class NonRetryableError(Exception):
    """A problem that retrying cannot fix: the operator fails the job instead of restarting it."""


@dataclass
class Inputs:
    """What a run needs before any actor starts; loading it is where config mistakes show."""

    reward: RuleReward
    prompts: list[PromptItem]


def load_inputs(spec: RLHFJobSpec, *, check_model: bool = True) -> Inputs:
    """The reward function, the prompts and (with `check_model`) the model config;
    NonRetryableError if unusable."""
    if spec.reward.type != "function" or spec.reward.function is None:
        raise NonRetryableError("reward.type model is not supported by this trainer yet")
    try:
        reward = RuleReward.from_spec(spec.reward.function)
        prompts = load_prompts(
            spec.dataset.source,
            spec.dataset.prompt_field,
            synthetic_count=SYNTHETIC_DATASET_SIZE,
            seed=spec.algorithm.seed,
        )
    except (RewardFunctionError, ValueError, OSError) as error:
        raise NonRetryableError(str(error)) from error
    if check_model:
        check_model_config(spec)
    return Inputs(reward=reward, prompts=prompts)


def check_model_config(spec: RLHFJobSpec) -> None:
    """NonRetryableError if the model's config cannot be loaded.

    This imports transformers (seconds): a warm restart skips it, since the attempt that
    started the adopted actors checked the very same spec.
    """
    try:
        model_config(spec.model)
    except (ValueError, OSError) as error:
        raise NonRetryableError(str(error)) from error


def progress_line(record: dict[str, Any], total_steps: int) -> str:
    """One line per step: step/total, reward, KL, losses, step seconds and its slowest phases."""
    width = len(str(total_steps))
    parts = [
        f"step {record['step']:>{width}}/{total_steps}",
        f"reward {record['reward_mean']:.3f} ±{record['reward_std']:.3f}",
    ]
    if record.get("kl") is not None:
        parts.append(f"kl {record['kl']:.4f}")
    if record.get("policy_loss") is not None:
        parts.append(f"loss {record['policy_loss']:+.4f}")
    if record.get("value_loss") is not None:
        parts.append(f"value loss {record['value_loss']:.4f}")
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


@dataclass
class StepResult:
    step: int
    reward_mean: float
    reward_std: float
    kl: float | None
    policy: dict[str, float]
    critic: dict[str, float]
    version_lag: int


class Trainer:
    """The actors of one run and the training loop over them.

    With `detached` (the driver's way) the actors outlive this process: a later driver of the
    same job and spec that resumes from a checkpoint adopts them instead of starting new ones
    (`rlhf_trainer.adoption`); `shutdown` kills them.
    """

    policy: WorkerGroup
    fleet: RolloutFleet | ColocatedRollout

    def __init__(
        self,
        job: RLHFJob,
        inputs: Inputs,
        stop: threading.Event,
        resume_from: str | None = None,
        *,
        detached: bool = True,
    ) -> None:
        spec = job.spec
        self.job = job
        self.spec = spec
        self.algorithm = spec.algorithm
        self.inputs = inputs
        self.stop = stop
        self.detached = detached
        self.total_steps = topology.total_steps(spec, len(inputs.prompts))
        self.run_dir = Path(contract.checkpoint_dir(job))
        self.store = CheckpointStore(self.run_dir, keep_last=spec.checkpoint.keep_last)
        self.data = self._prompt_iterator(DataPosition())
        pod_env = contract.PodEnv.from_env(os.environ)
        self.attempt = pod_env.attempt or 0
        self.metrics = m.TrainerMetrics(jsonl_path=self.run_dir / STEP_LOG, attempt=self.attempt)
        self.heartbeat = make_heartbeat(
            pod_env.job_name,
            pod_env.job_namespace,
            interval_seconds=spec.liveness.heartbeat_interval_seconds,
            lease_duration_seconds=spec.liveness.heartbeat_timeout_seconds,
            attempt=self.attempt,
            total_steps=self.total_steps,
        )
        self.step = 0
        self.version = 0
        """Policy version: the number of updates so far; every weight sync carries it."""
        self.checkpointed_step: int | None = None
        self.resume_checkpoint = self._find_checkpoint(resume_from) if resume_from else None
        self.adopted = 0
        """Actors adopted from the previous attempt (0: a cold start)."""
        self._engine_ids_seen = 0  # above every engine id a previous attempt used
        self._answered_engines = 0  # adopted engines that answered at once
        self.startup_seconds = 0.0
        self.reference: WorkerGroup | None = None
        self.critic: WorkerGroup | None = None
        # Beat from the start: booting the actors can take minutes, and the operator must be
        # able to tell a slow start (heartbeats, step 0) from a dead driver (none).
        self.heartbeat.update(step=self.step, phase="starting")
        self.heartbeat.start()
        try:
            self._start_actors()
        except BaseException:
            self.heartbeat.stop()
            raise

    # -- actors -------------------------------------------------------------------------------

    def _start_actors(self) -> None:
        """Adopt the previous attempt's actors if possible, else start every role at once
        (actors boot and build their engines concurrently)."""
        spec, roles = self.spec, self.spec.roles
        started = time.perf_counter()
        rollout, seed = roles.rollout, self.algorithm.seed
        source = ModelSource.from_spec(spec.model, seed=seed, on_gpu=rollout.gpus > 0)
        self.launcher = EngineLauncher(
            rollout,
            source,
            seed=seed,
            engine_options={"num_threads": 1} if rollout.backend == "hf" else {},
            detached=self.detached,
            tag=spec_digest(spec_json(spec)),
        )
        engines = self._adopt() if self.detached and self.resume_checkpoint is not None else None
        if engines is None:
            check_model_config(spec)
            if self.detached:
                kill_job_actors(self.log)  # whatever an earlier attempt left is not trusted
            self.log("starting actors")
            self._start_groups()
        if rollout.colocated:  # the engines are inside the policy ranks
            for group in self.groups:
                group.wait_ready()
            self.fleet = ColocatedRollout(self.policy, on_change=self._report_engines)
            self._ready(started)
            return
        self.fleet = RolloutFleet(
            self.policy,
            self.launcher.start,
            desired=topology.desired_engines(spec),
            minimum=topology.minimum_engines(spec),
            log=self.log,
            on_change=self._report_engines,
        )
        self._report_engines(0, self.fleet.desired)
        for engine_id, actor in sorted((engines or {}).items()):
            self.fleet.add(engine_id, actor)
        self.fleet.next_id = max(self.fleet.next_id, self._engine_ids_seen)  # names stay unique
        self.fleet.start(max(0, self.fleet.desired - len(self.fleet.starting)))
        for group in self.groups:
            group.wait_ready()
        if engines is not None and self._answered_engines >= max(self.fleet.minimum, 1):
            # Adopted engines answer at once; replacements of missing ones join later.
            self.fleet.wait_ready(SETUP_TIMEOUT_S, grace_s=ADOPTED_ENGINE_GRACE_S)
        else:
            self.fleet.wait_ready(SETUP_TIMEOUT_S)
        self._ready(started)

    def _ready(self, started: float) -> None:
        built = ray.get(self.policy.actors[0].build_report_of.remote())
        host, gpu = built["peak_host_bytes"] / 2**30, built["peak_gpu_bytes"] / 2**30
        self.log(
            f"policy rank 0 built its engines in {built['seconds']:.1f} s "
            f"(peak host memory {host:.1f} GiB, GPU {gpu:.1f} GiB)"
        )
        self.startup_seconds = time.perf_counter() - started
        self.metrics.record_startup(self.startup_seconds)
        how = (
            f"adopted {self.adopted} actors from the previous attempt"
            if self.adopted
            else "started"
        )
        self.log(f"actors ready in {self.startup_seconds:.1f} s ({how})")

    def _start_groups(self) -> None:
        """Start the ZeRO-3 groups; they build their engines while the rollout engines start."""
        spec, roles = self.spec, self.spec.roles
        steps = self.total_steps * self.algorithm.update_epochs
        options: dict[str, Any] = {"setup_timeout_s": SETUP_TIMEOUT_S, "detached": self.detached}
        self.policy = WorkerGroup(PolicyWorker, spec, "trainer", roles.trainer, steps, **options)
        if roles.reference is not None:
            self.reference = WorkerGroup(
                ReferenceWorker, spec, "reference", roles.reference, 0, **options
            )
        if self.algorithm.name == "ppo":
            assert roles.critic is not None  # the API requires it for PPO
            self.critic = WorkerGroup(CriticWorker, spec, "critic", roles.critic, steps, **options)

    def _adopt(self) -> dict[int, Any] | None:
        """The previous attempt's actors, if every ZeRO-3 rank is there and answers in time:
        the groups are set and the live engines returned by id (missing ones are started
        later). None: start cold."""
        spec, roles = self.spec, self.spec.roles
        timeout = adoption_timeout_s()
        names = ray.util.list_named_actors()
        if not names:
            return None
        wanted: list[tuple[str, RoleSpec]] = [("trainer", roles.trainer)]
        if roles.reference is not None:
            wanted.append(("reference", roles.reference))
        if self.algorithm.name == "ppo":
            assert roles.critic is not None
            wanted.append(("critic", roles.critic))
        groups = {}
        for role, role_spec in wanted:
            group = WorkerGroup.adopt(spec, role, role_spec, timeout, SETUP_TIMEOUT_S)
            if group is None:
                self.log(f"the previous attempt's {role} ranks are missing or do not answer")
                return None
            groups[role] = group
        self.policy = groups["trainer"]
        self.reference = groups.get("reference")
        self.critic = groups.get("critic")
        if roles.rollout.colocated:  # the engines came with the policy ranks
            self.adopted = sum(len(g.actors) for g in groups.values())
            self.log(f"adopting {self.adopted} actors from the previous attempt")
            return {}
        candidates = {}
        for name in names:
            engine_id = engine_id_from_name(name)
            if engine_id is not None:
                with contextlib.suppress(ValueError):
                    candidates[engine_id] = ray.get_actor(name)
        self._engine_ids_seen = max(candidates, default=-1) + 1
        refs: dict[int, Any] = {
            engine_id: actor.ping.remote() for engine_id, actor in candidates.items()
        }
        ready = set()
        if refs:
            ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)[0])
        # Engines that answered are adopted; so are those still busy (finishing a generation
        # of the dead driver, say): they join once they answer. Dead ones, and any beyond the
        # desired count, go.
        engines: dict[int, Any] = {}
        self._answered_engines = 0
        for engine_id, ref in sorted(refs.items(), key=lambda item: item[1] not in ready):
            answer: Any = self.launcher.tag
            if ref in ready:
                try:
                    answer = ray.get(ref)
                except ray.exceptions.RayError:
                    answer = None
            if answer == self.launcher.tag and len(engines) < topology.desired_engines(spec):
                engines[engine_id] = candidates[engine_id]
                self._answered_engines += ref in ready
            else:
                ray.kill(candidates[engine_id], no_restart=True)
        self.adopted = sum(len(g.actors) for g in groups.values()) + len(engines)
        self.log(f"adopting {self.adopted} actors from the previous attempt")
        return engines

    def shutdown(self) -> None:
        """Kill this run's actors (a driver leaving on its own: the next attempt starts cold)."""
        fleet: RolloutFleet | ColocatedRollout | None = getattr(self, "fleet", None)
        if fleet is not None:
            fleet.shutdown()
        for group in self.groups:
            with contextlib.suppress(Exception):
                group.shutdown()

    def _report_engines(self, live: int, desired: int) -> None:
        self.metrics.set_rollout_engines(live, desired)
        self.heartbeat.update(rollout_engines=contract.EngineCount(live, desired))

    @property
    def groups(self) -> list[WorkerGroup]:
        policy: WorkerGroup | None = getattr(self, "policy", None)
        return [g for g in (policy, self.reference, self.critic) if g is not None]

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
        refs = [ref for g in self.groups for ref in g.submit("load", str(checkpoint.path))]
        WorkerGroup.wait(refs)
        self.data = self._prompt_iterator(DataPosition.from_json(checkpoint.data_position))
        restore_rng_state(checkpoint.load_rng_state())
        self.step = self.checkpointed_step = checkpoint.step
        self.version = int(checkpoint.extra.get("policy_version", checkpoint.step))
        self.heartbeat.update(
            step=self.step, checkpoint_step=checkpoint.step, checkpoint_path=str(checkpoint.path)
        )

    def save_checkpoint(self) -> None:
        """Every rank writes its DeepSpeed shards into one directory that appears atomically."""
        with self.phase(m.PHASE_CHECKPOINT):
            extra = {"policy_version": self.version, "total_steps": self.total_steps}
            position = self.data.position.to_json()
            with self.store.writing(self.step, data_position=position, extra=extra) as directory:
                WorkerGroup.wait([r for g in self.groups for r in g.submit("save", str(directory))])
        self.checkpointed_step = self.step
        self.metrics.record_checkpoint()
        path = str(self.store.step_dir(self.step))
        self.heartbeat.update(checkpoint_step=self.step, checkpoint_path=path)

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
        rollout = self._generate(step)
        version_lag = self.version - min(rollout.policy_versions)  # 0: fully on-policy
        with self.phase(m.PHASE_REWARD):
            rewards = torch.tensor(
                self.inputs.reward(rollout.prompts, rollout.responses, rollout.metadata)
            )
        batch = build_batch(rollout.prompts, rollout.responses)
        with self.phase(m.PHASE_REFERENCE):
            scores = self._score(batch)
        with self.phase(m.PHASE_ADVANTAGE):
            batch = batch.with_fields(**self._advantages(rewards, batch.action_mask, scores))
        with self.phase(m.PHASE_UPDATE):
            policy_metrics, critic_metrics = self._update(batch)
        self.version += 1
        self.sync_weights()
        self.step = step

        kl = None
        if scores.ref_logprobs is not None:  # per-token KL(policy || reference) of the rollout
            per_token = kl_estimate(scores.old_logprobs, scores.ref_logprobs, "k3")
            kl = float(masked_mean(per_token, batch.action_mask))
        return StepResult(
            step=step,
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std()) if len(rewards) > 1 else 0.0,
            kl=kl,
            policy=policy_metrics,
            critic=critic_metrics,
            version_lag=version_lag,
        )

    def _generate(self, step: int) -> Rollout:
        """This step's prompts, sampled `groupSize` times (GRPO) or once (PPO), seeded by step."""
        algorithm = self.algorithm
        items = [
            replace(item, prompt=item.prompt[-algorithm.max_prompt_length :])
            for item in self.data.next_batch(algorithm.prompts_per_step)
        ]
        sampling = SamplingParams(
            n=algorithm.group_size if algorithm.name == "grpo" else 1,
            temperature=algorithm.temperature,
            top_p=algorithm.top_p,
            max_tokens=algorithm.max_response_length,
            seed=step_seed(algorithm.seed, step),
            logprobs=False,  # the ranks compute the behaviour log-probs (`_score`)
        )
        with self.phase(m.PHASE_GENERATE):
            started = time.perf_counter()
            completions = self.fleet.generate([item.prompt for item in items], sampling)
        rollout = flatten_completions(items, completions)
        self.metrics.record_generation(rollout.num_generated_tokens, time.perf_counter() - started)
        return rollout

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
        """The per-row tensors the update needs, advantages included."""
        fields = {"old_logprobs": scores.old_logprobs}
        if scores.ref_logprobs is not None:
            fields["ref_logprobs"] = scores.ref_logprobs
        kl_inputs = {"logprobs": scores.old_logprobs, "ref_logprobs": scores.ref_logprobs}
        if self.algorithm.name == "grpo":
            fields["advantages"] = grpo_advantages(rewards, self.algorithm, mask=mask, **kl_inputs)
            return fields
        assert scores.values is not None
        advantages, returns = ppo_advantages(
            rewards, scores.values, mask, self.algorithm, **kl_inputs
        )
        return fields | {"advantages": advantages, "returns": returns, "old_values": scores.values}

    def _update(self, batch: Batch) -> tuple[dict[str, float], dict[str, float]]:
        """Policy and critic updates, concurrently; returns their group-wide metrics."""
        batch_ref = ray.put(batch)
        policy = self.policy.submit("train", batch_ref)
        critic = self.critic.submit("train", batch_ref) if self.critic is not None else []
        return WorkerGroup.wait(policy)[0], (WorkerGroup.wait(critic)[0] if critic else {})

    def record(self, result: StepResult) -> dict[str, Any]:
        """Publish a step's metrics, append its JSON line and tell the heartbeat."""
        # Standard fields have their own arguments; the other numbers go to the log only.
        extra = {f"policy_{k}": v for k, v in result.policy.items() if k != "policy_loss"}
        extra |= {k: v for k, v in result.critic.items() if k != "value_loss"}
        record = self.metrics.end_step(
            result.step,
            reward_mean=result.reward_mean,
            reward_std=result.reward_std,
            kl=result.kl,
            policy_loss=result.policy.get("policy_loss"),
            value_loss=result.critic.get("value_loss"),
            policy_version_lag=result.version_lag,
            extra=extra,
        )
        self.heartbeat.update(step=result.step)
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
            # Log the step before checkpointing it, so every checkpointed step has its line
            # (the checkpoint's own time is counted in the next step's record).
            self.log(progress_line(self.record(self.run_step()), self.total_steps))
            if self.step % interval == 0 or self.step == self.total_steps:
                self.save_checkpoint()
        if self.step > 0 and self.checkpointed_step != self.step:
            self.save_checkpoint()
        return self.step >= self.total_steps

    def finish(self) -> None:
        """Stop the heartbeat and draw the reward curve next to the step log."""
        self.heartbeat.stop()
        records = read_step_log(self.run_dir / STEP_LOG)
        if records:
            png = plot_reward_curve(records, self.run_dir / REWARD_CURVE, self.job.metadata.name)
            self.log(f"step log {self.run_dir / STEP_LOG}, reward curve {png}")
