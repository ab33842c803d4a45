"""The trainer driver: `rlhfjob train --config job.yaml [--resume-from PATH|latest]`.

This is also the Ray job entrypoint the operator submits (the job file then comes from
`$RLHF_JOB_CONFIG`). It connects to Ray (`RAY_ADDRESS`, or a local Ray advertising the custom
resources of the job's roles), starts each role's actors, and runs the loop:

    prompts -> generate -> rewards -> log-probs (old, reference) and values -> advantages
            -> policy (and critic) update -> weight sync -> checkpoint -> heartbeat -> metrics

Everything random is seeded from `spec.algorithm.seed` (model init, data order, a sampling seed
per step), and a checkpoint holds the data position, RNG states, DeepSpeed model and optimizer
state and the policy version, so a resumed run repeats the uninterrupted one exactly.

Exit codes (`rlhfjob.contract.ExitCode`): 0 done; 1 failed (retrying from the last checkpoint
may help); 3 non-retryable (bad config, reward function, dataset or model); 4 stopped by
SIGTERM/SIGINT. On the first signal the current step finishes, a checkpoint of it is written if
it has none, and the driver exits; a second signal abandons the step at once. A checkpoint is
never left half-written (see `rlhf_trainer.checkpoint`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

from rlhfjob import contract
from rlhfjob.api import RLHFJob, RLHFJobSpec, actor_slots, ray_resource
from rlhfjob.config import InvalidJobError, load_job

logger = logging.getLogger("rlhf_trainer.driver")

ExitCode = contract.ExitCode
ENV_METRICS_PORT = "RLHF_TRAINER_METRICS_PORT"
"""Port of the driver's Prometheus endpoint (unset: no endpoint)."""
ENV_ACTOR_LOGS = "RLHF_ACTOR_LOGS"
"""Set to 1 to forward the actors' own logs (DeepSpeed's, mostly) to the driver's output."""
STEP_LOG = "metrics.jsonl"
REWARD_CURVE = "reward_curve.png"
SYNTHETIC_DATASET_SIZE = 1024


class NonRetryableError(Exception):
    """A problem that retrying cannot fix: the operator fails the job instead of restarting it."""


# --------------------------------------------------------------------------------------------
# Signals


