"""The bucket tier of checkpoints against a real S3 server (the local cluster's SeaweedFS).

`rlhf_trainer.state.bucket` alone, no training: checkpoints written by the volume's store are
uploaded, and what a resume may choose is checked after the failures an upload meets. An
upload cut short (files, no manifest) and a checkpoint whose object was overwritten are never
used; the newest complete one is; a re-upload of a step is incomplete until it ends; pruning
keeps the newest `keepLast` complete ones and deletes nothing outside the job's prefix.
Seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlhf_local import objectstore
from rlhf_local.testing import LocalCluster
from rlhf_trainer.state.bucket import BucketTier, TieredCheckpoints, Uploader
from rlhf_trainer.state.checkpoint import MANIFEST_FILE, CheckpointStore

pytestmark = pytest.mark.e2e

PREFIX = "team/ns/job/"


class DriverDied(BaseException):
    """The driver's process ending mid-upload: nothing retries it."""


def save(store: CheckpointStore, step: int, size: int = 3 << 20) -> None:
    """A checkpoint of a few MiB in sub-directories, like the ranks write."""
    with store.writing(step, data_position={"index": step}) as directory:
        (directory / "policy").mkdir()
        (directory / "policy" / "fp32-rank00000.safetensors").write_bytes(bytes([step]) * size)
        (directory / "policy" / "state.json").write_text(f'{{"step": {step}}}')


@pytest.fixture
def tier(local_cluster: LocalCluster, s3_bucket: str) -> BucketTier:
    return BucketTier(objectstore.client(), s3_bucket, PREFIX, keep_last=2)


def uploaded(tier: BucketTier, volume: CheckpointStore, *steps: int) -> CheckpointStore:
    """`volume` with checkpoints of `steps`, each uploaded to the bucket."""
    for step in steps:
        save(volume, step)
        tier.upload(volume.read(step))
    return volume


def fresh_volume(tmp_path: Path, name: str) -> CheckpointStore:
    return CheckpointStore(tmp_path / name, keep_last=10)


def test_a_resume_takes_the_newest_complete_checkpoint_and_never_a_partial_one(
    tier: BucketTier, tmp_path: Path
) -> None:
    volume = uploaded(tier, fresh_volume(tmp_path, "volume"), 4, 8)
    assert [u.step for u in tier.complete()] == [8, 4]

    # The driver died uploading step 12: its files are there, its manifest is not.
    save(volume, 12)
    twelve = volume.read(12)
    for record in twelve.files:
        tier.client.upload_file(str(twelve.path / record.path), tier.bucket,
                                tier.key(12, record.path))  # fmt: skip
    assert [u.step for u in tier.complete()] == [8, 4]

    # A new cluster with an empty volume resumes from step 8, downloaded and verified.
    empty = fresh_volume(tmp_path, "new-volume")
    resumed = TieredCheckpoints(empty, tier, None).latest_complete()
    assert resumed is not None and resumed.step == 8 and resumed.data_position == {"index": 8}
    assert (empty.step_dir(8) / "policy" / "state.json").read_text() == '{"step": 8}'

    # A volume that has a newer checkpoint than the bucket keeps it: no download.
    local = TieredCheckpoints(volume, tier, None).latest_complete()
    assert local is not None and local.step == 12 and local.path == volume.step_dir(12)


def test_an_object_changed_in_the_bucket_is_refused_and_the_previous_one_used(
    tier: BucketTier, tmp_path: Path
) -> None:
    uploaded(tier, fresh_volume(tmp_path, "volume"), 4, 8)
    key = tier.key(8, "policy/fp32-rank00000.safetensors")
    tier.client.put_object(Bucket=tier.bucket, Key=key, Body=bytes([99]) * (3 << 20))  # same size
    empty = fresh_volume(tmp_path, "new-volume")
    resumed = TieredCheckpoints(empty, tier, None).latest_complete()
    assert resumed is not None and resumed.step == 4
    assert [step for step, _ in empty.step_dirs()] == [4], "the corrupt copy left no trace"


def test_a_step_uploaded_again_is_incomplete_until_its_manifest_is_back(
    tier: BucketTier, tmp_path: Path
) -> None:
    """A step retrained after a resume replaces its old upload: the old manifest goes first,
    so a driver dying halfway leaves neither the old nor a mixed checkpoint complete."""
    volume = fresh_volume(tmp_path, "volume")
    save(volume, 4)
    tier.upload(volume.read(4))
    sent: list[str] = []
    real_upload = tier.client.upload_file

    def upload_then_die(path: str, bucket: str, key: str, **kwargs: Any) -> None:
        real_upload(path, bucket, key, **kwargs)
        sent.append(key)
        raise DriverDied

    tier.client.upload_file = upload_then_die
    try:
        with pytest.raises(DriverDied):
            tier.upload(volume.read(4))
    finally:
        tier.client.upload_file = real_upload
    assert len(sent) == 1 and tier.complete() == [], "the old manifest went first"
    tier.upload(volume.read(4))
    assert [u.step for u in tier.complete()] == [4]


def test_pruning_keeps_the_newest_complete_ones_and_only_touches_the_jobs_keys(
    tier: BucketTier, tmp_path: Path
) -> None:
    neighbour = PREFIX.replace("job/", "other-job/") + "step-00000001/" + MANIFEST_FILE
    tier.client.put_object(Bucket=tier.bucket, Key=neighbour, Body=b"{}")
    volume = fresh_volume(tmp_path, "volume")
    uploader = Uploader(volume, tier)
    for step in (2, 4, 6, 8):
        save(volume, step)
        uploader.submit(step)
    assert uploader.close(timeout=120), "uploads did not finish"
    assert uploader.failures == 0 and uploader.uploaded_step == 8
    assert [u.step for u in tier.complete()] == [8, 6]
    keys = objectstore.list_keys(tier.bucket)
    assert neighbour in keys
    pruned = (tier.key(2, ""), tier.key(4, ""))
    assert not any(key.startswith(pruned) for key in keys), keys
