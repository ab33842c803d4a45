"""The durable tier of a job's checkpoints: an S3-compatible bucket (design decision 6).

Training waits only for the fast tier, the checkpoint volume (`CheckpointStore`); the driver then
hands each complete checkpoint to an `Uploader`, a background thread that copies it to the
bucket. One checkpoint in the bucket is the keys ``<job prefix>step-<8 digits>/<file>``, one per
file of its manifest, and ``.../manifest.json``, uploaded **last**: a checkpoint counts as
complete in the bucket only when its manifest is there and every file it lists is there with
the listed size, so an upload the driver did not finish is never chosen. Re-uploading a step
deletes its manifest first, so a half-overwritten step is never complete either. A download
lands in a temporary directory of the volume and verifies every sha256 before it is renamed
into place (`CheckpointStore.importing`), so a corrupt object falls back to the next older one.

`TieredCheckpoints` puts both tiers behind the store's interface for the driver: `writing`
saves to the volume and queues the upload; `latest_complete` picks the newest complete
checkpoint of either tier, downloading it when only the bucket has it; `flush` waits for the
queued uploads (the last step's and a drain's checkpoint must reach the bucket before the
driver exits). The volume's pruning never deletes a checkpoint that is queued or uploading.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_trainer.state.checkpoint import (
    MANIFEST_FILE,
    STEP_DIR_PREFIX,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    JSONValue,
    RngState,
    contained_path,
    plain_relative,
)
from rlhfjob import contract
from rlhfjob.api import (
    ENV_OBJECT_STORE_ACCESS_KEY_ID,
    ENV_OBJECT_STORE_SECRET_ACCESS_KEY,
    RLHFJob,
)

logger = logging.getLogger(__name__)

_STEP_KEY = re.compile(rf"^{STEP_DIR_PREFIX}(\d{{8}})/(.+)$")
UPLOAD_ATTEMPTS = 3
"""Tries per file before an upload is given up (the next checkpoint is uploaded anyway)."""


def job_prefix(job: RLHFJob) -> str:
    """Where one job's checkpoints live in its bucket (`rlhfjob.contract.bucket_prefix`)."""
    prefix = contract.bucket_prefix(job)
    assert prefix is not None
    return prefix


def s3_client(job: RLHFJob, environ: Mapping[str, str] = os.environ) -> Any:
    """A boto3 S3 client for the job's bucket: its endpoint (path-style) and region, and the
    credentials the operator put in the head's environment, else the ambient ones."""
    import boto3
    from botocore.config import Config

    store = job.spec.checkpoint.object_store
    assert store is not None
    key_id = environ.get(ENV_OBJECT_STORE_ACCESS_KEY_ID)
    secret = environ.get(ENV_OBJECT_STORE_SECRET_ACCESS_KEY)
    config = Config(
        retries={"max_attempts": 5, "mode": "standard"},
        s3={"addressing_style": "path" if store.endpoint else "auto"},
        connect_timeout=10,
        read_timeout=60,
        # The manifest's sha256 of every file is checked on download: a second checksum of
        # every byte (CRC32 by default) would only take CPU from training.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.client(
        "s3",
        endpoint_url=store.endpoint,
        region_name=store.region,
        aws_access_key_id=key_id or None,
        aws_secret_access_key=secret or None,
        config=config,
    )


@dataclass(frozen=True)
class Uploaded:
    """A checkpoint as the bucket holds it."""

    step: int
    manifest: dict[str, Any]


