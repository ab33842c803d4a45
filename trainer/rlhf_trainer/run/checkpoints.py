"""The run's checkpoints: finding one to resume from, restoring it, saving, uploading.

A checkpoint is one directory that appears atomically (`rlhf_trainer.state.checkpoint`) holding
each rank's part of its role's state (`rlhf_trainer.state.reshard`), the data position, the RNG
states, the policy version and, with `maxStaleness`, the batch generated ahead; with a bucket it
is uploaded in the background (`rlhf_trainer.state.bucket`). `RunCheckpoints` owns all of that,
so the loop only says when.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from rlhf_trainer.algo.experience import SampledStep, load_sampled, save_sampled
from rlhf_trainer.data.prompts import DataPosition
from rlhf_trainer.ranks.actors import CHECKPOINT_WRITES
from rlhf_trainer.ranks.group import WorkerGroup
from rlhf_trainer.run import metrics as m
from rlhf_trainer.run.heartbeat import Heartbeat, NoopHeartbeat
from rlhf_trainer.run.reporting import Reporter
from rlhf_trainer.run.sampling import Phase
from rlhf_trainer.run.startup import NonRetryableError
from rlhf_trainer.state.bucket import TieredCheckpoints
from rlhf_trainer.state.checkpoint import (
    Checkpoint,
    CheckpointError,
    read_checkpoint,
    restore_rng_state,
)
from rlhfjob.api import RLHFJobSpec
from rlhfjob.contract import EXPORT_DIR

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


@dataclass(frozen=True)
class RunState:
    """What a checkpoint saves of the run besides the ranks' state, and restores."""

    step: int
    version: int
    """Policy version: the number of updates so far; every weight sync carries it."""
    data: DataPosition
    next_sampled: SampledStep | None = None


