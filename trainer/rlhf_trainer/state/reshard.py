"""A role's training state in a form that loads on any number of ranks and any ZeRO stage.

A DeepSpeed checkpoint (`engine.save_checkpoint`) holds each rank's flat partition and loads
back only into the same number of ranks. Here every rank writes, for each parameter, the part
of the *whole* (flattened) tensor it owns, with that part's address: its fp32 master weights
and its AdamW moments, in one safetensors file per kind and rank. Rank 0 adds `STATE_FILE`,
which holds what all ranks share (the optimizer's step count, the learning rate and its
scheduler, the engine's counters). A rank that loads asks each parameter for the addresses it
owns now and copies them out of whichever saved parts cover them (`copies_for`), so a
checkpoint of 2 ranks loads into 1 or 3, and one written under ZeRO-3 loads under ZeRO-2 or
without ZeRO (a 2-GPU group that restarts on one GPU changes stage: `zero.zero_stage`).

What a rank owns, by stage:

* **ZeRO-3**: a contiguous slice of every parameter (`param.ds_tensor`), the same slice of its
  fp32 master and moments. Every rank writes its slices; nothing is gathered.
* **ZeRO-1/2, bf16 without ZeRO**: whole weights, a slice of the fp32 state that DeepSpeed's
  `safe_get_full_*` gathers; rank 0 writes the whole tensors.
* **no ZeRO, fp32**: the parameters are their own masters; rank 0 writes them.

Layout of one role's directory (the checkpoint store hashes every file)::

    state.json                      format, world size, stage, step count, lr, scheduler
    fp32-rank00000.safetensors      per kind and writing rank: {parameter name: flat part},
    exp_avg-rank00000.safetensors   the parts' addresses in the file's metadata
    exp_avg_sq-rank00000.safetensors
    rng-rank0.pt                    each rank's RNG states (`rng_file`, written by the rank)

The pure parts (addresses, which saved parts make up a wanted one) come first; the functions
on a live DeepSpeed engine (`save_engine_state`, `load_engine_state`) after them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_trainer.seeds import mix

FORMAT = "rlhf-zero-parts/1"
STATE_FILE = "state.json"
MASTER = "fp32"
"""The kind of the fp32 master weights (the optimizer's moments are named as AdamW names them)."""
MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-element state (`actors.ZeroWorker._training_engine` builds AdamW)."""


class ReshardError(Exception):
    """A role directory that is not in this format, or whose parts do not cover a tensor."""


# --------------------------------------------------------------------------------------------
# Addresses (pure)


@dataclass(frozen=True)
class Part:
    """Elements ``[start, start + numel)`` of a flattened tensor."""

    start: int
    numel: int

    @property
    def stop(self) -> int:
        return self.start + self.numel


def zero3_part(numel: int, partition_numel: int, rank: int) -> Part:
    """What ZeRO-3 rank `rank` owns of a tensor of `numel` elements split into partitions of
    `partition_numel` (the last ones end in padding, which is not part of the tensor)."""
    start = min(rank * partition_numel, numel)
    return Part(start, max(0, min(partition_numel, numel - start)))


@dataclass(frozen=True)
class Copy:
    """Elements of saved part number `source` that land in a wanted part."""

    source: int
    source_offset: int
    """Where they start inside the saved part."""
    target_offset: int
    """Where they go inside the wanted part."""
    numel: int


def copies_for(saved: Sequence[Part], wanted: Part) -> list[Copy]:
    """How to fill `wanted` from `saved` parts (in any order, possibly overlapping): the copies
    in address order. ReshardError when the saved parts leave a gap in it."""
    copies: list[Copy] = []
    position = wanted.start
    for index in sorted(range(len(saved)), key=lambda i: saved[i].start):
        part = saved[index]
        if position >= wanted.stop:
            break
        if part.stop <= position or part.numel == 0:
            continue
        if part.start > position:
            break  # a gap: nothing saved covers `position`
        stop = min(part.stop, wanted.stop)
        copies.append(Copy(index, position - part.start, position - wanted.start, stop - position))
        position = stop
    if position < wanted.stop:
        raise ReshardError(
            f"the saved parts cover elements up to {position} of [{wanted.start}, {wanted.stop})"
        )
    return copies


def shard_file(kind: str, rank: int) -> str:
    """The file of one kind of state (`MASTER` or a moment) written by one rank."""
    return f"{kind}-rank{rank:05d}.safetensors"


def rng_file(rank: int) -> str:
    """The RNG states of one rank (`checkpoint.save_rng_state`), next to its parts."""
    return f"rng-rank{rank}.pt"


# --------------------------------------------------------------------------------------------
# RNG after a resize

RESIZED_RANK = "rlhf-resized-rank"


def resized_rank_seed(seed: int, step: int, rank: int) -> int:
    """The seed of every RNG of rank `rank` resuming at `step` in a group of another size than
    the one that saved the checkpoint. Per-rank RNG files cannot map across a resize (which of
    two ranks' states would one rank continue?), so no rank restores one: each seeds its RNGs
    from the run's seed, the step and its rank. Nothing a step samples or trains on draws from
    them today (sampling seeds come from the driver, `seeds.step_seed`; the models run without
    dropout), so a resized run still repeats the uninterrupted one; a model with dropout would
    draw other masks after a resize."""
    return mix(RESIZED_RANK, seed, step, rank)


def seed_every_rng(seed: int) -> None:
    """Python's, NumPy's and torch's RNGs (every device's) from one seed."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------------------
# Files


@dataclass(frozen=True)
class SavedState:
    """What `STATE_FILE` says: shared by every rank, written by rank 0."""

    world_size: int
    zero_stage: int
    kinds: tuple[str, ...]
    """`MASTER`, and the moments once the optimizer has stepped."""
    optimizer_step: int
    learning_rate: float
    lr_scheduler: dict[str, Any] | None
    counters: dict[str, int]
    """The engine's `global_steps`, `global_samples` and `skipped_steps`."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "world_size": self.world_size,
                "zero_stage": self.zero_stage,
                "kinds": list(self.kinds),
                "optimizer_step": self.optimizer_step,
                "learning_rate": self.learning_rate,
                "lr_scheduler": self.lr_scheduler,
                "counters": self.counters,
            },
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> SavedState:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ReshardError(f"unknown state format {data.get('format')!r}")
        return cls(
            world_size=int(data["world_size"]),
            zero_stage=int(data["zero_stage"]),
            kinds=tuple(data["kinds"]),
            optimizer_step=int(data["optimizer_step"]),
            learning_rate=float(data["learning_rate"]),
            lr_scheduler=data["lr_scheduler"],
            counters={name: int(value) for name, value in data["counters"].items()},
        )


def is_saved_state(directory: Path) -> bool:
    """Whether `directory` holds a role's state in this format (not a DeepSpeed checkpoint)."""
    return (directory / STATE_FILE).is_file()


def read_saved_state(directory: Path) -> SavedState:
    try:
        return SavedState.from_json((directory / STATE_FILE).read_text())
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ReshardError(f"{directory / STATE_FILE}: {error}") from error


def write_parts(
    path: Path, parts: Mapping[str, tuple[Part, Tensor]], shapes: Mapping[str, Sequence[int]]
) -> None:
    """One file of parts: the tensors by parameter name, their addresses and whole shapes in
    the metadata (safetensors: no pickle, so loading runs no code)."""
    PartFile.of(parts, shapes).write(path)


Slot = tuple[str, int]
"""A host buffer's key and size in elements."""


class HostBuffers:
    """Host memory a rank copies its state into, kept from one checkpoint to the next: pinned
    (page-locked) when the state is on a GPU, so the copies run at the link's speed (measured:
    28 GB/s on an H200; into ordinary memory, 0.6). Pinning gigabytes takes seconds, so a rank
    pins its buffers at start on a thread (`reserve_host_buffers`), beside its first steps."""

    def __init__(self) -> None:
        self._pinned: dict[Slot, Tensor] = {}
        self._pinning: threading.Thread | None = None

    def pin(self, wanted: list[tuple[Slot, torch.dtype]]) -> None:
        """Pin buffers for `wanted` on a thread of their own."""
        self.wait_allocated()
        self._pinning = threading.Thread(
            target=self._allocate, args=(wanted,), name="pin-checkpoint-buffers", daemon=True
        )
        self._pinning.start()

    def wait_allocated(self) -> None:
        """Until the buffers asked for are pinned (a snapshot never copies beside the pinning)."""
        if self._pinning is not None:
            self._pinning.join()

    def _allocate(self, wanted: list[tuple[Slot, torch.dtype]]) -> None:
        for slot, dtype in wanted:
            if slot not in self._pinned:
                self._pinned[slot] = torch.empty(slot[1], dtype=dtype, pin_memory=True)

    def copy(self, key: str, tensor: Tensor) -> Tensor:
        """A flat host copy of `tensor`; from a GPU into a pinned buffer (pinned now if none
        was reserved), asynchronous (see `synchronize`); the buffer is reused by the next
        checkpoint's copy of `key`."""
        flat = tensor.detach().reshape(-1)
        if flat.device.type == "cpu":
            return flat.clone()
        slot = (key, flat.numel())
        buffer = self._pinned.get(slot)
        if buffer is None or buffer.dtype != flat.dtype:
            buffer = self._pinned[slot] = torch.empty(
                flat.numel(), dtype=flat.dtype, pin_memory=True
            )
        return buffer.copy_(flat, non_blocking=True)

    @staticmethod
    def synchronize() -> None:
        """Wait for every copy from a GPU (they were queued on the current stream)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()


@dataclass(frozen=True)
class PartFile:
    """What one file of parts holds, in host memory: written by `write`, now or later."""

    tensors: dict[str, Tensor]
    metadata: dict[str, str]

    @classmethod
    def of(
        cls,
        parts: Mapping[str, tuple[Part, Tensor]],
        shapes: Mapping[str, Sequence[int]],
        buffers: HostBuffers | None = None,
        prefix: str = "",
    ) -> PartFile:
        """Own contiguous host copies of `parts`: they are views of DeepSpeed's flat buffers,
        which safetensors refuses (shared storage), and may live on a GPU."""
        buffers = buffers if buffers is not None else HostBuffers()
        metadata = {
            "format": FORMAT,
            "parts": json.dumps(
                {name: [part.start, part.numel] for name, (part, _) in parts.items()}
            ),
            "shapes": json.dumps({name: list(shapes[name]) for name in parts}),
        }
        tensors = {name: buffers.copy(prefix + name, t) for name, (_, t) in parts.items()}
        buffers.synchronize()
        return cls(tensors, metadata)

    def write(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file(self.tensors, str(path), metadata=self.metadata)


class PartReader:
    """Every rank's file of one kind: reads a parameter's wanted elements from the saved parts
    that cover them, touching only those bytes (safetensors reads slices lazily)."""

    def __init__(self, directory: Path, kind: str, world_size: int) -> None:
        from safetensors import safe_open

        self.files: list[Any] = []
        self.parts: dict[str, list[tuple[int, Part]]] = {}
        self.shapes: dict[str, list[int]] = {}
        for rank in range(world_size):
            path = directory / shard_file(kind, rank)
            if not path.is_file():
                raise ReshardError(f"{path} is missing (the state was saved by {world_size} ranks)")
            handle = safe_open(str(path), framework="pt")
            metadata = handle.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise ReshardError(f"{path}: unknown format {metadata.get('format')!r}")
            for name, (start, numel) in json.loads(metadata["parts"]).items():
                self.parts.setdefault(name, []).append((len(self.files), Part(start, numel)))
            self.shapes.update(json.loads(metadata["shapes"]))
            self.files.append(handle)

    def read(self, name: str, wanted: Part) -> Tensor:
        """Elements `wanted` of parameter `name`, flat, float32."""
        saved = self.parts.get(name)
        if saved is None:
            raise ReshardError(f"no saved state for parameter {name!r}")
        out = torch.empty(wanted.numel, dtype=torch.float32)
        for copy in copies_for([part for _, part in saved], wanted):
            file_index, _ = saved[copy.source]
            piece = self.files[file_index].get_slice(name)
            out[copy.target_offset : copy.target_offset + copy.numel] = piece[
                copy.source_offset : copy.source_offset + copy.numel
            ]
        return out


def whole_tensors(directory: Path, kind: str = MASTER) -> dict[str, Tensor]:
    """Every parameter of a role's saved state, whole and shaped (the trained model, for
    export and tests), whatever the world size that saved it."""
    state = read_saved_state(directory)
    reader = PartReader(directory, kind, state.world_size)
    result = {}
    for name, shape in reader.shapes.items():
        numel = int(torch.Size(shape).numel())
        result[name] = reader.read(name, Part(0, numel)).view(shape)
    return result


# --------------------------------------------------------------------------------------------
# A live engine


def _trainable(module: nn.Module) -> Iterator[tuple[str, Any]]:
    """The parameters the optimizer updates, in the module's (every rank's same) order (typed
    `Any`: DeepSpeed adds its own attributes, ``ds_tensor`` and the like)."""
    for name, param in module.named_parameters():
        if param.requires_grad:
            yield name, param


def _shape(param: Any) -> tuple[int, ...]:
    return tuple(param.ds_shape) if hasattr(param, "ds_id") else tuple(param.shape)


def _numel(param: Any) -> int:
    return int(param.ds_numel) if hasattr(param, "ds_id") else param.numel()


def _partition_rank(param: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group=getattr(param, "ds_process_group", None))


def _base_state(engine: Any) -> dict[Any, dict[str, Any]]:
    """The torch optimizer's per-tensor state (keyed by DeepSpeed's flat fp32 partitions under
    ZeRO, by the parameters without it)."""
    return engine.basic_optimizer.state


def _owned_part(engine: Any, param: Any, kind: str, rank: int) -> tuple[Part, Tensor] | None:
    """The part of `kind` of `param` that this rank writes (None: another rank writes it).

    Below ZeRO-3 the gathers are collectives: every rank must call this for every parameter
    and kind, in the same order.
    """
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_optimizer_state,
    )

    if hasattr(param, "ds_id"):  # ZeRO-3: this rank's slice, no communication
        local = (
            safe_get_local_fp32_param(param)
            if kind == MASTER
            else safe_get_local_optimizer_state(param, kind)
        )
        part = zero3_part(_numel(param), local.numel(), _partition_rank(param))
        return part, local.reshape(-1)[: part.numel]
    if hasattr(param, "_hp_mapping"):  # ZeRO-1/2 or bf16: fp32 state gathered on every rank
        whole = (
            safe_get_full_fp32_param(param)
            if kind == MASTER
            else safe_get_full_optimizer_state(param, kind)
        )
    else:  # no ZeRO, fp32: the parameter is its own master
        whole = param.detach() if kind == MASTER else _base_state(engine)[param][kind]
    return (Part(0, param.numel()), whole.reshape(-1)) if rank == 0 else None


def _optimizer_step(engine: Any) -> int:
    steps = {int(state["step"]) for state in _base_state(engine).values() if "step" in state}
    if len(steps) > 1:
        raise ReshardError(f"the optimizer's tensors are at different steps: {sorted(steps)}")
    return steps.pop() if steps else 0


@dataclass(frozen=True)
class EngineSnapshot:
    """One rank's parts of a role's training state, copied to host memory by
    `snapshot_engine_state`: `write` puts them into a checkpoint directory, then or later
    (a background checkpoint writes while training goes on)."""

    files: dict[str, PartFile]
    state_json: str | None
    """Rank 0's `SavedState` (the group's size, ZeRO stage, optimizer step, scheduler and
    counters), as the text it writes: serialised at once, since the scheduler goes on."""

    def write(self, directory: Path) -> None:
        """Into `directory`, whose parent must exist: a write that outlived its checkpoint
        (its driver gone, the temporary directory removed) fails instead of recreating it."""
        directory.mkdir(exist_ok=True)
        for name, part_file in self.files.items():
            part_file.write(directory / name)
        if self.state_json is not None:
            (directory / STATE_FILE).write_text(self.state_json + "\n")


def snapshot_engine_state(
    engine: Any, rank: int, world_size: int, buffers: HostBuffers | None = None
) -> EngineSnapshot:
    """This rank's parts of `engine`'s training state, copied to host memory (into `buffers`,
    reused across checkpoints). Every rank of the group calls it: below ZeRO-3 the gathers are
    collectives."""
    if buffers is not None:
        buffers.wait_allocated()
    prologue = getattr(engine.optimizer, "checkpoint_event_prologue", None)
    if prologue is not None:
        prologue()  # ZeRO-3: every parameter back to its partition
    kinds = (MASTER, *MOMENTS) if _base_state(engine) else (MASTER,)
    params = list(_trainable(engine.module))
    shapes = {name: _shape(param) for name, param in params}
    files = {}
    for kind in kinds:
        parts = {}
        for name, param in params:
            owned = _owned_part(engine, param, kind, rank)
            if owned is not None:
                parts[name] = owned
        files[shard_file(kind, rank)] = PartFile.of(parts, shapes, buffers, prefix=f"{kind}/")
    state_json = None
    if rank == 0:
        scheduler = engine.lr_scheduler
        state_json = SavedState(
            world_size=world_size,
            zero_stage=int(engine.zero_optimization_stage()),
            kinds=kinds,
            optimizer_step=_optimizer_step(engine),
            learning_rate=float(engine.get_lr()[0]),
            lr_scheduler=scheduler.state_dict() if scheduler is not None else None,
            counters={
                "global_steps": int(engine.global_steps),
                "global_samples": int(engine.global_samples),
                "skipped_steps": int(engine.skipped_steps),
            },
        ).to_json()
    return EngineSnapshot(files, state_json)


def reserve_host_buffers(engine: Any, rank: int, buffers: HostBuffers) -> None:
    """Start pinning the host buffers `snapshot_engine_state` copies this rank's state of a
    GPU engine into: its master weights' parts and, of the same sizes, AdamW's two moments
    (which exist only after the first step). Every rank of the group calls it, as for a
    snapshot; the pinning itself runs on a thread."""
    if not torch.cuda.is_available():
        return
    prologue = getattr(engine.optimizer, "checkpoint_event_prologue", None)
    if prologue is not None:
        prologue()
    wanted = []
    for name, param in _trainable(engine.module):
        owned = _owned_part(engine, param, MASTER, rank)
        if owned is not None:
            tensor = owned[1]
            wanted += [((f"{kind}/{name}", tensor.numel()), tensor.dtype)
                       for kind in (MASTER, *MOMENTS)]  # fmt: skip
    buffers.pin(wanted)


def save_engine_state(engine: Any, directory: Path, rank: int, world_size: int) -> None:
    """Write this rank's parts of `engine`'s training state into `directory` (every rank of
    the group calls it; rank 0 also writes `STATE_FILE`)."""
    directory.mkdir(parents=True, exist_ok=True)
    snapshot_engine_state(engine, rank, world_size).write(directory)


def _set_part(engine: Any, param: Any, kind: str, reader: PartReader, name: str) -> None:
    """Copy this rank's part of `kind` of `param` out of the saved parts."""
    from deepspeed.utils import (
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    numel = _numel(param)
    if list(reader.shapes.get(name, [])) != list(_shape(param)):
        raise ReshardError(
            f"{name}: saved shape {reader.shapes.get(name)} but the model has {_shape(param)}"
        )
    if hasattr(param, "ds_id"):  # ZeRO-3: only this rank's slice, padded as DeepSpeed keeps it
        partition = param.ds_tensor
        part = zero3_part(numel, partition.numel(), _partition_rank(param))
        local = torch.zeros(partition.numel(), dtype=torch.float32)
        local[: part.numel] = reader.read(name, part)
        local = local.to(partition.device)
        if kind == MASTER:
            safe_set_local_fp32_param(param, local)
            partition.data.copy_(local.view_as(partition))  # the working (bf16) weights too
        else:
            safe_set_local_optimizer_state(param, local, kind)
        return
    whole = reader.read(name, Part(0, numel)).view(_shape(param)).to(param.device)
    if hasattr(param, "_hp_mapping"):
        if kind == MASTER:
            safe_set_full_fp32_param(param, whole)
        else:
            safe_set_full_optimizer_state(param, whole, kind)
    elif kind != MASTER:
        _base_state(engine)[param][kind].copy_(whole)
    if kind == MASTER:
        param.data.copy_(whole)  # every rank holds whole working weights below ZeRO-3


def load_engine_state(
    engine: Any, directory: Path, initialise_optimizer: Callable[[], None]
) -> SavedState:
    """Load a role's saved state into `engine`, whatever world size and stage saved it (every
    rank of the group calls it). Returns what `STATE_FILE` says.

    A fresh optimizer has no state until its first step, and DeepSpeed only links its flat
    state to the parameters then; `initialise_optimizer` takes one step that changes nothing
    (zero gradients), after which every value it created is overwritten here.
    """
    saved = read_saved_state(directory)
    has_moments = all(kind in saved.kinds for kind in MOMENTS)
    if has_moments and not _base_state(engine):
        initialise_optimizer()
    prologue = getattr(engine.optimizer, "checkpoint_event_prologue", None)
    if prologue is not None:
        prologue()
    for kind in saved.kinds:
        reader = PartReader(directory, kind, saved.world_size)
        for name, param in _trainable(engine.module):
            _set_part(engine, param, kind, reader, name)
    for state in _base_state(engine).values():
        if "step" in state:
            step = state["step"]
            if torch.is_tensor(step):
                step.fill_(saved.optimizer_step)
            else:
                state["step"] = saved.optimizer_step
    if saved.lr_scheduler is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(saved.lr_scheduler)
    for group in engine.basic_optimizer.param_groups:
        group["lr"] = saved.learning_rate
    engine.global_steps = saved.counters["global_steps"]
    engine.global_samples = saved.counters["global_samples"]
    engine.skipped_steps = saved.counters["skipped_steps"]
    epilogue = getattr(engine.optimizer, "checkpoint_event_epilogue", None)
    if epilogue is not None:
        epilogue()  # ZeRO-3: parameters kept whole on every rank are gathered again
    return saved
