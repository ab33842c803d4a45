"""What the operator and the trainer agree on, in one place.

The trainer imports nothing from the operator and the operator never imports torch, so the names
both sides read and write — the heartbeat Lease's annotations, exit codes, environment variables,
where checkpoints go — live here, next to the API.
"""

from __future__ import annotations

from enum import IntEnum
from pathlib import PurePosixPath

from rlhfjob.api import GROUP, RLHFJob

# --- The heartbeat Lease (design decision 4): named after the job, in the job's namespace. -----
LEASE_STEP = f"{GROUP}/step"
LEASE_TOTAL_STEPS = f"{GROUP}/total-steps"
LEASE_CHECKPOINT_STEP = f"{GROUP}/checkpoint-step"
LEASE_CHECKPOINT_PATH = f"{GROUP}/checkpoint-path"
LEASE_PHASE = f"{GROUP}/phase"
LEASE_ATTEMPT = f"{GROUP}/attempt"
LEASE_STEP_TIME = f"{GROUP}/step-time"
"""RFC 3339 time at which `step` last advanced: the operator's evidence of progress."""
LEASE_ROLLOUT_ENGINES = f"{GROUP}/rollout-engines"
"""`<live>/<desired>` rollout engines the trainer generates with (elastic roles, decision 5)."""

# --- Environment of the Ray pods and of the trainer driver. ---------------------------------
ENV_JOB_NAME = "RLHF_JOB_NAME"
ENV_JOB_NAMESPACE = "RLHF_JOB_NAMESPACE"
ENV_ROLE = "RLHF_ROLE"
ENV_JOB_CONFIG = "RLHF_JOB_CONFIG"
"""Path of the job file (the ConfigMap mounted in every pod)."""
ENV_ATTEMPT = "RLHF_ATTEMPT"
"""Which restart this driver is (0 first); written into the Lease so stale writers are ignored."""

# --- Where the local stand-in Ray publishes a RayCluster's dashboard (dev and tests only). ----
DASHBOARD_ANNOTATION = f"{GROUP}/dashboard-address"


class ExitCode(IntEnum):
    """How the trainer driver tells the operator why it stopped (Ray reports the exit code)."""

    SUCCEEDED = 0
    FAILED = 1
    """An unexpected error: retrying from the last checkpoint may help."""
    NON_RETRYABLE = 3
    """Bad config, missing model or dataset, broken reward function: retrying cannot help."""
    TERMINATED = 4
    """Stopped by SIGTERM after a clean shutdown (suspend, preemption)."""


FINAL_STATUS_PREFIX = "RLHFJOB_FINAL_STATUS"
"""The driver's last log line: `RLHFJOB_FINAL_STATUS code=<n> reason=<Reason> message=<text>`."""


def checkpoint_dir(job: RLHFJob) -> PurePosixPath:
    """Each job checkpoints into its own directory under `spec.checkpoint.path`."""
    return PurePosixPath(job.spec.checkpoint.path) / job.metadata.namespace / job.metadata.name


DEFAULT_ENTRYPOINT = "rlhfjob train"


def train_command(job: RLHFJob, *, resume: bool) -> str:
    """The Ray job entrypoint: the job file comes from $RLHF_JOB_CONFIG in the pod."""
    command = job.spec.entrypoint or DEFAULT_ENTRYPOINT
    return command + (" --resume-from latest" if resume else "")
