"""Atomic, verifiable training checkpoints (design decision 6).

A checkpoint is a directory ``<root>/step-<8 digits>`` holding whatever files the trainer writes
(DeepSpeed model and optimizer shards, for instance) plus ``manifest.json``. It is built in a
temporary directory under the same root and renamed into place only once every file is written
and hashed, so a crash leaves either a complete checkpoint or none. On resume,
:meth:`CheckpointStore.latest_complete` returns the newest checkpoint whose manifest and hashes
verify, skipping (with a warning) one that was corrupted or truncated afterwards.

Layout of one checkpoint::

    step-00000120/
        .rlhf-checkpoint      marker: this store created the directory (safe to prune)
        manifest.json         step, data position, RNG file, per-file sha256 and size
        rng_state.pt          Python / NumPy / torch RNG states of the writing process
        ...                   the caller's files, in any sub-directories

The store only ever deletes directories whose names it generates *and* that carry its marker
file, so pointing it at a directory with other content is safe.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
MARKER_FILE = ".rlhf-checkpoint"
RNG_STATE_FILE = "rng_state.pt"
STEP_DIR_PREFIX = "step-"
TEMP_DIR_PREFIX = ".tmp-step-"
TRASH_DIR_PREFIX = ".trash-step-"

_STEP_DIR_PATTERN = re.compile(r"^step-(\d{8})$")
_HASH_CHUNK_BYTES = 1 << 20

JSONValue = Any
"""Anything ``json.dumps`` accepts (kept opaque: the data loader owns its position format)."""


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete or fails verification."""


# --------------------------------------------------------------------------------------------
# RNG state
# --------------------------------------------------------------------------------------------


@dataclass
class RngState:
    """Random-number-generator states of one process, enough to replay its random draws."""

    python: tuple[Any, ...]
    numpy: tuple[Any, ...] | None
    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor] | None


def capture_rng_state() -> RngState:
    """Snapshot the Python, NumPy (if installed), torch CPU and torch CUDA (if present) RNGs."""
    numpy_state: tuple[Any, ...] | None = None
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch here
        pass
    else:
        kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
        # Plain lists so the file loads with torch.load(weights_only=True).
        key_list = np.asarray(keys).tolist()
        numpy_state = (kind, key_list, int(pos), int(has_gauss), float(cached_gaussian))
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return RngState(
        python=random.getstate(),
        numpy=numpy_state,
        torch_cpu=torch.get_rng_state(),
        torch_cuda=cuda_states,
    )


def restore_rng_state(state: RngState) -> None:
    """Put every RNG back to ``state``; parts absent from this process or the state are skipped."""
    random.setstate(state.python)
    if state.numpy is not None:
        try:
            import numpy as np
        except ImportError:  # pragma: no cover
            logger.warning("checkpoint has a NumPy RNG state but NumPy is not installed")
        else:
            kind, keys, pos, has_gauss, cached_gaussian = state.numpy
            np.random.set_state(
                (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian)
            )
    torch.set_rng_state(state.torch_cpu)
    if state.torch_cuda is not None and torch.cuda.is_available():
        if len(state.torch_cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state.torch_cuda)
        else:
            logger.warning(
                "checkpoint has CUDA RNG states for %d devices but %d are visible; not restored",
                len(state.torch_cuda),
                torch.cuda.device_count(),
            )


def save_rng_state(state: RngState, path: Path) -> None:
    """Write ``state`` to ``path`` (a torch file loadable with ``weights_only=True``)."""
    torch.save(
        {
            "python": state.python,
            "numpy": state.numpy,
            "torch_cpu": state.torch_cpu,
            "torch_cuda": state.torch_cuda,
        },
        path,
    )


