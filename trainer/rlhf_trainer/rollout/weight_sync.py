"""Weight sync from trainer rank 0 to every rollout worker (design decision 7).

After each policy update the rollout engines must generate with the new weights. They get them
over a dedicated process group that joins **trainer rank 0** (sync rank 0, the only sender) with
**every rollout worker** (sync ranks 1..N; a vLLM engine with tensor parallelism ``tp`` is ``tp``
workers and so ``tp`` ranks). The group is built from its own ``TCPStore`` and backend object
(gloo on CPU, NCCL on GPU) and never touches ``torch.distributed``'s default group, which the
trainer ranks already use for DeepSpeed. The same code runs in CI (gloo) and on GPUs (NCCL).

What travels
------------
The weights are packed into fixed-size flat byte buckets, one broadcast per bucket. The sender
packs bucket ``k + 1`` while bucket ``k`` is still in flight (two buffers, async work handles),
so gathering ZeRO-3 parameters overlaps the network. A tensor larger than the space left in a
bucket is split across buckets, so memory stays bounded by two buckets on every rank.

Receivers must know the layout before the bytes arrive. The layout is a `SyncPlan` (per bucket:
which tensor pieces, their names, shapes, dtypes and offsets, plus the **policy version**),
computed on trainer rank 0 from parameter metadata only (`plan_weight_sync`; for ZeRO-3 use
`zero3_parameter_metadata`, which needs no gather) and handed to the receivers out of band by the
driver through Ray. Each sync starts with a tiny header broadcast (version, bucket count, plan
digest) so a receiver given a different plan fails loudly instead of loading garbage.

Failures
--------
Every wait is bounded: joining the group by ``connect_timeout_s`` (engines may still be starting)
and each broadcast by ``timeout_s``. A dead peer, a timeout, a plan mismatch or a failing load
raises `WeightSyncError` on the ranks that see it. A group that failed once is broken: later
calls raise at once, and the driver builds a new group (new store port) or restarts the job.

How the driver wires a sync (Ray actors; ``trainer0`` is trainer rank 0)
-------------------------------------------------------------------------
Once, after the engines are up::

    ranks = ray.get([e.weight_sync_ranks.remote() for e in engines])  # 1 per HF, tp per vLLM
    world_size = 1 + sum(ranks)
    info = ray.get(trainer0.open_weight_sync.remote(world_size))
    #   in the actor: self.sender = WeightSyncSender(world_size, backend=..., host=node_ip)
    #                 return self.sender.info          # SyncGroupInfo: host, port (TCPStore), ...
    first = 1
    joins = []
    for engine, n in zip(engines, ranks):
        joins.append(engine.init_weight_sync.remote(info, first))      # receivers join
        first += n
    ray.get([trainer0.connect_weight_sync.remote()] + joins)           # self.sender.connect()

Every sync (also once before the first rollout and after a resume)::

    plan = ray.get(trainer0.weight_sync_plan.remote(version))
    #   in the actor: plan_weight_sync(zero3_parameter_metadata(model), version, bucket_bytes)
    refs = [t.send_weights.remote(plan) for t in trainers]             # ALL trainer ranks:
    #   rank 0:  stats = self.sender.send(plan, iter_zero3_parameters(model))
    #   others:  for _ in iter_zero3_parameters(model): pass          # the gather is collective
    refs += [e.receive_weights.remote(plan) for e in engines]
    stats = ray.get(refs)   # rank 0's SyncStats -> metrics; any WeightSyncError surfaces here

Sender and receivers must be called concurrently (they meet in the broadcasts), which is why
the driver launches all remote calls before waiting on any of them.

On GPUs, give the trainer actors ``NCCL_CUMEM_ENABLE=0``: vLLM sets it in its workers, and NCCL
peers that disagree on it can hang. `WeightSyncSender.broadcast_bytes` times a bare broadcast
of the same bytes on the same group, the ceiling a sync is measured against.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from rlhf_trainer.rollout.sync_plan import (
    NamedTensors,
    SyncPlan,
    TensorPiece,
    dtype_from_name,
    dtype_name,
)

logger = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]
_MAGIC = 0x524C4846  # "RLHF": first word of the handshake and of every sync header.


class WeightSyncError(RuntimeError):
    """A weight sync (or joining the sync group) failed or timed out; the group is now unusable."""


# --------------------------------------------------------------------------------------------
# The group
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyncGroupInfo:
    """Everything a receiver needs to join; created by the sender, passed around by the driver."""

    host: str
    """Address of trainer rank 0, which hosts the TCPStore server."""
    port: int
    world_size: int
    """1 (the sender) + the number of receiving ranks."""
    backend: Backend = "gloo"
    timeout_s: float = 120.0
    """Bound on each broadcast (and so on a stalled sync)."""
    connect_timeout_s: float = 600.0
    """Bound on joining the group (rollout engines may take minutes to start)."""
    group_name: str = "rlhf-weight-sync"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | SyncGroupInfo) -> SyncGroupInfo:
        return data if isinstance(data, SyncGroupInfo) else cls(**data)


@dataclass(frozen=True)
class SyncStats:
    """What one sync cost, for metrics (``rlhf_trainer_weight_sync_*``)."""

    version: int
    seconds: float
    bytes: int
    buckets: int
    tensors: int

    @property
    def bytes_per_second(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_host() -> str:
    """This node's address as other nodes see it: Ray's node IP if Ray is up, else the
    hostname's address (a pod IP in Kubernetes)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class _Group:
    """The sync process group of one rank: a store, a gloo/NCCL backend object, bounded waits."""

    def __init__(self, store: dist.Store, info: SyncGroupInfo, rank: int, device: torch.device):
        self.info = info
        self.rank = rank
        self.device = device
        self.broken = False
        prefixed = dist.PrefixStore(info.group_name, store)
        connect = timedelta(seconds=info.connect_timeout_s)
        try:
            if info.backend == "gloo":
                # The constructor rendezvouses with every rank (bounded by `connect`); afterwards
                # each operation gets the short timeout, so a stuck one fails (and frees its
                # worker thread) within `timeout_s`.
                self.pg: Any = dist.ProcessGroupGloo(prefixed, rank, info.world_size, connect)
                self.pg.set_timeout(timedelta(seconds=info.timeout_s))
            elif info.backend == "nccl":
                # NCCL connects lazily in the first collective (the handshake below). Its own
                # watchdog timeout is kept longer than our waits, so we raise (and abort the
                # communicator) before the watchdog would tear the process down.
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timedelta(seconds=2 * info.timeout_s + 60)
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, info.world_size, options)
            else:
                raise ValueError(f"unknown weight-sync backend {info.backend!r}")
            self._handshake()
        except WeightSyncError:
            raise
        except Exception as error:
            self.broken = True
            raise WeightSyncError(
                f"rank {rank} could not join weight-sync group {info.group_name!r} at "
                f"{info.host}:{info.port} (world size {info.world_size}): {error}"
            ) from error

    def _handshake(self) -> None:
        """One small broadcast: proves every rank is connected before the first real sync."""
        words = torch.tensor([_MAGIC, self.info.world_size], dtype=torch.int64, device=self.device)
        if self.rank != 0:
            words.zero_()
        self.wait(self.broadcast(words), what="handshake", timeout_s=self.info.connect_timeout_s)
        if words.tolist() != [_MAGIC, self.info.world_size]:
            raise WeightSyncError(f"bad weight-sync handshake {words.tolist()}")

    def broadcast(self, tensor: torch.Tensor) -> Any:
        self.check_usable()
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        try:
            return self.pg.broadcast([tensor], options)
        except Exception as error:
            self.fail()
            raise WeightSyncError(f"weight-sync broadcast failed on rank {self.rank}") from error

    def wait(self, work: Any, what: str, timeout_s: float | None = None) -> None:
        """Wait for `work` at most ``timeout_s`` (default: the group's), else raise."""
        timeout = self.info.timeout_s if timeout_s is None else timeout_s
        try:
            work.wait(timedelta(seconds=timeout))
        except Exception as error:
            self.fail()
            raise WeightSyncError(
                f"weight sync failed on rank {self.rank} during {what} "
                f"(a peer died, or nothing arrived within {timeout:g} s): {error}"
            ) from error

    def timed_broadcasts(self, nbytes: int, repeats: int) -> list[float]:
        """Bare broadcasts of `nbytes` from rank 0, one tensor, no packing; seconds each."""
        tensor = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        seconds = []
        for repeat in range(repeats):
            _synchronize(self.device)
            start = time.perf_counter()
            self.wait(self.broadcast(tensor), what=f"bare broadcast {repeat}")
            _synchronize(self.device)
            seconds.append(time.perf_counter() - start)
        return seconds

    def check_usable(self) -> None:
        if self.broken:
            raise WeightSyncError(
                f"weight-sync group {self.info.group_name!r} failed earlier; create a new one"
            )

    def fail(self) -> None:
        """Mark the group broken and abort its communicator (NCCL: stops in-flight kernels)."""
        if self.broken:
            return
        self.broken = True
        if self.info.backend == "nccl":
            with contextlib.suppress(Exception):
                self.pg.abort()

    def close(self) -> None:
        self.broken = True
        with contextlib.suppress(Exception):
            self.pg.shutdown()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _default_device(backend: Backend) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------------------------
