"""A trained policy as a plain Hugging Face model directory, offline, from a checkpoint.

A checkpoint holds the policy's fp32 master weights as parts written by any number of ranks
under any ZeRO stage (`rlhf_trainer.state.reshard`); serving or evaluating it needs one
directory that ``from_pretrained`` reads (safetensors weights, ``config.json``, the tokenizer
with its chat template, ``generation_config.json``). `export_checkpoint` reassembles each
parameter, loads them strictly into a fresh model of the policy's config, casts and saves it;
the directory appears atomically (a failed export leaves nothing half-written).

The config and tokenizer come from the checkpoint when the trainer saved them there
(`ModelFiles`, in ``policy/hf/``: small, and the checkpoint describes itself), else from
`model_dir`, the policy's Hugging Face directory (`spec.model.policy`). CHECKPOINT may also be
a run directory (its newest complete checkpoint) or a policy directory::

    python -m rlhf_trainer.state.export CHECKPOINT OUT [--model-dir DIR] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlhf_trainer.modeling.networks import DTYPES, model_config
from rlhf_trainer.modeling.pretrained import holds_tokenizer
from rlhf_trainer.state import checkpoint as ckpt
from rlhf_trainer.state import reshard
from rlhfjob.api import ModelSpec

logger = logging.getLogger(__name__)

POLICY_DIR = "policy"
"""The policy's state directory in a checkpoint (`ranks.actors.PolicyWorker.state_dir`)."""
MODEL_FILES_DIR = "hf"
"""Where in the policy's state directory the trainer keeps its `ModelFiles`."""
CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"


class ExportError(Exception):
    """A checkpoint that cannot become a model: unverified, no config, a part missing, ..."""


@dataclass
class ModelFiles:
    """What turns the policy's weights into a Hugging Face model besides the weights: its
    config (in the job's dtype), tokenizer (chat template included) and generation config."""

    config: Any
    tokenizer: Any | None
    generation: Any

    @classmethod
    def of_spec(cls, model: ModelSpec) -> ModelFiles:
        """The policy's files as the job names them: its config (`randomInit` or `policy`), the
        tokenizer `data.tokenizer.load_tokenizer` picks (none for a token-id job)."""
        from transformers import AutoTokenizer, GenerationConfig

        config = model_config(model)
        config.dtype = model.dtype  # the dtype the job trains in: the export's default
        policy = Path(model.policy) if model.policy is not None else None
        source = model.tokenizer or (policy if policy and holds_tokenizer(policy) else None)
        tokenizer = AutoTokenizer.from_pretrained(source) if source is not None else None
        generation = None
        if policy is not None and (policy / GENERATION_FILE).is_file():
            generation = GenerationConfig.from_pretrained(policy)
        return cls(config, tokenizer, _with_token_ids(config, tokenizer, generation))

    @classmethod
    def read(cls, directory: Path) -> ModelFiles:
        """The files saved in `directory` (by `save`, or a Hugging Face model directory)."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        if not (directory / CONFIG_FILE).is_file():
            raise ExportError(f"{directory}: no {CONFIG_FILE}")
        has_tokenizer = holds_tokenizer(directory)
        has_generation = (directory / GENERATION_FILE).is_file()
        try:
            config = AutoConfig.from_pretrained(directory)
            tokenizer = AutoTokenizer.from_pretrained(directory) if has_tokenizer else None
            generation = GenerationConfig.from_pretrained(directory) if has_generation else None
        except (OSError, ValueError) as error:  # what transformers raises for a broken file
            raise ExportError(f"{directory}: {error}") from error
        return cls(config, tokenizer, _with_token_ids(config, tokenizer, generation))

    def save(self, directory: Path) -> None:
        """Into `directory` (the trainer: each checkpoint's ``policy/hf``)."""
        directory.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(directory)
        self.generation.save_pretrained(directory)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)


def save_model_files(model: ModelSpec, directory: Path) -> None:
    """The trainer's copy of the policy's `ModelFiles` in a checkpoint: a failure costs only
    that (an export then needs `model_dir`), never the checkpoint."""
    try:
        ModelFiles.of_spec(model).save(directory)
    except (OSError, ValueError) as error:
        logger.warning("%s: no model files (export will need --model-dir): %s", directory, error)


def _with_token_ids(config: Any, tokenizer: Any | None, generation: Any | None) -> Any:
    """`generation` (else one from `config`) with the end and pad token ids filled in from the
    tokenizer where missing: a served model must know where a response ends."""
    from transformers import GenerationConfig

    if generation is None:
        generation = GenerationConfig.from_model_config(config)
    if tokenizer is not None:
        if generation.eos_token_id is None:
            generation.eos_token_id = tokenizer.eos_token_id
        if generation.pad_token_id is None:
            pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
            generation.pad_token_id = pad if pad is not None else eos
    return generation


def policy_directory(path: Path) -> Path:
    """The policy's state in `path`: a checkpoint (verified against its manifest), the newest
    complete checkpoint of a run directory (`CheckpointStore.latest_complete`), or a policy
    directory itself (unverified: it has no manifest)."""
    if reshard.is_saved_state(path):
        return path
    one = (path / ckpt.MANIFEST_FILE).is_file()
    checkpoint = ckpt.read_checkpoint(path) if one else ckpt.CheckpointStore(path).latest_complete()
    if checkpoint is None:
        raise ExportError(f"{path}: not a checkpoint, nor a run directory with a complete one")
    role = checkpoint.path / POLICY_DIR
    if not reshard.is_saved_state(role):
        raise ExportError(f"{checkpoint.path}: no policy state ({POLICY_DIR}/{reshard.STATE_FILE})")
    return role


