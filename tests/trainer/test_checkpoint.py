"""Checkpoints are atomic, pruned to the last N, verified on resume, and restore RNG state."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf_trainer.state import checkpoint as ckpt
from rlhf_trainer.state.checkpoint import CheckpointError, CheckpointStore

LOGGER = "rlhf_trainer.state.checkpoint"


def write_checkpoint(store: CheckpointStore, step: int, payload: bytes = b"weights") -> Path:
    """Write a small checkpoint the way a trainer would: its own files, in sub-directories."""
    with store.writing(step, data_position={"epoch": 0, "index": step}) as directory:
        (directory / "model").mkdir()
        (directory / "model" / "shard-0.bin").write_bytes(payload + bytes([step % 256]))
        (directory / "latest").write_text(f"global_step{step}")
    return store.step_dir(step)


def existing_steps(store: CheckpointStore) -> list[int]:
    return sorted(step for step, _ in store.step_dirs())


def test_written_checkpoint_has_a_manifest_listing_every_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=3)
    path = write_checkpoint(store, 7)

    assert path == tmp_path / "step-00000007"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == ckpt.FORMAT_VERSION
    assert manifest["step"] == 7
    assert manifest["data_position"] == {"epoch": 0, "index": 7}
    listed = {entry["path"]: entry for entry in manifest["files"]}
    assert set(listed) == {"latest", "model/shard-0.bin", "rng_state.pt"}
    assert listed["model/shard-0.bin"]["size"] == len(b"weights") + 1
    assert listed["latest"]["sha256"] == ckpt.sha256_of_file(path / "latest")

    found = store.latest_complete()
    assert found is not None
    assert (found.step, found.path, found.data_position) == (7, path, {"epoch": 0, "index": 7})


def test_extra_metadata_round_trips(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with store.writing(3, extra={"policy_version": 3, "config": "abc"}):
        pass
    found = store.latest_complete()
    assert found is not None
    assert found.extra == {"policy_version": 3, "config": "abc"}


def test_an_exception_while_writing_leaves_no_trace(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=1)
    write_checkpoint(store, 1)

    with pytest.raises(RuntimeError, match="disk on fire"), store.writing(2) as directory:
        (directory / "half-written.bin").write_bytes(b"\0" * 10)
        raise RuntimeError("disk on fire")

    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]
    found = store.latest_complete()
    assert found is not None
    assert found.step == 1


def test_keeps_only_the_last_n(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        write_checkpoint(store, step)
    assert existing_steps(store) == [30, 40]


def test_older_checkpoints_survive_until_the_new_one_is_complete(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=1)
    write_checkpoint(store, 1)
    with store.writing(2):
        # mid-write the previous checkpoint is still the resume point
        assert existing_steps(store) == [1]
    assert existing_steps(store) == [2]


def test_pruning_counts_only_complete_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        write_checkpoint(store, step)
    (store.step_dir(3) / "manifest.json").write_text('{"format_')  # 3 is now corrupt
    write_checkpoint(store, 4)
    # the two newest complete ones are 4 and 2; 1 goes; corrupt 3 is newer than 2 and stays
    assert existing_steps(store) == [2, 3, 4]


def test_corrupt_newest_falls_back_to_previous_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, keep_last=3)
    write_checkpoint(store, 1)
    newest = write_checkpoint(store, 2)
    shard = newest / "model" / "shard-0.bin"
    shard.write_bytes(b"X" + shard.read_bytes()[1:])  # same size, different content

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        found = store.latest_complete()

    assert found is not None
    assert found.step == 1
    assert "step-00000002" in caplog.text
    assert "hash mismatch" in caplog.text


def test_hash_check_can_be_skipped_for_a_fast_structural_check(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    newest = write_checkpoint(store, 2)
    (newest / "latest").write_text("global_stepX")  # same length, different content
    found = store.latest_complete(verify_hashes=False)
    assert found is not None
    assert found.step == 2
    with pytest.raises(CheckpointError, match="hash mismatch"):
        ckpt.read_checkpoint(newest)


def test_truncated_manifest_falls_back_to_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path)
    write_checkpoint(store, 1)
    manifest = write_checkpoint(store, 2) / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        found = store.latest_complete()

    assert found is not None
    assert found.step == 1
    assert "unreadable manifest.json" in caplog.text


def test_missing_file_falls_back_to_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path)
    write_checkpoint(store, 1)
    (write_checkpoint(store, 2) / "model" / "shard-0.bin").unlink()

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        found = store.latest_complete()

    assert found is not None
    assert found.step == 1
    assert "missing file model/shard-0.bin" in caplog.text


def test_resized_file_and_missing_manifest_are_rejected(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = write_checkpoint(store, 5)
    (path / "latest").write_text("longer than before")
    with pytest.raises(CheckpointError, match="bytes, manifest says"):
        ckpt.read_checkpoint(path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        ckpt.read_checkpoint(path)


def test_manifest_with_wrong_step_or_version_is_rejected(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = write_checkpoint(store, 5)
    manifest = json.loads((path / "manifest.json").read_text())

    (path / "manifest.json").write_text(json.dumps({**manifest, "step": 6}))
    with pytest.raises(CheckpointError, match="manifest says step 6"):
        ckpt.read_checkpoint(path)

    (path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(CheckpointError, match="unsupported format_version 99"):
        ckpt.read_checkpoint(path)

    (path / "manifest.json").write_text(json.dumps({"format_version": 1}))
    with pytest.raises(CheckpointError, match="malformed"):
        ckpt.read_checkpoint(path)


def test_nothing_to_resume_from(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert CheckpointStore(tmp_path / "does-not-exist").latest_complete() is None
    store = CheckpointStore(tmp_path)
    (write_checkpoint(store, 1) / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.latest_complete() is None
    assert "step-00000001" in caplog.text


def test_leftover_temp_dirs_are_ignored_then_cleaned_up(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    write_checkpoint(store, 1)
    # a crash mid-write of step 2 left its temporary directory behind
    with pytest.raises(KeyboardInterrupt), store.writing(2) as directory:
        leftover = directory
        raise KeyboardInterrupt
    assert not leftover.exists()  # even an interrupt cleans up...
    crashed = tmp_path / f"{ckpt.TEMP_DIR_PREFIX}00000002-abc123"
    crashed.mkdir()  # ...but a killed process cannot, so simulate what it leaves
    (crashed / ckpt.MARKER_FILE).write_text("")
    (crashed / "model.bin").write_bytes(b"partial")

    found = store.latest_complete()
    assert found is not None
    assert found.step == 1
    assert crashed.exists()  # reading never deletes: a writer might still own it

    write_checkpoint(store, 2)
    assert not crashed.exists()
    assert existing_steps(store) == [1, 2]


def test_never_deletes_what_it_did_not_create(tmp_path: Path) -> None:
    foreign = [
        tmp_path / "step-00000000",  # right name, but no marker: not ours
        tmp_path / f"{ckpt.TEMP_DIR_PREFIX}notes",  # temp-looking name without marker
        tmp_path / "datasets",
    ]
    for directory in foreign:
        directory.mkdir()
        (directory / "precious.txt").write_text("keep me")
    store = CheckpointStore(tmp_path, keep_last=1)
    for step in (1, 2, 3):
        write_checkpoint(store, step)
    for directory in foreign:
        assert (directory / "precious.txt").read_text() == "keep me"
    assert existing_steps(store) == [0, 3]


def test_rewriting_a_step_replaces_it(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    write_checkpoint(store, 4, payload=b"first")
    write_checkpoint(store, 4, payload=b"second")
    found = store.latest_complete()
    assert found is not None
    assert (found.path / "model" / "shard-0.bin").read_bytes() == b"second\x04"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]


def test_refuses_to_replace_a_step_directory_it_did_not_create(tmp_path: Path) -> None:
    foreign = tmp_path / "step-00000004"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match="not created by this store"):
        write_checkpoint(store, 4)
    assert (foreign / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]


def test_step_must_fit_eight_digits(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(ValueError, match="step"):
        store.step_dir(10**8)
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointStore(tmp_path, keep_last=0)


# ----------------------------------------------------------------------------------- RNG state


def draw_random_numbers() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_state_round_trip_replays_the_same_numbers() -> None:
    state = ckpt.capture_rng_state()
    first = draw_random_numbers()
    restored = draw_random_numbers()
    assert restored != first  # the generators did advance
    ckpt.restore_rng_state(state)
    assert draw_random_numbers() == first


def test_rng_state_survives_a_file(tmp_path: Path) -> None:
    np.random.randn()  # leaves a cached Gaussian in NumPy's legacy state
    state = ckpt.capture_rng_state()
    ckpt.save_rng_state(state, tmp_path / "rng.pt")
    first = draw_random_numbers()
    ckpt.restore_rng_state(ckpt.load_rng_state(tmp_path / "rng.pt"))
    assert draw_random_numbers() == first


def test_checkpoint_carries_the_rng_state_from_when_writing_began(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    with store.writing(1):
        expected = draw_random_numbers()  # draws made after the snapshot are replayed on resume
    draw_random_numbers()
    found = store.latest_complete()
    assert found is not None
    ckpt.restore_rng_state(found.load_rng_state())
    assert draw_random_numbers() == expected


def test_an_explicit_rng_state_is_stored_instead(tmp_path: Path) -> None:
    state = ckpt.capture_rng_state()
    expected = draw_random_numbers()
    store = CheckpointStore(tmp_path)
    with store.writing(1, rng_state=state):
        pass
    found = store.latest_complete()
    assert found is not None
    ckpt.restore_rng_state(found.load_rng_state())
    assert draw_random_numbers() == expected


def test_a_pinned_checkpoint_outlives_pruning_until_unpinned(tmp_path: Path) -> None:
    """An upload under way keeps its checkpoint on the volume however many saves follow."""
    store = CheckpointStore(tmp_path, keep_last=1)
    write_checkpoint(store, 10)
    store.pin(10)
    store.pin(10)
    write_checkpoint(store, 20)
    write_checkpoint(store, 30)
    assert existing_steps(store) == [10, 30]
    store.unpin(10)
    write_checkpoint(store, 40)
    assert existing_steps(store) == [10, 40], "still pinned once"
    store.unpin(10)
    write_checkpoint(store, 50)
    assert existing_steps(store) == [50]


def _copy_into(source: Path, directory: Path) -> None:
    for path in source.rglob("*"):
        if path.is_file() and path.name != ckpt.MARKER_FILE:
            target = directory / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())


def test_an_imported_copy_appears_only_once_every_hash_verifies(tmp_path: Path) -> None:
    """A download lands next to the checkpoints and is renamed into place after verifying."""
    origin = CheckpointStore(tmp_path / "origin")
    source = write_checkpoint(origin, 7)
    store = CheckpointStore(tmp_path / "volume")
    with store.importing(7) as directory:
        _copy_into(source, directory)
    imported = store.read(7)
    assert imported.data_position == {"epoch": 0, "index": 7}
    assert (store.step_dir(7) / ckpt.MARKER_FILE).is_file(), "prunable like any other"

    # A corrupt copy (one flipped byte, same size) is refused and leaves no trace.
    with pytest.raises(CheckpointError, match="hash mismatch"), store.importing(8) as directory:
        _copy_into(write_checkpoint(origin, 8), directory)
        shard = directory / "model" / "shard-0.bin"
        shard.write_bytes(bytes([shard.read_bytes()[0] ^ 1]) + shard.read_bytes()[1:])
    assert existing_steps(store) == [7]
    assert [p.name for p in store.root.iterdir()] == [store.step_dir(7).name]


@pytest.mark.parametrize(
    "listed",
    ["../escape", "model/../../escape", "/etc/passwd", "model//shard", "./latest", "a\\b", "", 7],
)
@pytest.mark.attack(
    "a checkpoint manifest whose paths leave the checkpoint directory",
    "the manifest check: plain relative paths only (rlhf_trainer.state.checkpoint)",
)
def test_a_manifest_path_that_could_leave_its_checkpoint_is_refused(
    tmp_path: Path, listed: object
) -> None:
    with pytest.raises(CheckpointError, match="manifest path"):
        ckpt.contained_path(tmp_path, listed)
    assert ckpt.contained_path(tmp_path, "model/shard-0.bin") == tmp_path / "model/shard-0.bin"


def test_a_symlinked_directory_inside_the_checkpoint_does_not_lead_out(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model").symlink_to(tmp_path)
    with pytest.raises(CheckpointError, match="leaves the checkpoint directory"):
        ckpt.contained_path(tmp_path / "ckpt", "model/secret")


def test_resume_refuses_a_manifest_that_lists_a_file_outside_and_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path / "volume")
    write_checkpoint(store, 1)
    newest = write_checkpoint(store, 2)
    (tmp_path / "outside").write_bytes(b"not the trainer's")
    manifest = json.loads((newest / ckpt.MANIFEST_FILE).read_text())
    manifest["files"][0]["path"] = "../../outside"
    (newest / ckpt.MANIFEST_FILE).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        found = store.latest_complete()
    assert found is not None and found.step == 1
    assert "manifest path '../../outside'" in caplog.text


@pytest.mark.attack(
    "a bucket manifest that makes the download write outside the volume",
    "the manifest check before any download (rlhf_trainer.state.checkpoint)",
)
def test_a_bucket_manifest_cannot_make_the_download_write_outside_the_volume(
    tmp_path: Path,
) -> None:
    """The download writes only where `contained_path` allows, before asking the bucket."""
    from rlhf_trainer.state.bucket import BucketTier, Uploaded

    class RecordingClient:
        """Stands in for boto3's client: records what it was asked to write, writes nothing."""

        def __init__(self) -> None:
            self.targets: list[str] = []

        def download_file(self, bucket: str, key: str, target: str) -> None:
            self.targets.append(target)
            Path(target).write_bytes(b"x")

    client = RecordingClient()
    tier = BucketTier(client, "ckpts", "ns/job", keep_last=2)
    store = CheckpointStore(tmp_path / "volume")
    files = [{"path": path, "size": 1, "sha256": "0"} for path in ("ok", "../../../evil")]
    manifest = {"step": 3, "files": files}
    with pytest.raises(CheckpointError, match=r"manifest path '\.\./\.\./\.\./evil'"):
        tier.download(Uploaded(3, manifest), store)
    assert all(Path(t).resolve().is_relative_to(store.root.resolve()) for t in client.targets)
    assert not (tmp_path / "evil").exists() and existing_steps(store) == []