# Sender (trainer rank 0) and receiver (each rollout worker)
# --------------------------------------------------------------------------------------------


class WeightSyncSender:
    """Sync rank 0: hosts the store, packs named tensors into buckets and broadcasts them.

    Construction only opens the store (non-blocking) so that `info` can be handed to the
    receivers; `connect` then blocks until every receiver has joined.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: Backend = "gloo",
        host: str | None = None,
        port: int = 0,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 600.0,
        group_name: str = "rlhf-weight-sync",
        device: torch.device | str | None = None,
    ) -> None:
        if world_size < 2:
            raise ValueError("a weight-sync group needs the sender and at least one receiver")
        self.device = torch.device(device) if device is not None else _default_device(backend)
        host = host or default_host()
        # The server listens on every interface; port=0 lets the OS pick a free port, which the
        # store reports back.
        self._store = dist.TCPStore(
            host,
            port,
            world_size=None,
            is_master=True,
            timeout=timedelta(seconds=connect_timeout_s),
            wait_for_workers=False,
        )
        self.info = SyncGroupInfo(
            host=host,
            port=self._store.port,
            world_size=world_size,
            backend=backend,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            group_name=group_name,
        )
        self._group: _Group | None = None
        self._buffers: list[torch.Tensor] = []

    def connect(self) -> None:
        """Join as rank 0; returns once every receiver has joined (or raises WeightSyncError)."""
        if self._group is None:
            self._group = _Group(self._store, self.info, rank=0, device=self.device)

    def _buffers_for(self, bucket_bytes: int) -> list[torch.Tensor]:
        if not self._buffers or self._buffers[0].numel() != bucket_bytes:
            self._buffers = [
                torch.empty(bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)
            ]
        return self._buffers

    def send(self, plan: SyncPlan, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        """Broadcast `named_tensors` (in `plan` order) to every receiver; returns the stats.

        `named_tensors` may be a lazy iterator (ZeRO-3 gathering a layer at a time): each
        tensor is copied into a bucket before the iterator advances.
        """
        if self._group is None:
            raise WeightSyncError("call connect() before send()")
        group = self._group
        group.check_usable()
        start = time.perf_counter()
        header = torch.tensor(
            [_MAGIC, plan.version, len(plan.buckets), plan.digest()],
            dtype=torch.int64,
            device=self.device,
        )
        header_work = group.broadcast(header)
        buffers = self._buffers_for(plan.bucket_bytes)
        in_flight: list[Any] = [None, None]
        tensors = iter(named_tensors)
        current: torch.Tensor | None = None  # bytes of the tensor being packed
        try:
            for index, bucket in enumerate(plan.buckets):
                slot = index % 2
                if in_flight[slot] is not None:  # the broadcast that last used this buffer
                    group.wait(in_flight[slot], what=f"bucket {index - 2}")
                buffer = buffers[slot]
                for piece in bucket.pieces:
                    if piece.tensor_offset == 0:
                        current = _next_tensor_bytes(tensors, piece, group)
                    assert current is not None
                    buffer[piece.bucket_offset : piece.bucket_offset + piece.nbytes].copy_(
                        current[piece.tensor_offset : piece.tensor_offset + piece.nbytes]
                    )
                in_flight[slot] = group.broadcast(buffer[: bucket.nbytes])
            group.wait(header_work, what="header")
            for slot in (len(plan.buckets) % 2, (len(plan.buckets) + 1) % 2):
                if in_flight[slot] is not None:
                    group.wait(in_flight[slot], what="the last buckets")
            if next(tensors, None) is not None:
                group.fail()
                raise WeightSyncError("the sender yielded more tensors than the plan holds")
        except WeightSyncError:
            raise
        except Exception as error:
            group.fail()
            raise WeightSyncError(f"packing weights for version {plan.version} failed") from error
        return SyncStats(
            version=plan.version,
            seconds=time.perf_counter() - start,
            bytes=plan.total_bytes,
            buckets=len(plan.buckets),
            tensors=plan.num_tensors,
        )

    def broadcast_bytes(self, nbytes: int, repeats: int = 5) -> list[float]:
        """Time bare broadcasts of `nbytes` over this group: the ceiling for `send`.

        Every receiver must call its `broadcast_bytes` with the same arguments at the same time.
        """
        if self._group is None:
            raise WeightSyncError("call connect() before broadcast_bytes()")
        return self._group.timed_broadcasts(nbytes, repeats)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._buffers = []


def _next_tensor_bytes(
    tensors: Iterator[tuple[str, torch.Tensor]], piece: TensorPiece, group: _Group
) -> torch.Tensor:
    """The next tensor from the sender's iterator as flat bytes, checked against the plan."""
    item = next(tensors, None)
    if item is None:
        group.fail()
        raise WeightSyncError(f"the sender ran out of tensors before {piece.name!r}")
    name, tensor = item
    if (name, tuple(tensor.shape), dtype_name(tensor.dtype)) != (
        piece.name,
        piece.shape,
        piece.dtype,
    ):
        group.fail()
        raise WeightSyncError(
            f"the sender yielded {name!r} {tuple(tensor.shape)} {dtype_name(tensor.dtype)} "
            f"where the plan expects {piece.name!r} {piece.shape} {piece.dtype}"
        )
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