def load_rng_state(path: Path) -> RngState:
    """Read a state written by :func:`save_rng_state`."""
    data = torch.load(path, weights_only=True)
    return RngState(
        python=_as_tuples(data["python"]),
        numpy=tuple(data["numpy"]) if data["numpy"] is not None else None,
        torch_cpu=data["torch_cpu"],
        torch_cuda=data["torch_cuda"],
    )


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` insists on tuples; serialisation may hand back lists."""
    if isinstance(value, list | tuple):
        return tuple(_as_tuples(item) for item in value)
    return value


# --------------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint: its path relative to the checkpoint directory (POSIX style)."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk, as described by its manifest."""

    step: int
    path: Path
    data_position: JSONValue
    created_at: float
    """Unix time at which the checkpoint was finalised."""
    files: tuple[FileRecord, ...]
    extra: dict[str, JSONValue]
    """Caller-supplied JSON metadata (policy version, config digest, ...)."""

    @property
    def rng_state_path(self) -> Path:
        return self.path / RNG_STATE_FILE

    def load_rng_state(self) -> RngState:
        """The RNG state captured when this checkpoint was written."""
        return load_rng_state(self.rng_state_path)


def plain_relative(relative: object) -> list[str]:
    """The segments of a path a manifest lists, refusing any that could land outside its
    checkpoint: a manifest may come from a bucket others can write to, and a path such as
    ``../../home/ray/.bashrc`` or ``/etc/passwd`` must never be written or read. Allowed: a
    relative POSIX path of plain names (no ``.``, ``..``, empty segment, backslash or NUL).
    Raises :class:`CheckpointError` naming the path."""
    if not isinstance(relative, str) or not relative:
        raise CheckpointError(f"manifest path {relative!r} is not a non-empty string")
    parts = relative.split("/")
    if "\\" in relative or "\0" in relative or any(part in ("", ".", "..") for part in parts):
        raise CheckpointError(
            f"manifest path {relative!r} is not a plain relative path inside the checkpoint"
        )
    return parts


def contained_path(directory: Path, relative: object) -> Path:
    """`directory / relative` for a manifest's path (`plain_relative`), which must also not
    leave `directory` through a symlink inside it."""
    target = directory.joinpath(*plain_relative(relative))
    if not target.resolve().is_relative_to(directory.resolve()):
        raise CheckpointError(f"manifest path {relative!r} leaves the checkpoint directory")
    return target


def sha256_of_file(path: Path) -> str:
    """Hex sha256 of a file's content, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _content_files(directory: Path) -> list[Path]:
    """Every regular file below ``directory`` except the manifest and the marker, sorted."""
    excluded = {directory / MANIFEST_FILE, directory / MARKER_FILE}
    return sorted(path for path in directory.rglob("*") if path.is_file() and path not in excluded)


def _fsync_path(path: Path) -> None:
    """Flush a file or directory to stable storage (best effort on platforms without it)."""
    flags = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)) if path.is_dir() else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError:  # pragma: no cover - e.g. directories on Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def read_checkpoint(path: Path, verify_hashes: bool = True) -> Checkpoint:
    """Load and verify the checkpoint in ``path`` (the ``--resume-from`` entry point).

    Checks that the manifest parses, has a known format version, names this directory's step
    (when the directory has a ``step-N`` name), and that every listed file exists with the
    recorded size and, if ``verify_hashes``, sha256. Raises :class:`CheckpointError` saying
    what is wrong.
    """
    manifest_path = path / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError as error:
        raise CheckpointError(f"{path}: no {MANIFEST_FILE}") from error
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: unreadable {MANIFEST_FILE}: {error}") from error
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: {MANIFEST_FILE} is not a JSON object")

    try:
        version = manifest["format_version"]
        if version != FORMAT_VERSION:
            raise CheckpointError(f"{path}: unsupported format_version {version!r}")
        step = int(manifest["step"])
        files = tuple(
            FileRecord(path=str(entry["path"]), size=int(entry["size"]), sha256=entry["sha256"])
            for entry in manifest["files"]
        )
        checkpoint = Checkpoint(
            step=step,
            path=path,
            data_position=manifest["data_position"],
            created_at=float(manifest["created_at"]),
            files=files,
            extra=dict(manifest.get("extra") or {}),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: malformed {MANIFEST_FILE}: {error!r}") from error

    name_match = _STEP_DIR_PATTERN.match(path.name)
    if name_match and int(name_match.group(1)) != step:
        raise CheckpointError(f"{path}: manifest says step {step}")

    for record in files:
        file_path = contained_path(path, record.path)
        if not file_path.is_file():
            raise CheckpointError(f"{path}: missing file {record.path}")
        size = file_path.stat().st_size
        if size != record.size:
            raise CheckpointError(
                f"{path}: {record.path} has {size} bytes, manifest says {record.size}"
            )
        if verify_hashes and sha256_of_file(file_path) != record.sha256:
            raise CheckpointError(f"{path}: {record.path} content hash mismatch")
    return checkpoint


# --------------------------------------------------------------------------------------------
# Store
# --------------------------------------------------------------------------------------------


class CheckpointStore:
    """Writes, prunes and finds checkpoints under one root directory.

    Only one process should write to a root at a time (the trainer driver); any number may read.
    """

    def __init__(self, root: Path, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self._pinned: dict[int, int] = {}
        """Steps `prune` must keep however old (a checkpoint being uploaded), with counts."""
        self._pin_lock = threading.Lock()

    def pin(self, step: int) -> None:
        """Keep `step` from pruning until as many `unpin` calls (an upload under way)."""
        with self._pin_lock:
            self._pinned[step] = self._pinned.get(step, 0) + 1

    def unpin(self, step: int) -> None:
        with self._pin_lock:
            left = self._pinned.get(step, 0) - 1
            if left > 0:
                self._pinned[step] = left
            else:
                self._pinned.pop(step, None)

    def read(self, step: int, verify_hashes: bool = True) -> Checkpoint:
        """The complete checkpoint of `step` (`CheckpointError` when it is not)."""
        return read_checkpoint(self.step_dir(step), verify_hashes=verify_hashes)

    def step_dir(self, step: int) -> Path:
        """Where the checkpoint for ``step`` lives once complete."""
        if not 0 <= step < 10**8:
            raise ValueError(f"step must be in [0, 1e8), got {step}")
        return self.root / f"{STEP_DIR_PREFIX}{step:08d}"

    @contextlib.contextmanager
    def writing(
        self,
        step: int,
        data_position: JSONValue = None,
        rng_state: RngState | None = None,
        extra: dict[str, JSONValue] | None = None,
    ) -> Iterator[Path]:
        """Context manager yielding a fresh directory to write checkpoint ``step`` into.

        On a normal exit the store writes the RNG state (``rng_state``, or this process's state
        captured on entry), hashes every file in the directory into ``manifest.json`` and renames
        the directory to ``step-<8 digits>``, replacing an existing checkpoint of the same step
        (but never a directory this store did not create). Then it prunes to the newest
        ``keep_last`` checkpoints. If the block raises, the directory is deleted and nothing else
        changes.

        Example::

            with store.writing(step, data_position=loader.position.to_json()) as directory:
                engine.save_checkpoint(str(directory))
        """
        state = rng_state if rng_state is not None else capture_rng_state()

        def finish(directory: Path) -> None:
            save_rng_state(state, directory / RNG_STATE_FILE)
            self._write_manifest(directory, step, data_position, extra or {})

        with self._staged(step, finish, "complete") as directory:
            yield directory

    @contextlib.contextmanager
    def importing(self, step: int) -> Iterator[Path]:
        """Context manager yielding a fresh directory to put a copy of checkpoint `step` into,
        manifest included (a download). On exit the copy must verify, every hash, before it is
        renamed into place; else it is deleted and `CheckpointError` says why."""

        def verify(directory: Path) -> None:
            copied = read_checkpoint(directory, verify_hashes=True)
            if copied.step != step:
                raise CheckpointError(f"{directory}: manifest says step {copied.step}, not {step}")
            for file_path in _content_files(directory):
                _fsync_path(file_path)
            _fsync_path(directory)

        with self._staged(step, verify, "imported") as directory:
            yield directory

    @contextlib.contextmanager
    def _staged(self, step: int, finish: Callable[[Path], None], done: str) -> Iterator[Path]:
        """A fresh temporary directory for checkpoint `step` beside the others. On a normal exit
        `finish` completes it, it is renamed into place (the commit point) and older ones are
        pruned; if anything raises, it is deleted and nothing else changes."""
        final_dir = self.step_dir(step)
        self.root.mkdir(parents=True, exist_ok=True)
        self.remove_leftovers()
        temp_dir = Path(tempfile.mkdtemp(prefix=f"{TEMP_DIR_PREFIX}{step:08d}-", dir=self.root))
        (temp_dir / MARKER_FILE).write_text("created by rlhf_trainer.state.checkpoint\n")
        try:
            yield temp_dir
            finish(temp_dir)
            self._move_into_place(temp_dir, final_dir)
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
        logger.info("checkpoint for step %d %s at %s", step, done, final_dir)
        self.prune()

    def _write_manifest(
        self, directory: Path, step: int, data_position: JSONValue, extra: dict[str, JSONValue]
    ) -> None:
        files = []
        for file_path in _content_files(directory):
            _fsync_path(file_path)
            files.append(
                {
                    "path": file_path.relative_to(directory).as_posix(),
                    "size": file_path.stat().st_size,
                    "sha256": sha256_of_file(file_path),
                }
            )
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "created_at": time.time(),
            "data_position": data_position,
            "rng_state_file": RNG_STATE_FILE,
            "extra": extra,
            "files": files,
        }
        manifest_path = directory / MANIFEST_FILE
        manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _fsync_path(manifest_path)
        _fsync_path(directory)

    def _move_into_place(self, temp_dir: Path, final_dir: Path) -> None:
        """Rename the finished directory to its final name (the commit point)."""
        if final_dir.exists() and not (final_dir / MARKER_FILE).is_file():
            raise CheckpointError(f"{final_dir} exists and was not created by this store")
        if final_dir.exists():
            # A retried step after resuming from an older checkpoint. Move the old one aside
            # first: a directory cannot be renamed onto a non-empty one.
            logger.warning("replacing existing checkpoint %s", final_dir)
            trash = Path(tempfile.mkdtemp(prefix=TRASH_DIR_PREFIX, dir=self.root))
            (trash / MARKER_FILE).write_text("")
            final_dir.rename(trash / final_dir.name)
            temp_dir.rename(final_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            temp_dir.rename(final_dir)
        _fsync_path(self.root)

    def step_dirs(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every ``step-N`` directory under root, newest first, unverified."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_DIR_PATTERN.match(child.name)
            if match and child.is_dir():
                found.append((int(match.group(1)), child))
        return sorted(found, reverse=True)

    def latest_complete(self, verify_hashes: bool = True) -> Checkpoint | None:
        """The newest checkpoint that verifies, or ``None`` when there is none.

        Corrupt or incomplete directories are skipped with a warning naming the problem, so a
        resume falls back to the previous good checkpoint. Temporary directories of interrupted
        writes are never considered.
        """
        for _step, path in self.step_dirs():
            try:
                return read_checkpoint(path, verify_hashes=verify_hashes)
            except CheckpointError as error:
                logger.warning("skipping checkpoint that does not verify: %s", error)
        return None

    def prune(self) -> list[Path]:
        """Delete checkpoints older than the newest ``keep_last`` complete ones.

        "Complete" here means the manifest parses and every file has its recorded size (hashes
        are not re-read: that would read every checkpoint on every save). Corrupt checkpoints
        newer than the oldest kept one are left for inspection. Returns the deleted paths.
        """
        kept = 0
        oldest_kept_step: int | None = None
        for step, path in self.step_dirs():
            try:
                read_checkpoint(path, verify_hashes=False)
            except CheckpointError:
                continue
            kept += 1
            oldest_kept_step = step
            if kept == self.keep_last:
                break
        if kept < self.keep_last or oldest_kept_step is None:
            return []

        deleted = []
        with self._pin_lock:
            pinned = set(self._pinned)
        for step, path in self.step_dirs():
            if step < oldest_kept_step and step not in pinned and (path / MARKER_FILE).is_file():
                shutil.rmtree(path)
                deleted.append(path)
                logger.info("pruned checkpoint %s", path)
        return deleted

    def remove_leftovers(self) -> list[Path]:
        """Delete temporary directories left behind by interrupted writes. Returns them.

        Called before every write. Only directories with this store's temporary-name prefixes and
        marker file are touched.
        """
        if not self.root.is_dir():
            return []
        removed = []
        for child in self.root.iterdir():
            is_ours = child.name.startswith((TEMP_DIR_PREFIX, TRASH_DIR_PREFIX))
            if is_ours and child.is_dir() and (child / MARKER_FILE).is_file():
                logger.warning("removing leftover of an interrupted checkpoint write: %s", child)
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
        return removed