class BucketTier:
    """One job's checkpoints in a bucket: upload (manifest last), find, download, prune.

    It deletes only keys under its job prefix whose names it generates (``step-N/...``).
    """

    def __init__(self, client: Any, bucket: str, prefix: str, keep_last: int) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.client, self.bucket, self.prefix, self.keep_last = client, bucket, prefix, keep_last

    @classmethod
    def for_job(cls, job: RLHFJob, client: Any | None = None) -> BucketTier | None:
        """The job's bucket tier; None when its checkpoints have no bucket."""
        checkpoint = job.spec.checkpoint
        store, keep_last = checkpoint.object_store, checkpoint.bucket_keep_last
        if store is None or keep_last is None:
            return None
        return cls(client or s3_client(job), store.bucket, job_prefix(job), keep_last)

    def key(self, step: int, relative: str) -> str:
        return f"{self.prefix}{STEP_DIR_PREFIX}{step:08d}/{relative}"

    def url(self, step: int) -> str:
        return f"s3://{self.bucket}/{self.key(step, '')}"

    # -- upload ----------------------------------------------------------------------------------

    def upload(self, checkpoint: Checkpoint) -> int:
        """Copy a complete checkpoint of the volume to the bucket; returns the bytes sent."""
        from boto3.s3.transfer import TransferConfig

        manifest_key = self.key(checkpoint.step, MANIFEST_FILE)
        # A step uploaded before (retrained after a resume) stops being complete first.
        self.client.delete_object(Bucket=self.bucket, Key=manifest_key)
        transfer = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20)
        sent = 0
        for record in checkpoint.files:
            self._with_retries(
                lambda r=record: self.client.upload_file(
                    str(checkpoint.path / r.path),
                    self.bucket,
                    self.key(checkpoint.step, r.path),
                    Config=transfer,
                )
            )
            sent += record.size
        manifest = (checkpoint.path / MANIFEST_FILE).read_bytes()
        self._with_retries(
            lambda: self.client.put_object(Bucket=self.bucket, Key=manifest_key, Body=manifest)
        )
        return sent + len(manifest)

    def upload_tree(self, local: Path, relative: str) -> str:
        """Copy every file under `local` to `<prefix><relative>/` (the exported model, not a
        checkpoint: pruning never touches it); returns its URL."""
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            key = f"{self.prefix}{relative}/{path.relative_to(local).as_posix()}"
            self._with_retries(
                lambda p=path, k=key: self.client.upload_file(str(p), self.bucket, k)
            )
        return f"s3://{self.bucket}/{self.prefix}{relative}/"

    @staticmethod
    def _with_retries(call: Any) -> None:
        for attempt in range(1, UPLOAD_ATTEMPTS + 1):
            try:
                call()
                return
            except Exception:
                if attempt == UPLOAD_ATTEMPTS:
                    raise
                time.sleep(min(2.0**attempt, 10.0))  # a backoff between retries, not a wait

    # -- what is there -----------------------------------------------------------------------------

    def _objects(self) -> dict[int, dict[str, int]]:
        """``{step: {relative path: size}}`` of every key under the job prefix."""
        found: dict[int, dict[str, int]] = {}
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
            for entry in page.get("Contents", ()):
                match = _STEP_KEY.match(entry["Key"][len(self.prefix) :])
                if match:
                    found.setdefault(int(match.group(1)), {})[match.group(2)] = int(entry["Size"])
        return found

    def _manifest(self, step: int) -> dict[str, Any] | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(step, MANIFEST_FILE))
            manifest = json.loads(body["Body"].read())
        except Exception as error:  # missing, unreadable: not a complete checkpoint
            logger.warning("bucket checkpoint step %d has no readable manifest: %s", step, error)
            return None
        return manifest if isinstance(manifest, dict) else None

    def complete(self) -> list[Uploaded]:
        """Complete checkpoints in the bucket, newest first: a manifest, and every file it
        lists present with its size (hashes are checked on download)."""
        objects = self._objects()
        complete = []
        for step in sorted(objects, reverse=True):
            if MANIFEST_FILE not in objects[step]:
                continue
            manifest = self._manifest(step)
            if manifest is None or manifest.get("step") != step:
                continue
            try:
                listed = {str(f["path"]): int(f["size"]) for f in manifest["files"]}
                for path in listed:
                    plain_relative(path)
            except (KeyError, TypeError, ValueError):
                continue
            except CheckpointError as error:
                logger.warning("bucket checkpoint step %d refused: %s", step, error)
                continue
            if all(objects[step].get(path) == size for path, size in listed.items()):
                complete.append(Uploaded(step, manifest))
            else:
                logger.warning("bucket checkpoint step %d is incomplete; skipped", step)
        return complete

    # -- download and prune ----------------------------------------------------------------------

    def download(self, uploaded: Uploaded, store: CheckpointStore) -> Checkpoint:
        """Fetch a checkpoint into the volume; it appears only once every hash verifies."""
        step = uploaded.step
        with store.importing(step) as directory:
            for entry in uploaded.manifest["files"]:
                target = contained_path(directory, entry["path"])
                target.parent.mkdir(parents=True, exist_ok=True)
                self.client.download_file(self.bucket, self.key(step, entry["path"]), str(target))
            (directory / MANIFEST_FILE).write_text(json.dumps(uploaded.manifest))
        return store.read(step)

    def prune(self) -> list[int]:
        """Delete the job's checkpoints older than its newest ``keep_last`` complete ones, and
        the leftovers of interrupted uploads older than those. Returns the steps deleted."""
        complete = [u.step for u in self.complete()]
        if len(complete) < self.keep_last:
            return []
        oldest_kept = complete[self.keep_last - 1]
        doomed = [step for step in self._objects() if step < oldest_kept]
        for step in doomed:
            keys = [self.key(step, path) for path in self._objects().get(step, {})]
            # The manifest first: a checkpoint half deleted is never complete.
            keys.sort(key=lambda k: not k.endswith("/" + MANIFEST_FILE))
            for key in keys:
                self.client.delete_object(Bucket=self.bucket, Key=key)
            logger.info("pruned bucket checkpoint %s", self.url(step))
        return doomed