class StopSignal:
    """SIGTERM / SIGINT handling: the first asks the loop to stop after the current step, a
    second one abandons the step (raises KeyboardInterrupt where the driver is)."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.signal_name = ""

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.requested.is_set():
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: abandoning the step")
        self.signal_name = signal.Signals(signum).name
        self.requested.set()
        print(f"{self.signal_name}: stopping after the current step", flush=True)


# --------------------------------------------------------------------------------------------
# Setup


@dataclass
class Inputs:
    """What the job needs before any actor starts; loading it is where config mistakes show."""

    reward: Any
    prompts: list[Any]
    max_reward: float | None


def load_inputs(spec: RLHFJobSpec) -> Inputs:
    """The reward function, the prompts and the model config; NonRetryableError if unusable."""
    from rlhf_trainer.data import SYNTHETIC_PREFIX, load_prompts
    from rlhf_trainer.models import model_config
    from rlhf_trainer.rewards import RewardFunctionError, RuleReward
    from rlhf_trainer.tasks import get_task

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
        model_config(spec.model)
        max_reward = None
        if spec.dataset.source.startswith(SYNTHETIC_PREFIX):
            max_reward = get_task(spec.dataset.source.removeprefix(SYNTHETIC_PREFIX)).max_reward
    except (RewardFunctionError, ValueError, OSError) as error:
        raise NonRetryableError(str(error)) from error
    return Inputs(reward=reward, prompts=prompts, max_reward=max_reward)


def local_ray_resources(spec: RLHFJobSpec) -> dict[str, float]:
    """The role resources a local Ray advertises: replicas x actor slots of each role."""
    return {
        ray_resource(role): float(role_spec.replicas * actor_slots(role_spec))
        for role, role_spec in spec.roles.enabled().items()
    }


def connect_ray(spec: RLHFJobSpec) -> bool:
    """Join the cluster at `RAY_ADDRESS`, or start a local Ray; True when this started it."""
    import ray

    log_to_driver = os.environ.get(ENV_ACTOR_LOGS) == "1"
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=log_to_driver)
        return False
    ray.init(
        num_cpus=os.cpu_count() or 1,
        resources=local_ray_resources(spec),
        include_dashboard=False,
        log_to_driver=log_to_driver,
    )
    return True


# --------------------------------------------------------------------------------------------
# The loop


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
class StepResult:
    step: int
    reward_mean: float
    reward_std: float
    kl: float | None
    policy: dict[str, float]
    critic: dict[str, float]
    version_lag: int


class Trainer:
    """The actors of one run and the training loop over them."""

    def __init__(self, job: RLHFJob, inputs: Inputs, stop: threading.Event) -> None:
        from rlhf_trainer.actors import (
            CriticWorker,
            PolicyWorker,
            ReferenceWorker,
            WorkerGroup,
            total_steps,
        )
        from rlhf_trainer.checkpoint import CheckpointStore
        from rlhf_trainer.data import PromptIterator
        from rlhf_trainer.engines import ModelSource, create_rollout_engines
        from rlhf_trainer.fleet import RolloutFleet, WeightSyncLink
        from rlhf_trainer.heartbeat import make_heartbeat
        from rlhf_trainer.metrics import TrainerMetrics

        spec = job.spec
        self.job = job
        self.spec = spec
        self.inputs = inputs
        self.stop = stop
        self.total_steps = total_steps(spec, len(inputs.prompts))
        self.run_dir = Path(contract.checkpoint_dir(job))
        self.store = CheckpointStore(self.run_dir, keep_last=spec.checkpoint.keep_last)
        self.data = PromptIterator(
            inputs.prompts, spec.algorithm.seed, shuffle=spec.dataset.shuffle
        )
        self.metrics = TrainerMetrics(jsonl_path=self.run_dir / STEP_LOG)
        self.heartbeat = make_heartbeat(
            os.environ.get(contract.ENV_JOB_NAME),
            os.environ.get(contract.ENV_JOB_NAMESPACE),
            interval_seconds=spec.liveness.heartbeat_interval_seconds,
            lease_duration_seconds=spec.liveness.heartbeat_timeout_seconds,
            attempt=int(os.environ.get(contract.ENV_ATTEMPT, "0")),
            total_steps=self.total_steps,
        )
        self.step = 0
        self.version = 0
        self.checkpointed_step: int | None = None

        optimizer_steps = self.total_steps * spec.algorithm.update_epochs
        roles = spec.roles
        started = time.perf_counter()
        # Start every role at once: actors boot and build their engines concurrently.
        self.policy = WorkerGroup(PolicyWorker, spec, "trainer", roles.trainer, optimizer_steps)
        self.reference = (
            WorkerGroup(ReferenceWorker, spec, "reference", roles.reference, optimizer_steps)
            if roles.reference is not None
            else None
        )
        self.critic = None
        if spec.algorithm.name == "ppo":
            assert roles.critic is not None  # the API requires it for PPO
            self.critic = WorkerGroup(CriticWorker, spec, "critic", roles.critic, optimizer_steps)
        rollout = roles.rollout
        source = ModelSource.from_spec(
            spec.model, seed=spec.algorithm.seed, on_gpu=rollout.gpus > 0
        )
        options = {"num_threads": 1} if rollout.backend == "hf" else {}
        engines = create_rollout_engines(
            rollout, source, seed=spec.algorithm.seed, engine_options=options
        )
        for group in self.groups:
            group.wait_ready()
        self.fleet = RolloutFleet(engines)
        self.weight_sync = WeightSyncLink(self.policy, engines)
        self.log(f"actors ready in {time.perf_counter() - started:.1f} s")

    @property
    def groups(self) -> list[Any]:
        return [g for g in (self.policy, self.reference, self.critic) if g is not None]

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or self.spec.algorithm.kl_coef > 0

    def log(self, message: str) -> None:
        print(f"[{self.job.metadata.name}] {message}", flush=True)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.heartbeat.update(phase=name)
        with self.metrics.time_phase(name):
            yield

    # -- checkpoints --------------------------------------------------------------------------

    def restore(self, resume_from: str) -> None:
        """Load a checkpoint (a path, or `latest`: the newest complete one, if any)."""
        from rlhf_trainer.checkpoint import CheckpointError, read_checkpoint, restore_rng_state
        from rlhf_trainer.data import DataPosition, PromptIterator

        if resume_from == "latest":
            checkpoint = self.store.latest_complete()
            if checkpoint is None:
                self.log(f"no complete checkpoint under {self.run_dir}; starting from step 0")
                return
        else:
            try:
                checkpoint = read_checkpoint(Path(resume_from))
            except CheckpointError as error:
                raise NonRetryableError(str(error)) from error
        self.log(f"resuming from {checkpoint.path} (step {checkpoint.step})")
        refs = [ref for g in self.groups for ref in g.submit("load", str(checkpoint.path))]
        self.policy.wait(refs)
        self.data = PromptIterator(
            self.inputs.prompts,
            self.spec.algorithm.seed,
            position=DataPosition.from_json(checkpoint.data_position),
            shuffle=self.spec.dataset.shuffle,
        )
        restore_rng_state(checkpoint.load_rng_state())
        self.step = checkpoint.step
        self.version = int(checkpoint.extra.get("policy_version", checkpoint.step))
        self.checkpointed_step = checkpoint.step
        self.heartbeat.update(
            step=self.step, checkpoint_step=checkpoint.step, checkpoint_path=str(checkpoint.path)
        )

    def save_checkpoint(self) -> None:
        from rlhf_trainer.metrics import PHASE_CHECKPOINT

        with self.phase(PHASE_CHECKPOINT):
            extra = {"policy_version": self.version, "total_steps": self.total_steps}
            with self.store.writing(
                self.step, data_position=self.data.position.to_json(), extra=extra
            ) as directory:
                refs = [ref for g in self.groups for ref in g.submit("save", str(directory))]
                self.policy.wait(refs)
        self.checkpointed_step = self.step
        self.metrics.record_checkpoint()
        final = self.store.step_dir(self.step)
        self.heartbeat.update(checkpoint_step=self.step, checkpoint_path=str(final))

    def sync_weights(self) -> None:
        from rlhf_trainer.metrics import PHASE_SYNC

        with self.phase(PHASE_SYNC):
            result = self.weight_sync.sync(self.version)
        self.metrics.record_weight_sync(result.seconds, result.bytes)

    # -- one step -----------------------------------------------------------------------------

    def run_step(self) -> StepResult:
        import ray
        import torch

        from rlhf_trainer import metrics as m
        from rlhf_trainer.algorithms import kl_estimate, masked_mean
        from rlhf_trainer.batch import build_batch
        from rlhf_trainer.experience import (
            flatten_completions,
            grpo_advantages,
            ppo_advantages,
            step_seed,
        )
        from rlhf_trainer.rollout import SamplingParams

        algorithm = self.spec.algorithm
        step = self.step + 1
        self.metrics.begin_step()
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
        )
        with self.phase(m.PHASE_GENERATE):
            started = time.perf_counter()
            completions = self.fleet.generate([item.prompt for item in items], sampling)
        rollout = flatten_completions(items, completions)
        version_lag = self.version - min(rollout.policy_versions)  # 0: fully on-policy
        self.metrics.record_generation(rollout.num_generated_tokens, time.perf_counter() - started)

        with self.phase(m.PHASE_REWARD):
            rewards = torch.tensor(
                self.inputs.reward(rollout.prompts, rollout.responses, rollout.metadata),
                dtype=torch.float32,
            )

        batch = build_batch(rollout.prompts, rollout.responses)
        mask = batch.action_mask
        with self.phase(m.PHASE_REFERENCE):
            batch_ref = ray.put(batch)
            # Launch every forward pass before waiting on any: the groups work side by side.
            pending = [(self.policy, self.policy.submit("logprobs", batch_ref))]
            if self.reference is not None:
                pending.append(
                    (self.reference, self.reference.submit("reference_logprobs", batch_ref))
                )
            elif self.has_reference:
                pending.append((self.policy, self.policy.submit("reference_logprobs", batch_ref)))
            if self.critic is not None:
                pending.append((self.critic, self.critic.submit("values", batch_ref)))
            results = [group.unshard(refs) for group, refs in pending]
            old_logprobs = results.pop(0)
            ref_logprobs = results.pop(0) if self.has_reference else None
            values = results.pop(0) if self.critic is not None else None

        kl = None
        if ref_logprobs is not None:  # per-token KL(policy || reference) of the rollout
            kl = float(masked_mean(kl_estimate(old_logprobs, ref_logprobs, "k3"), mask))

        with self.phase(m.PHASE_ADVANTAGE):
            fields = {"old_logprobs": old_logprobs}
            if ref_logprobs is not None:
                fields["ref_logprobs"] = ref_logprobs
            if algorithm.name == "grpo":
                fields["advantages"] = grpo_advantages(
                    rewards, algorithm, logprobs=old_logprobs, ref_logprobs=ref_logprobs, mask=mask
                )
            else:
                assert values is not None
                advantages, returns = ppo_advantages(
                    rewards,
                    values,
                    mask,
                    algorithm,
                    logprobs=old_logprobs,
                    ref_logprobs=ref_logprobs,
                )
                fields |= {"advantages": advantages, "returns": returns, "old_values": values}
            train_ref = ray.put(batch.with_fields(**fields))

        with self.phase(m.PHASE_UPDATE):
            policy_refs = self.policy.submit("train", train_ref)
            critic_refs = self.critic.submit("train", train_ref) if self.critic else []
            policy_metrics = self.policy.wait(policy_refs)[0]
            critic_metrics = self.policy.wait(critic_refs)[0] if critic_refs else {}
        self.version += 1
        self.sync_weights()
        self.step = step
        return StepResult(
            step=step,
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std()) if len(rewards) > 1 else 0.0,
            kl=kl,
            policy=policy_metrics,
            critic=critic_metrics,
            version_lag=version_lag,
        )

    def record(self, result: StepResult) -> dict[str, Any]:
        # Standard fields go to their own arguments; the rest of the numbers to the log only.
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

    def run(self) -> ExitCode:
        """Train to the last step, or until a stop is requested; checkpoint on the way out."""
        from rlhf_trainer.metrics import PHASE_GENERATE

        interval = self.spec.checkpoint.interval_steps
        self.heartbeat.update(step=self.step, phase=PHASE_GENERATE)
        self.heartbeat.start()
        self.sync_weights()  # the engines start from other weights (or a stale version)
        while self.step < self.total_steps and not self.stop.is_set():
            result = self.run_step()
            if self.step % interval == 0 or self.step == self.total_steps:
                self.save_checkpoint()
            self.log(progress_line(self.record(result), self.total_steps))
        if self.stop.is_set():
            if self.step > 0 and self.checkpointed_step != self.step:
                self.save_checkpoint()
            return ExitCode.TERMINATED
        return ExitCode.SUCCEEDED

    def finish(self) -> None:
        from rlhf_trainer.curves import plot_reward_curve, read_step_log

        self.heartbeat.stop()
        records = read_step_log(self.run_dir / STEP_LOG)
        if records:
            png = plot_reward_curve(records, self.run_dir / REWARD_CURVE, self.job.metadata.name)
            self.log(f"step log {self.run_dir / STEP_LOG}, reward curve {png}")


# --------------------------------------------------------------------------------------------
# Entry point


def final_status(code: ExitCode, message: str) -> str:
    """The last line the operator reads (`contract.FINAL_STATUS_PREFIX`)."""
    reason = {
        ExitCode.SUCCEEDED: "Succeeded",
        ExitCode.FAILED: "Failed",
        ExitCode.NON_RETRYABLE: "InvalidJob",
        ExitCode.TERMINATED: "Terminated",
    }[code]
    message = " ".join(message.split())
    return f"{contract.FINAL_STATUS_PREFIX} code={int(code)} reason={reason} message={message}"


def train(job: RLHFJob, resume_from: str | None = None, metrics_port: int | None = None) -> int:
    """Run one training job to completion; returns the process exit code."""
    import ray

    stop = StopSignal()
    code, message = ExitCode.FAILED, "unexpected error"
    started_ray = False
    trainer: Trainer | None = None
    try:
        inputs = load_inputs(job.spec)
        started_ray = connect_ray(job.spec)
        stop.install()  # after ray.init, which installs a SIGTERM handler that just exits
        trainer = Trainer(job, inputs, stop.requested)
        if metrics_port is not None:
            from rlhf_trainer.metrics import serve_metrics

            serve_metrics(trainer.metrics.registry, metrics_port)
        if resume_from:
            trainer.restore(resume_from)
        started, first_step = time.perf_counter(), trainer.step
        code = trainer.run()
        done = f"{trainer.step - first_step} steps in {time.perf_counter() - started:.0f} s"
        if code == ExitCode.TERMINATED:
            message = f"stopped by {stop.signal_name} at step {trainer.step} ({done})"
        else:
            message = f"trained to step {trainer.step} ({done})"
    except NonRetryableError as error:
        code, message = ExitCode.NON_RETRYABLE, str(error)
    except KeyboardInterrupt as error:
        code, message = ExitCode.TERMINATED, str(error) or "interrupted"
    except Exception as error:
        logger.exception("training failed")
        code, message = ExitCode.FAILED, f"{type(error).__name__}: {error}"
    finally:
        if trainer is not None:
            with contextlib.suppress(Exception):
                trainer.finish()
        if started_ray:
            ray.shutdown()
    print(final_status(code, message), flush=True)
    return int(code)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=os.environ.get(contract.ENV_JOB_CONFIG),
        help=f"the RLHFJob file (default: ${contract.ENV_JOB_CONFIG})",
    )
    parser.add_argument(
        "--resume-from",
        metavar="PATH",
        help="a checkpoint directory, or 'latest' for the newest complete one (if any)",
    )
    port = os.environ.get(ENV_METRICS_PORT)
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(port) if port else None,
        help=f"serve Prometheus metrics on this port (default: ${ENV_METRICS_PORT}, else none)",
    )


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not args.config:
        print(f"no job file: pass --config or set ${contract.ENV_JOB_CONFIG}", file=sys.stderr)
        print(final_status(ExitCode.NON_RETRYABLE, "no job file"), flush=True)
        return int(ExitCode.NON_RETRYABLE)
    try:
        job = load_job(args.config)
    except InvalidJobError as error:
        print(error, file=sys.stderr)
        print(final_status(ExitCode.NON_RETRYABLE, str(error)), flush=True)
        return int(ExitCode.NON_RETRYABLE)
    return train(job, args.resume_from, args.metrics_port)