class RunCheckpoints:
    """Finds, restores, saves and uploads one run's checkpoints."""

    def __init__(
        self,
        store: TieredCheckpoints,
        metrics: m.TrainerMetrics,
        heartbeat: Heartbeat | NoopHeartbeat,
        phase: Phase,
        log: Callable[[str], None],
        *,
        background: bool,
        total_steps: int,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.heartbeat = heartbeat
        self.phase = phase
        self.log = log
        self.background = background
        self.total_steps = total_steps
        self.checkpointed_step: int | None = None
        """The step of the newest complete checkpoint of this run."""
        self.written: WrittenCheckpoint | None = None
        """A background checkpoint not known complete yet (`checkpoint.background`)."""

    def find(self, resume_from: str) -> Checkpoint | None:
        """A checkpoint path, or `latest` (the newest complete one; None if there is none)."""
        if resume_from == "latest":
            checkpoint = self.store.latest_complete()
            if checkpoint is None:
                self.log(f"no complete checkpoint under {self.store.root}; starting from step 0")
            return checkpoint
        try:
            return read_checkpoint(Path(resume_from))
        except CheckpointError as error:
            raise NonRetryableError(str(error)) from error

    def restore(self, checkpoint: Checkpoint, groups: Sequence[WorkerGroup]) -> RunState:
        """Load `checkpoint` into the ranks (fresh or adopted ones, of any count) and the RNG;
        the run's state as it was saved."""
        self.log(f"resuming from {checkpoint.path} (step {checkpoint.step})")
        saved_ranks = checkpoint.extra.get(RANKS_KEY, {})
        for group in groups:
            saved, now = saved_ranks.get(group.role, group.world_size), group.world_size
            if saved != now:  # rlhf_trainer.state.reshard loads it into any count
                self.log(f"{group.role}: saved by {saved} ranks, loaded into {now}")
        path, step = str(checkpoint.path), checkpoint.step
        WorkerGroup.wait([ref for g in groups for ref in g.submit("load", path, step)])
        restore_rng_state(checkpoint.load_rng_state())
        ahead = checkpoint.path / NEXT_BATCH_FILE
        self.checkpointed_step = checkpoint.step
        self.heartbeat.update(
            step=checkpoint.step,
            checkpoint_step=checkpoint.step,
            checkpoint_path=str(checkpoint.path),
        )
        return RunState(
            step=checkpoint.step,
            version=int(checkpoint.extra.get("policy_version", checkpoint.step)),
            data=DataPosition.from_json(checkpoint.data_position),
            next_sampled=load_sampled(ahead) if ahead.exists() else None,
        )

    def save(self, state: RunState, groups: Sequence[WorkerGroup], upload: bool = False) -> None:
        """Every rank writes its part of its role's state into one directory that appears
        atomically, and the manifest records each role's ranks; with a bucket, it is uploaded
        in the background when on the upload interval or `upload` says so. With
        `checkpoint.background` the step waits only for the ranks' snapshots (copies to host
        memory): the writes and the completion go on beside training (`WrittenCheckpoint`),
        and the next checkpoint or the run's end waits for them."""
        self.wait()
        with self.phase(m.PHASE_CHECKPOINT):
            extra = {
                "policy_version": state.version,
                "total_steps": self.total_steps,
                RANKS_KEY: {group.role: group.world_size for group in groups},
            }
            writing = self.store.writing(
                state.step, data_position=state.data.to_json(), extra=extra, upload=upload
            )
            directory = writing.__enter__()
            try:
                if state.next_sampled is not None:  # generated ahead: part of the state
                    save_sampled(state.next_sampled, directory / NEXT_BATCH_FILE)
                WorkerGroup.wait([r for g in groups for r in g.submit("snapshot", str(directory))])
            except BaseException:
                writing.__exit__(*sys.exc_info())  # removes the directory
                raise
            writes = [
                ref
                for group in groups
                for ref in group.submit("wait_saved", concurrency_group=CHECKPOINT_WRITES)
            ]
            self.written = WrittenCheckpoint(state.step, writing, writes)
        if not self.background:
            self.wait()

    @property
    def last_saved_step(self) -> int | None:
        """The step of the newest checkpoint taken, complete or still being written."""
        return self.written.step if self.written is not None else self.checkpointed_step

    def wait(self) -> None:
        """Wait for the checkpoint being written, if any; then it is the run's newest."""
        written, self.written = self.written, None
        if written is None:
            return
        with self.phase(m.PHASE_CHECKPOINT):
            written.wait()
        self.checkpointed_step = written.step
        self.metrics.record_checkpoint()
        path = str(self.store.step_dir(written.step))
        self.heartbeat.update(checkpoint_step=written.step, checkpoint_path=path)

    def announce_if_written(self) -> None:
        """A checkpoint written beside the last step that is complete now: announce it."""
        if self.written is not None and self.written.done():
            self.wait()

    def export(self, spec: RLHFJobSpec, out: PurePath, reporter: Reporter) -> None:
        """The policy of the newest checkpoint as a Hugging Face directory at `out` (replaced
        if there), then in the bucket beside the checkpoints (`spec.export`). An export that
        cannot be made fails the run without a retry: the checkpoint is there, and
        `rlhfjob export` can make it by hand once the cause is fixed."""
        from rlhf_trainer.state.export import ExportError, export_checkpoint  # transformers

        step = self.checkpointed_step
        if step is None:
            return
        model_dir = Path(spec.model.policy) if spec.model.policy else None
        dtype = spec.export.dtype or spec.model.dtype
        try:
            path = export_checkpoint(
                self.store.step_dir(step), Path(out), model_dir=model_dir, dtype=dtype,
                overwrite=True,
            )  # fmt: skip
        except ExportError as error:
            raise NonRetryableError(f"spec.export: {error}") from error
        reporter.exported(step, str(path))
        bucket = self.store.bucket
        if bucket is not None:
            reporter.exported(step, bucket.upload_tree(path, EXPORT_DIR))

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
