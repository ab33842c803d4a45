"""What a weight sync sends: the plan of buckets (which tensor pieces each holds, aligned and
typed), and a module's parameters in the order the plan names them, ZeRO-3 ones gathered a
module at a time."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

NamedTensors = list[tuple[str, torch.Tensor]]

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
"""Bucket size on GPU; CPU tests use a few KiB to exercise splitting."""
ALIGNMENT = 64
"""Byte alignment of every piece in a bucket, so any dtype can be viewed in place."""


# --------------------------------------------------------------------------------------------
# The plan: what each bucket holds
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorPiece:
    """A byte range of one named tensor, stored at `bucket_offset` in its bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """A torch dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``."""
    tensor_nbytes: int
    tensor_offset: int
    """Where this piece starts within the tensor's bytes (0 for a whole or first piece)."""
    bucket_offset: int
    nbytes: int

    @property
    def is_last(self) -> bool:
        """True when this piece completes its tensor."""
        return self.tensor_offset + self.nbytes == self.tensor_nbytes


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    """Bytes actually broadcast (the used prefix of the bucket buffer)."""
    pieces: tuple[TensorPiece, ...]


@dataclass(frozen=True)
class SyncPlan:
    """The layout of one sync: buckets in broadcast order and the policy version they carry."""

    version: int
    bucket_bytes: int
    buckets: tuple[Bucket, ...]

    @property
    def total_bytes(self) -> int:
        return sum(bucket.nbytes for bucket in self.buckets)

    @property
    def num_tensors(self) -> int:
        return sum(piece.is_last for bucket in self.buckets for piece in bucket.pieces)

    def digest(self) -> int:
        """A 63-bit fingerprint of the whole layout (sent in-band to catch mismatched plans)."""
        hasher = hashlib.blake2b(digest_size=8)
        hasher.update(repr((self.version, self.bucket_bytes, self.buckets)).encode())
        return int.from_bytes(hasher.digest(), "little") & (2**63 - 1)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, ints, strings) for transports that do not pickle, such as vLLM's
        ``collective_rpc``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | SyncPlan) -> SyncPlan:
        if isinstance(data, SyncPlan):
            return data
        buckets = tuple(
            Bucket(
                nbytes=int(bucket["nbytes"]),
                pieces=tuple(
                    TensorPiece(**{**piece, "shape": tuple(piece["shape"])})
                    for piece in bucket["pieces"]
                ),
            )
            for bucket in data["buckets"]
        )
        return cls(int(data["version"]), int(data["bucket_bytes"]), buckets)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def _align(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def plan_weight_sync(
    metadata: Iterable[tuple[str, Sequence[int], torch.dtype | str]],
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> SyncPlan:
    """Lay out tensors, in the given order, into buckets of at most `bucket_bytes`.

    `metadata` is ``(name, shape, dtype)`` per tensor, in exactly the order the sender will
    yield the tensors. Pieces start at `ALIGNMENT`-byte offsets; a tensor that does not fit in
    the space left is split, its first piece filling the current bucket.
    """
    if bucket_bytes < ALIGNMENT or bucket_bytes % ALIGNMENT:
        raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGNMENT}")
    buckets: list[Bucket] = []
    pieces: list[TensorPiece] = []
    used = 0  # bytes used in the bucket being filled (always aligned)

    def close_bucket() -> None:
        nonlocal pieces, used
        if pieces:
            end = pieces[-1].bucket_offset + pieces[-1].nbytes
            buckets.append(Bucket(nbytes=end, pieces=tuple(pieces)))
        pieces, used = [], 0

    seen: set[str] = set()
    for name, shape, dtype in metadata:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the sync metadata")
        seen.add(name)
        dtype_str = dtype if isinstance(dtype, str) else dtype_name(dtype)
        element_size = torch.empty((), dtype=dtype_from_name(dtype_str)).element_size()
        shape_tuple = tuple(int(size) for size in shape)
        tensor_nbytes = element_size * int(torch.Size(shape_tuple).numel())
        tensor_offset = 0
        while True:
            if used == bucket_bytes:
                close_bucket()
            take = min(tensor_nbytes - tensor_offset, bucket_bytes - used)
            pieces.append(
                TensorPiece(
                    name=name,
                    shape=shape_tuple,
                    dtype=dtype_str,
                    tensor_nbytes=tensor_nbytes,
                    tensor_offset=tensor_offset,
                    bucket_offset=used,
                    nbytes=take,
                )
            )
            tensor_offset += take
            used = min(_align(used + take), bucket_bytes)
            if tensor_offset == tensor_nbytes:
                break
    close_bucket()
    return SyncPlan(version=int(version), bucket_bytes=bucket_bytes, buckets=tuple(buckets))


def tensor_metadata(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of materialised tensors (a plain, non-ZeRO model)."""
    return [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in named_tensors]


# --------------------------------------------------------------------------------------------
# ZeRO-3 helpers for the sending side
# --------------------------------------------------------------------------------------------


def _unique_parameters_by_module(module: nn.Module) -> Iterator[tuple[str, list[tuple[str, Any]]]]:
    """``(module name, [(full param name, param), ...])`` with tied parameters listed once,
    in ``module.named_parameters()`` order."""
    seen: set[int] = set()
    for module_name, submodule in module.named_modules():
        params = []
        for param_name, param in submodule.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            params.append((f"{module_name}.{param_name}" if module_name else param_name, param))
        if params:
            yield module_name, params


def zero3_parameter_metadata(module: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, full shape, dtype)`` of a (possibly ZeRO-3 partitioned) module, without gathering.

    Uses DeepSpeed's ``ds_shape`` where present, so it works on any trainer rank. The order
    matches `iter_zero3_parameters`.
    """
    return [
        (name, tuple(getattr(param, "ds_shape", param.shape)), param.dtype)
        for _, params in _unique_parameters_by_module(module)
        for name, param in params
    ]


ParameterGroups = list[tuple[str, list[tuple[str, Any]]]]
"""``(module name, [(full param name, parameter), ...])`` per submodule (`parameter_groups`)."""


def parameter_groups(module: nn.Module) -> ParameterGroups:
    """`module`'s parameters grouped by submodule, tied ones once: the walk that
    `iter_module_parameters` repeats, done once (the parameter objects outlive their data)."""
    return list(_unique_parameters_by_module(module))


def iter_module_parameters(
    module: nn.Module, groups: ParameterGroups | None = None
) -> Iterator[tuple[NamedTensors, bool]]:
    """Each submodule's full parameters as ``(tensors, transient)``, gathering under ZeRO-3.

    The gather is a collective over the trainer's default group: **every trainer rank** must
    run this iterator to the end, in step. ``transient`` tensors (gathered ZeRO-3 partitions)
    are freed once the iterator advances; without ZeRO-3 (no ``ds_id``) they stay valid.
    `groups` (`parameter_groups` of `module`) saves walking the module tree again.
    """
    for _, params in groups if groups is not None else _unique_parameters_by_module(module):
        partitioned = [param for _, param in params if hasattr(param, "ds_id")]
        if partitioned:
            import deepspeed  # lazy: only ZeRO-3 trainers have it loaded

            gather = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
        else:
            gather = contextlib.nullcontext()
        with gather, torch.no_grad():
            yield [(name, param.data) for name, param in params], bool(partitioned)


def iter_zero3_parameters(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield full parameters one at a time (see `iter_module_parameters`); a yielded tensor is
    valid until the iterator advances."""
    for tensors, _ in iter_module_parameters(module):
        yield from tensors