UploadDone = Callable[[int, float, bool], None]
"""Called from the upload thread when one ends: (step, seconds, whether it succeeded)."""


class Uploader:
    """A background thread that uploads checkpoints in the order they were saved."""

    def __init__(
        self, store: CheckpointStore, bucket: BucketTier, on_done: UploadDone | None = None
    ) -> None:
        self.store, self.bucket, self.on_done = store, bucket, on_done
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self.uploaded_step: int | None = None
        """The newest step this uploader completed in the bucket."""
        self.submitted_step: int | None = None
        """The step last queued."""
        self.failures = 0
        self.seconds = 0.0
        """Time spent uploading, in total (off the training thread)."""
        self._thread = threading.Thread(target=self._run, name="checkpoint-upload", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        """Queue a complete checkpoint of the volume; it stays unpruned until uploaded."""
        self.store.pin(step)
        self.submitted_step = step
        with self._idle:
            self._pending += 1
        self._queue.put(step)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued checkpoint is uploaded (or failed); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Flush, then stop the thread."""
        done = self.flush(timeout)
        self._queue.put(None)
        return done

    def _run(self) -> None:
        _yield_cpu_to_training()
        while (step := self._queue.get()) is not None:
            started, ok = time.monotonic(), False
            try:
                checkpoint = self.store.read(step, verify_hashes=False)
                sent = self.bucket.upload(checkpoint)
                self.bucket.prune()
                self.uploaded_step, ok = step, True
                logger.info("uploaded checkpoint %d (%d bytes) to %s", step, sent,
                            self.bucket.url(step))  # fmt: skip
            except Exception:
                self.failures += 1
                logger.exception("upload of checkpoint %d failed; training goes on", step)
            finally:
                took = time.monotonic() - started
                self.seconds += took
                self.store.unpin(step)
                if self.on_done is not None:
                    self.on_done(step, took, ok)
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


UPLOAD_NICENESS = 10
"""How much lower than training the upload thread runs: it takes the CPU the ranks leave."""


def _yield_cpu_to_training() -> None:
    """Lower this thread's scheduling priority (Linux schedules threads on their own; best
    effort elsewhere): an upload must not slow the training it runs beside."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + UPLOAD_NICENESS)


class TieredCheckpoints:
    """The volume (fast, training waits for it) and the bucket (durable, in the background) as
    one checkpoint store for the driver. Without a bucket it is the volume's store alone."""

    def __init__(
        self,
        store: CheckpointStore,
        bucket: BucketTier | None,
        upload_interval: int | None,
        on_upload: UploadDone | None = None,
    ) -> None:
        self.local, self.bucket = store, bucket
        self.upload_interval = upload_interval
        self.uploader = Uploader(store, bucket, on_upload) if bucket is not None else None

    @classmethod
    def for_job(
        cls, job: RLHFJob, root: Path, on_upload: UploadDone | None = None
    ) -> TieredCheckpoints:
        checkpoint = job.spec.checkpoint
        store = CheckpointStore(root, keep_last=checkpoint.keep_last)
        return cls(store, BucketTier.for_job(job), checkpoint.upload_interval_steps, on_upload)

    @property
    def root(self) -> Path:
        return self.local.root

    def step_dir(self, step: int) -> Path:
        return self.local.step_dir(step)

    @contextlib.contextmanager
    def writing(
        self,
        step: int,
        data_position: JSONValue = None,
        rng_state: RngState | None = None,
        extra: dict[str, JSONValue] | None = None,
        *,
        upload: bool = False,
    ) -> Iterator[Path]:
        """Save to the volume (`CheckpointStore.writing`); then queue the upload when the step
        is on the upload interval or `upload` says so (the last step, a drain)."""
        with self.local.writing(step, data_position, rng_state, extra) as directory:
            yield directory
        interval = self.upload_interval
        if self.uploader is not None and (upload or (interval and step % interval == 0)):
            self.uploader.submit(step)

    def latest_complete(self) -> Checkpoint | None:
        """The newest complete checkpoint of either tier; one only the bucket has (a new
        cluster, an empty volume) is downloaded first. A download that fails verification
        falls back to the next one."""
        local = self.local.latest_complete()
        if self.bucket is None:
            return local
        for uploaded in self.bucket.complete():
            if local is not None and uploaded.step <= local.step:
                break
            try:
                logger.info("downloading checkpoint %d from %s", uploaded.step,
                            self.bucket.url(uploaded.step))  # fmt: skip
                return self.bucket.download(uploaded, self.local)
            except Exception as error:  # corrupt, vanished, refused: the next one may do
                logger.warning("bucket checkpoint %d not usable: %s", uploaded.step, error)
        return local

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued uploads; True when none is left."""
        return self.uploader is None or self.uploader.flush(timeout)

    def close(self, timeout: float | None = None) -> bool:
        return self.uploader is None or self.uploader.close(timeout)
