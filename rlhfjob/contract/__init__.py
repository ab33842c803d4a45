"""What the operator and the trainer agree on, in one place.

The trainer imports nothing from the operator and the operator never imports torch, so every
message that crosses between them is a type here with its encoding next to it:

* `env.PodEnv`: the environment of the Ray pods and of the trainer driver;
* `lease.LeaseReport`: the trainer's progress in the heartbeat Lease's annotations;
* `final_status.FinalStatus` and `ExitCode`: how the driver says why it stopped;
* `reasons`: the operator's public words for restarts and failures;
* `kuberay`: KubeRay's labels and the annotations read on a RayCluster;
* `sandbox`: the job's sandbox pods' protocol (the trainer's tool calls) and their limits (the
  flags the operator gives those pods).

And where checkpoints go and what the Ray job runs, both sides' business.
"""

from __future__ import annotations

import posixpath
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


EXPORT_DIR = "export"
"""Under a job's checkpoint directory (and its bucket prefix): the exported policy."""


def export_dir(job: RLHFJob) -> PurePosixPath:
    """Where the job writes its trained policy as a Hugging Face directory."""
    return checkpoint_dir(job) / EXPORT_DIR


def bucket_prefix(job: RLHFJob) -> str | None:
    """Where one job's checkpoints live in its bucket: ``<prefix><namespace>/<name>/``."""
    store = job.spec.checkpoint.object_store
    if store is None:
        return None
    return f"{store.prefix}{job.metadata.namespace}/{job.metadata.name}/"


def is_job_output(job: RLHFJob, path: str) -> bool:
    """Whether `path` lies in the job's own places: its checkpoint directory, or its prefix of
    its bucket. What a job's pods report elsewhere is not believed."""
    if path.startswith("s3://"):
        store, prefix = job.spec.checkpoint.object_store, bucket_prefix(job)
        inside = f"s3://{store.bucket}/{prefix}" if store is not None else None
        return inside is not None and path.startswith(inside) and ".." not in path.split("/")
    normal = PurePosixPath(posixpath.normpath(path))
    return normal.is_relative_to(checkpoint_dir(job)) and normal.is_absolute()


DEFAULT_ENTRYPOINT = "rlhfjob train"


def train_command(job: RLHFJob, *, resume: bool) -> str:
    """The Ray job entrypoint: the job file comes from $RLHF_JOB_CONFIG in the pod."""
    command = job.spec.entrypoint or DEFAULT_ENTRYPOINT
    return command + (" --resume-from latest" if resume else "")
