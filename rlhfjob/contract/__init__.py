"""What the operator and the trainer agree on, in one place.

The trainer imports nothing from the operator and the operator never imports torch, so every
message that crosses between them is a type here with its encoding next to it:

* `env.PodEnv`: the environment of the Ray pods and of the trainer driver;
* `lease.LeaseReport`: the trainer's progress in the heartbeat Lease's annotations;
* `final_status.FinalStatus` and `ExitCode`: how the driver says why it stopped;
* `reasons`: the operator's public words for restarts and failures;
* `kuberay`: KubeRay's labels and the annotations read on a RayCluster.

And where checkpoints go and what the Ray job runs, both sides' business.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from rlhfjob.api import RLHFJob
from rlhfjob.contract.env import (
    ENV_ATTEMPT,
    ENV_JOB_CONFIG,
    ENV_JOB_NAME,
    ENV_JOB_NAMESPACE,
    ENV_ROLE,
    PodEnv,
)
from rlhfjob.contract.final_status import FINAL_STATUS_PREFIX, ExitCode, ExitReason, FinalStatus
from rlhfjob.contract.kuberay import DASHBOARD_ANNOTATION
from rlhfjob.contract.lease import (
    EXIT_GRACE_SECONDS,
    LEASE_STOP_REQUESTED_AT,
    PHASE_EXITING,
    PHASE_STARTING,
    EngineCount,
    LeaseReport,
)
from rlhfjob.contract.reasons import DrainCause, EventReason, FailureReason, RestartReason

__all__ = [
    "DASHBOARD_ANNOTATION",
    "DEFAULT_ENTRYPOINT",
    "ENV_ATTEMPT",
    "ENV_JOB_CONFIG",
    "ENV_JOB_NAME",
    "ENV_JOB_NAMESPACE",
    "ENV_ROLE",
    "EXIT_GRACE_SECONDS",
    "FINAL_STATUS_PREFIX",
    "LEASE_STOP_REQUESTED_AT",
    "PHASE_EXITING",
    "PHASE_STARTING",
    "DrainCause",
    "EngineCount",
    "EventReason",
    "ExitCode",
    "ExitReason",
    "FailureReason",
    "FinalStatus",
    "LeaseReport",
    "PodEnv",
    "RestartReason",
    "checkpoint_dir",
    "train_command",
]


def checkpoint_dir(job: RLHFJob) -> PurePosixPath:
    """Each job checkpoints into its own directory under `spec.checkpoint.path`."""
    return PurePosixPath(job.spec.checkpoint.path) / job.metadata.namespace / job.metadata.name


DEFAULT_ENTRYPOINT = "rlhfjob train"


def train_command(job: RLHFJob, *, resume: bool) -> str:
    """The Ray job entrypoint: the job file comes from $RLHF_JOB_CONFIG in the pod."""
    command = job.spec.entrypoint or DEFAULT_ENTRYPOINT
    return command + (" --resume-from latest" if resume else "")
