"""The trainer driver: `rlhfjob train --config job.yaml [--resume-from PATH|latest]`.

This is also the Ray job entrypoint the operator submits (the job file then comes from
`$RLHF_JOB_CONFIG`). The process around the training loop (`rlhf_trainer.run.loop`): it reads its
environment and command line once (`rlhf_trainer.run.context.RunContext`), connects to Ray
(`RAY_ADDRESS`, or a local Ray advertising the custom resources of the job's roles) in the job's
own Ray namespace, handles signals, and reports how it ended.

Actors outlive a driver that is killed outright, and the next driver of the same job and spec
resuming from a checkpoint adopts them (`rlhf_trainer.ranks.adoption`): a warm in-place restart
takes seconds instead of a minute. Whenever the driver exits on its own (done, any error, a stop
signal) it kills its job's actors, so the next attempt starts cold and clean.

Exit codes (`rlhfjob.contract.ExitCode`), also written as the last output line
(`RLHFJOB_FINAL_STATUS code=... reason=... message=...`): 0 done; 1 failed (retrying from the
last checkpoint may help); 3 non-retryable (bad config, reward function, dataset or model); 4
stopped by SIGTERM/SIGINT. On the first signal the current step finishes, a checkpoint of it is
written if it has none, and the driver exits; a second signal abandons the step at once. A
checkpoint is never left half-written (see `rlhf_trainer.state.checkpoint`).

This module imports only the standard library and `rlhfjob` at import time, so the CLI stays
fast; torch, Ray and DeepSpeed load when training starts.
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
from types import FrameType
from typing import TYPE_CHECKING

from rlhf_trainer.run import warmstart
from rlhf_trainer.run.context import ENV_METRICS_PORT, RunContext
from rlhfjob import contract
from rlhfjob.api import RLHFJob, RLHFJobSpec, ray_resource
from rlhfjob.config import InvalidJobError, load_job

if TYPE_CHECKING:
    from rlhf_trainer.run.loop import Trainer

logger = logging.getLogger("rlhf_trainer.run.driver")

ExitCode = contract.ExitCode


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
# Ray


def local_ray_resources(spec: RLHFJobSpec) -> dict[str, float]:
    """The role resources a local Ray advertises: replicas x actor slots of each role."""
    from rlhf_trainer.topology import role_ranks

    return {
        ray_resource(role): float(role_ranks(role_spec))
        for role, role_spec in spec.roles.enabled().items()
    }


def connect_ray(job: RLHFJob, context: RunContext) -> bool:
    """Join the cluster at `RAY_ADDRESS`, or start a local Ray; True when this started it.

    The driver works in its job's Ray namespace (`RunContext.ray_namespace`), where its named
    actors live and where a restarted driver finds them.
    """
    import ray

    log_to_driver = context.actor_logs
    namespace = context.ray_namespace(job)
    if context.ray_address:
        ray.init(namespace=namespace, log_to_driver=log_to_driver)
        return False
    ray.init(
        namespace=namespace,
        num_cpus=os.cpu_count() or 1,
        resources=local_ray_resources(job.spec),
        include_dashboard=False,
        log_to_driver=log_to_driver,
    )
    return True


# --------------------------------------------------------------------------------------------
# Entry point


def final_status(code: ExitCode, message: str) -> str:
    """The last line the operator reads (`contract.FinalStatus`)."""
    return contract.FinalStatus.of(code, message).format()


def train(job: RLHFJob, context: RunContext | None = None) -> int:
    """Run one training job; returns the process exit code."""
    import ray

    from rlhf_trainer.ranks.adoption import kill_job_actors
    from rlhf_trainer.rewards.functions import RewardFunctionError
    from rlhf_trainer.run.loop import Trainer
    from rlhf_trainer.run.metrics import serve_metrics
    from rlhf_trainer.run.startup import NonRetryableError, load_inputs
    from rlhf_trainer.sandbox.client import SandboxError

    context = context if context is not None else RunContext()

    stop = StopSignal()
    code, message = ExitCode.FAILED, "unexpected error"
    started_ray = False
    trainer: Trainer | None = None
    try:
        inputs = load_inputs(job.spec, check_model=False)  # the Trainer checks it if it must
        started_ray = connect_ray(job, context)
        stop.install()  # after ray.init, which installs a SIGTERM handler that just exits
        trainer = Trainer(job, inputs, stop.requested, context)
        if context.metrics_port is not None:
            serve_metrics(trainer.metrics.registry, context.metrics_port)
        trainer.restore()
        # For the next attempt, if this one fails; started now, once this one's own start-up
        # (actors, checkpoint) no longer needs the CPU (rlhf_trainer.run.warmstart).
        warmstart.start()
        started, first_step = time.perf_counter(), trainer.step
        finished = trainer.run()
        done = f"{trainer.step - first_step} steps in {time.perf_counter() - started:.0f} s"
        if finished:
            code, message = ExitCode.SUCCEEDED, f"trained to step {trainer.step} ({done})"
        else:
            code = ExitCode.TERMINATED
            by = stop.signal_name or "the operator's request (a drain)"
            message = f"stopped by {by} at step {trainer.step} ({done})"
    except (NonRetryableError, RewardFunctionError, SandboxError) as error:
        # A reward source that breaks while scoring (it raised, a server refused the request
        # with a 4xx), or a sandbox that refuses the job's token, is not fixed by a restart.
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
        # Leaving on its own, the driver takes its actors along (an error may have broken
        # one); only a driver killed outright leaves them for the next attempt to adopt.
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                if trainer is not None:
                    trainer.shutdown()
                kill_job_actors()
        if trainer is not None:
            with contextlib.suppress(Exception):
                trainer.stop_heartbeat()
        if started_ray:
            ray.shutdown()
    print(final_status(code, message), flush=True)
    return int(code)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help=f"the RLHFJob file (default: ${contract.ENV_JOB_CONFIG})")
    parser.add_argument(
        "--resume-from",
        metavar="PATH",
        help="a checkpoint directory, or 'latest' for the newest complete one (if any)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        help=f"serve Prometheus metrics on this port (default: ${ENV_METRICS_PORT}, else none)",
    )


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        context = RunContext.from_env(
            os.environ,
            config=args.config,
            resume_from=args.resume_from,
            metrics_port=args.metrics_port,
        )
    except ValueError as error:  # a number in the environment that is none
        print(f"unreadable environment: {error}", file=sys.stderr)
        print(final_status(ExitCode.NON_RETRYABLE, f"unreadable environment: {error}"), flush=True)
        return int(ExitCode.NON_RETRYABLE)
    if not context.job_config:
        print(f"no job file: pass --config or set ${contract.ENV_JOB_CONFIG}", file=sys.stderr)
        print(final_status(ExitCode.NON_RETRYABLE, "no job file"), flush=True)
        return int(ExitCode.NON_RETRYABLE)
    try:
        job = load_job(context.job_config)
    except InvalidJobError as error:
        print(error, file=sys.stderr)
        print(final_status(ExitCode.NON_RETRYABLE, str(error)), flush=True)
        return int(ExitCode.NON_RETRYABLE)
    code = train(job, context)
    if code in warmstart.JOB_ENDED_CODES:
        warmstart.stop()
    return code