def model_files(role: Path, model_dir: Path | None) -> ModelFiles:
    """The config, tokenizer and generation config: the checkpoint's own, else `model_dir`'s."""
    saved = role / MODEL_FILES_DIR
    if (saved / CONFIG_FILE).is_file():
        return ModelFiles.read(saved)
    if model_dir is not None:
        return ModelFiles.read(model_dir)
    raise ExportError(
        f"{role} holds no model config ({MODEL_FILES_DIR}/{CONFIG_FILE}); pass the policy's "
        "Hugging Face directory (spec.model.policy) as model_dir (--model-dir)"
    )


def default_dtype(config: Any) -> torch.dtype:
    """The config's dtype (the trainer saves the job's `spec.model.dtype`), else float32."""
    value = getattr(config, "dtype", None)
    if isinstance(value, torch.dtype):
        return value
    return DTYPES.get(str(value), torch.float32)


def _empty_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """A model of `config` in `dtype` whose weights are not initialised (every one is
    overwritten from the checkpoint: drawing random ones first takes minutes on a large
    model), its embeddings tied as the config says."""
    from transformers import AutoModelForCausalLM

    skip_init: Any
    try:
        from transformers.initialization import no_init_weights as skip_init
    except ImportError:  # older transformers: initialised, slower, the same result
        skip_init = contextlib.nullcontext
    with skip_init():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # skipped with the initialisation
    return model


def load_policy(role: Path, config: Any, dtype: torch.dtype) -> nn.Module:
    """A model of `config` in `dtype` holding the policy's saved fp32 weights, each parameter
    reassembled from every rank's parts (`reshard.PartReader`) one at a time, so the host never
    holds more than the model and one fp32 tensor. Strict: the saved parameters must be the
    model's (tied ones count once, as the trainer saves them), every one covered."""
    model = _empty_model(config, dtype)
    saved = reshard.read_saved_state(role)
    reader = reshard.PartReader(role, reshard.MASTER, saved.world_size)
    params = dict(model.named_parameters())
    missing, unexpected = params.keys() - reader.shapes, reader.shapes - params.keys()
    if missing or unexpected:
        raise ExportError(
            f"{role}: the saved parameters are not the model's: {len(missing)} missing "
            f"{sorted(missing)[:4]}, {len(unexpected)} unexpected {sorted(unexpected)[:4]}"
        )
    with torch.no_grad():
        for name, param in params.items():
            if (shape := list(param.shape)) != list(reader.shapes[name]):
                raise ExportError(f"parameter {name!r}: saved {reader.shapes[name]}, not {shape}")
            try:
                whole = reader.read(name, reshard.Part(0, param.numel()))
            except reshard.ReshardError as error:
                raise ExportError(f"parameter {name!r}: {error}") from error
            param.copy_(whole.view(param.shape))
    return model


def _refuse_to_replace(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty (overwrite it with --overwrite)")


@contextlib.contextmanager
def _staged(out: Path, overwrite: bool) -> Iterator[Path]:
    """A fresh directory beside `out` that replaces it on a normal exit (a rename: readers see
    the old directory or the whole new one) and is removed if anything raises."""
    _refuse_to_replace(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        yield staging
        staging.chmod(0o755)  # mkdtemp's is 0o700: the model is for others to read
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        if out.exists() or out.is_symlink():
            out.rename(old / out.name)  # a directory is not renamed onto a non-empty one
        staging.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def export_checkpoint(
    checkpoint: Path,
    out: Path,
    *,
    model_dir: Path | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the policy of `checkpoint` (see `policy_directory`) to `out` as a Hugging Face
    model directory in `dtype` (default: `default_dtype` of its config); refuses a non-empty
    `out` unless `overwrite`. Returns `out`."""
    out = Path(out)
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    try:
        role = policy_directory(Path(checkpoint))
        files = model_files(role, Path(model_dir) if model_dir is not None else None)
        target = DTYPES[dtype] if dtype is not None else default_dtype(files.config)
        _refuse_to_replace(out, overwrite)  # before the minutes of loading a large model
        model: Any = load_policy(role, files.config, target)
    except (ckpt.CheckpointError, reshard.ReshardError) as error:
        raise ExportError(str(error)) from error
    model.config.dtype = target
    model.generation_config = files.generation
    if files.tokenizer is None:
        logger.warning("%s: no tokenizer to export (the job works on token ids)", role)
    with _staged(out, overwrite) as staging:
        model.save_pretrained(staging)
        if files.tokenizer is not None:
            files.tokenizer.save_pretrained(staging)
    logger.info("exported %s to %s (%s)", role, out, target)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_trainer.state.export",
        description="Export a checkpoint's policy as a Hugging Face model directory.",
    )
    parser.add_argument("checkpoint", type=Path, help="a checkpoint, or a run directory")
    parser.add_argument("out", type=Path, help="the model directory to write")
    parser.add_argument("--model-dir", type=Path, help="the policy's Hugging Face directory")
    parser.add_argument("--dtype", choices=list(DTYPES), help="default: the job's model dtype")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(
            args.checkpoint, args.out, model_dir=args.model_dir, dtype=args.dtype,
            overwrite=args.overwrite,
        )  # fmt: skip
    except ExportError as error:
        print(f"export failed: {error}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