class WeightSyncReceiver:
    """A receiving rank (one per rollout worker): joins the group, unpacks buckets into tensors.

    Construction blocks until the whole group has joined (the sender's `connect` included).
    """

    def __init__(
        self,
        info: SyncGroupInfo | dict[str, Any],
        rank: int,
        device: torch.device | str | None = None,
    ) -> None:
        self.info = SyncGroupInfo.from_dict(info)
        if not 1 <= rank < self.info.world_size:
            raise ValueError(f"receiver rank {rank} outside 1..{self.info.world_size - 1}")
        self.device = (
            torch.device(device) if device is not None else _default_device(self.info.backend)
        )
        try:
            store = dist.TCPStore(
                self.info.host,
                self.info.port,
                is_master=False,
                timeout=timedelta(seconds=self.info.connect_timeout_s),
            )
        except Exception as error:
            raise WeightSyncError(
                f"rank {rank} could not reach the weight-sync store at "
                f"{self.info.host}:{self.info.port}: {error}"
            ) from error
        self._group = _Group(store, self.info, rank=rank, device=self.device)
        self._buffers: list[torch.Tensor] = []

    @property
    def rank(self) -> int:
        return self._group.rank

    def receive(
        self,
        plan: SyncPlan | dict[str, Any],
        load: Callable[[NamedTensors], None],
    ) -> SyncStats:
        """Receive one sync and hand each bucket's complete tensors to `load`.

        `load` gets ``[(name, tensor), ...]`` once per bucket; the tensors may be views into a
        receive buffer and are only valid during the call, so `load` must copy them (engines'
        weight loaders do). The next bucket is already in flight while `load` runs.
        """
        plan = SyncPlan.from_dict(plan)
        group = self._group
        group.check_usable()
        start = time.perf_counter()
        header = torch.zeros(4, dtype=torch.int64, device=self.device)
        group.wait(group.broadcast(header), what="header")
        expected = [_MAGIC, plan.version, len(plan.buckets), plan.digest()]
        if header.tolist() != expected:
            group.fail()
            raise WeightSyncError(
                f"rank {self.rank} holds a different plan than the sender: header "
                f"{header.tolist()} != {expected} (magic, version, buckets, digest)"
            )
        if not self._buffers or self._buffers[0].numel() != plan.bucket_bytes:
            self._buffers = [
                torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=self.device)
                for _ in range(2)
            ]
        buckets = plan.buckets

        def post(index: int) -> Any:
            return group.broadcast(self._buffers[index % 2][: buckets[index].nbytes])

        in_flight = {index: post(index) for index in range(min(2, len(buckets)))}
        partial: dict[str, torch.Tensor] = {}  # tensors split across buckets, being assembled
        for index, bucket in enumerate(buckets):
            group.wait(in_flight.pop(index), what=f"bucket {index}")
            buffer = self._buffers[index % 2]
            ready: NamedTensors = []
            for piece in bucket.pieces:
                data = buffer[piece.bucket_offset : piece.bucket_offset + piece.nbytes]
                if piece.nbytes == piece.tensor_nbytes:  # whole tensor: a view, no copy
                    ready.append((piece.name, _as_tensor(data, piece)))
                    continue
                assembled = partial.setdefault(
                    piece.name,
                    torch.empty(piece.tensor_nbytes, dtype=torch.uint8, device=self.device),
                )
                assembled[piece.tensor_offset : piece.tensor_offset + piece.nbytes].copy_(data)
                if piece.is_last:
                    ready.append((piece.name, _as_tensor(partial.pop(piece.name), piece)))
            try:
                if ready:
                    load(ready)
            except Exception as error:
                group.fail()
                raise WeightSyncError(
                    f"rank {self.rank} failed to load bucket {index} of version {plan.version}"
                ) from error
            if index + 2 < len(buckets):  # the buffer is free again: receive two ahead
                in_flight[index + 2] = post(index + 2)
        return SyncStats(
            version=plan.version,
            seconds=time.perf_counter() - start,
            bytes=plan.total_bytes,
            buckets=len(buckets),
            tensors=plan.num_tensors,
        )

    def broadcast_bytes(self, nbytes: int, repeats: int = 5) -> list[float]:
        """The receiving side of `WeightSyncSender.broadcast_bytes`."""
        return self._group.timed_broadcasts(nbytes, repeats)

    def close(self) -> None:
        self._group.close()
        self._buffers = []


def _as_tensor(data: torch.Tensor, piece: TensorPiece) -> torch.Tensor:
    return data.view(dtype_from_name(piece.dtype)).view(piece.shape)
