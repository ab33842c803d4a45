"""Weight sync over gloo: bucket layout, exact transfer, versions, and bounded failures.

Most tests run the sender and receivers as threads of this process (each rank has its own gloo
group, as separate processes would); two tests use real processes, one of which is killed.
"""

from __future__ import annotations

import io
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf_trainer.rollout.engines import HFEngine
from rlhf_trainer.rollout.model_source import ModelSource
from rlhf_trainer.rollout.sync_plan import ALIGNMENT, SyncPlan, plan_weight_sync, tensor_metadata
from rlhf_trainer.rollout.weight_sync import (
    SyncStats,
    WeightSyncError,
    WeightSyncReceiver,
    WeightSyncSender,
)

TINY_QWEN2 = {
    "model_type": "qwen2",
    "vocab_size": 32,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
BUCKET_BYTES = 16 * 1024  # the tiny model is ~300 KiB: many buckets, some tensors split


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("small", torch.randn(5, generator=generator)),
        ("half", torch.randn(3, 7, generator=generator).to(torch.bfloat16)),
        ("scalar", torch.tensor(-3, dtype=torch.int64)),
        ("big", torch.randn(40, 30, generator=generator)),  # 4800 B: split over 1 KiB buckets
        ("empty", torch.zeros(0, 4)),
        ("flags", torch.tensor([True, False, True])),
    ]


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


def test_plan_splits_large_tensors_and_covers_every_byte_once() -> None:
    tensors = mixed_tensors()
    plan = plan_weight_sync(tensor_metadata(tensors), version=3, bucket_bytes=1024)
    assert plan.version == 3
    assert plan.num_tensors == len(tensors)
    assert len(plan.buckets) > 1
    covered: dict[str, int] = {}
    for bucket in plan.buckets:
        assert 0 < bucket.nbytes <= 1024 or all(p.nbytes == 0 for p in bucket.pieces)
        end = 0
        for piece in bucket.pieces:
            assert piece.bucket_offset % ALIGNMENT == 0
            assert piece.bucket_offset >= end  # pieces do not overlap
            end = piece.bucket_offset + piece.nbytes
            assert piece.tensor_offset == covered.get(piece.name, 0)  # contiguous, in order
            covered[piece.name] = piece.tensor_offset + piece.nbytes
        assert bucket.nbytes == end
    assert covered == {name: t.numel() * t.element_size() for name, t in tensors}
    assert len([p for b in plan.buckets for p in b.pieces if p.name == "big"]) >= 5


def test_plan_round_trips_through_plain_data_and_fingerprints_the_layout() -> None:
    metadata = tensor_metadata(mixed_tensors())
    plan = plan_weight_sync(metadata, version=1, bucket_bytes=1024)
    assert SyncPlan.from_dict(plan.to_dict()) == plan
    assert SyncPlan.from_dict(plan.to_dict()).digest() == plan.digest()
    assert plan_weight_sync(metadata, version=2, bucket_bytes=1024).digest() != plan.digest()
    assert plan_weight_sync(metadata, version=1, bucket_bytes=2048).digest() != plan.digest()


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="multiple"):
        plan_weight_sync([("a", (2,), torch.float32)], version=0, bucket_bytes=100)
    with pytest.raises(ValueError, match="twice"):
        plan_weight_sync([("a", (2,), torch.float32)] * 2, version=0, bucket_bytes=1024)


# --------------------------------------------------------------------------------------------
# Syncs between threads
# --------------------------------------------------------------------------------------------


def run_ranks(*targets: Callable[[], Any], timeout_s: float = 60.0) -> list[Any]:
    """Run each rank's function in its own thread; returns results (or the exceptions)."""
    results: list[Any] = [None] * len(targets)

    def run(index: int) -> None:
        try:
            results[index] = targets[index]()
        except BaseException as error:
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(targets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
        assert not thread.is_alive(), "a rank hung"
    return results


def connected_group(
    receivers: int, timeout_s: float = 10.0
) -> tuple[WeightSyncSender, list[WeightSyncReceiver]]:
    sender = WeightSyncSender(
        receivers + 1, host="127.0.0.1", timeout_s=timeout_s, connect_timeout_s=30
    )
    joined = run_ranks(
        sender.connect,
        *[
            lambda rank=rank: WeightSyncReceiver(sender.info, rank)
            for rank in range(1, 1 + receivers)
        ],
    )
    for result in joined:
        assert not isinstance(result, BaseException), result
    return sender, joined[1:]


def test_sync_transfers_mixed_dtypes_bit_exactly_and_reports_stats() -> None:
    tensors = mixed_tensors()
    plan = plan_weight_sync(tensor_metadata(tensors), version=5, bucket_bytes=1024)
    sender, receivers = connected_group(2)
    received: list[dict[str, torch.Tensor]] = [{}, {}]

    def receive(index: int) -> SyncStats:
        def load(items: list[tuple[str, torch.Tensor]]) -> None:
            received[index].update((name, tensor.clone()) for name, tensor in items)

        return receivers[index].receive(plan.to_dict(), load)

    results = run_ranks(
        lambda: sender.send(plan, iter(tensors)), lambda: receive(0), lambda: receive(1)
    )
    for stats in results:
        assert isinstance(stats, SyncStats), stats
        assert (stats.version, stats.buckets, stats.tensors) == (5, len(plan.buckets), 6)
        assert stats.bytes == plan.total_bytes
    for got in received:
        assert list(got) == [name for name, _ in tensors]  # loaded in plan order
        for name, tensor in tensors:
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert not dist.is_initialized()  # the default process group was never touched
    sender.close()


def perturbed(model: torch.nn.Module, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Change every parameter (as a training step would) and yield them like a trainer."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(torch.randn(param.shape, generator=generator))
            yield name, param


def test_engines_hold_the_senders_exact_parameters_after_each_sync() -> None:
    trainer = HFEngine(ModelSource(config=TINY_QWEN2, seed=0)).model
    engines = [HFEngine(ModelSource(config=TINY_QWEN2, seed=s)) for s in (1, 2)]
    sender = WeightSyncSender(3, host="127.0.0.1", timeout_s=10, connect_timeout_s=30)
    joined = run_ranks(
        sender.connect,
        lambda: engines[0].init_weight_sync(sender.info, 1),
        lambda: engines[1].init_weight_sync(sender.info.to_dict(), 2),
    )
    assert all(result is None for result in joined), joined
    for version in (1, 2):
        plan = plan_weight_sync(tensor_metadata(trainer.named_parameters()), version, BUCKET_BYTES)
        assert len(plan.buckets) > 5
        assert any(not p.is_last or p.tensor_offset for b in plan.buckets for p in b.pieces)
        results = run_ranks(
            lambda plan=plan, version=version: sender.send(plan, perturbed(trainer, version)),
            *[lambda engine=engine, plan=plan: engine.receive_weights(plan) for engine in engines],
        )
        assert all(isinstance(result, SyncStats) for result in results), results
        expected = dict(trainer.named_parameters())
        for engine in engines:
            assert engine.policy_version() == version
            held = engine.named_parameters()
            assert all(torch.equal(held[name], tensor) for name, tensor in expected.items())
    sender.close()
    for engine in engines:
        engine.close_weight_sync()


def test_a_receiver_with_another_plan_fails_loudly() -> None:
    tensors = mixed_tensors()
    plan = plan_weight_sync(tensor_metadata(tensors), version=4, bucket_bytes=1024)
    stale = plan_weight_sync(tensor_metadata(tensors), version=3, bucket_bytes=1024)
    sender, (receiver,) = connected_group(1, timeout_s=2)
    started = time.monotonic()
    send_result, receive_result = run_ranks(
        lambda: sender.send(plan, iter(tensors)),
        lambda: receiver.receive(stale, lambda items: None),
    )
    assert isinstance(receive_result, WeightSyncError)
    assert "different plan" in str(receive_result)
    assert time.monotonic() - started < 2 + 5
    # The group is broken from now on: no silent reuse.
    with pytest.raises(WeightSyncError, match="failed earlier"):
        receiver.receive(stale, lambda items: None)
    sender.close()
    del send_result  # the sender may or may not notice; the receiver never loads garbage


def test_sender_rejects_tensors_that_do_not_match_the_plan() -> None:
    tensors = mixed_tensors()
    plan = plan_weight_sync(tensor_metadata(tensors), version=1, bucket_bytes=1024)
    sender, (receiver,) = connected_group(1, timeout_s=2)
    wrong = [(name, tensor) for name, tensor in tensors if name != "half"]
    send_result, receive_result = run_ranks(
        lambda: sender.send(plan, iter(wrong)),
        lambda: receiver.receive(plan, lambda items: None),
    )
    assert isinstance(send_result, WeightSyncError)
    assert "'scalar'" in str(send_result) and "'half'" in str(send_result)
    assert isinstance(receive_result, WeightSyncError)  # times out instead of hanging
    sender.close()


def test_a_receiver_waiting_for_a_sync_that_never_comes_times_out() -> None:
    plan = plan_weight_sync(tensor_metadata(mixed_tensors()), version=1, bucket_bytes=1024)
    sender, (receiver,) = connected_group(1, timeout_s=1)
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match="within 1 s"):
        receiver.receive(plan, lambda items: None)
    assert time.monotonic() - started < 1 + 5
    sender.close()


# --------------------------------------------------------------------------------------------
# Syncs between processes
# --------------------------------------------------------------------------------------------


def _engine_process(info: dict[str, Any], rank: int, plans: Any, results: Any) -> None:
    """A rollout engine in its own process: join, then receive each plan from the queue."""
    engine = HFEngine(ModelSource(config=TINY_QWEN2, seed=100 + rank))
    engine.init_weight_sync(info, rank)
    while (plan := plans.get()) is not None:
        engine.receive_weights(plan)
        buffer = io.BytesIO()
        torch.save(engine.named_parameters(), buffer)
        results.put((rank, engine.policy_version(), buffer.getvalue()))
    engine.close_weight_sync()


def _receiver_process(info: dict[str, Any], rank: int, plans: Any, results: Any) -> None:
    receiver = WeightSyncReceiver(info, rank)
    plan = plans.get()
    try:
        receiver.receive(plan, lambda items: None)
        results.put((rank, "ok"))
    except WeightSyncError:
        results.put((rank, "WeightSyncError"))


@pytest.mark.slow  # spawns two processes that import transformers (~15 s on 2 busy cores)
def test_engine_processes_hold_the_senders_exact_parameters() -> None:
    context = mp.get_context("spawn")
    trainer = HFEngine(ModelSource(config=TINY_QWEN2, seed=0)).model
    sender = WeightSyncSender(3, host="127.0.0.1", timeout_s=30, connect_timeout_s=120)
    plans = [context.Queue() for _ in range(2)]
    results = context.Queue()
    processes = [
        context.Process(
            target=_engine_process, args=(sender.info.to_dict(), rank, plans[rank - 1], results)
        )
        for rank in (1, 2)
    ]
    for process in processes:
        process.start()
    try:
        sender.connect()
        for version in (1, 2):
            plan = plan_weight_sync(
                tensor_metadata(trainer.named_parameters()), version, BUCKET_BYTES
            )
            for queue in plans:
                queue.put(plan.to_dict())  # the driver hands the plan over out of band
            stats = sender.send(plan, perturbed(trainer, version))
            assert stats.version == version and stats.buckets == len(plan.buckets)
            expected = dict(trainer.named_parameters())
            for _ in processes:
                rank, engine_version, state = results.get(timeout=60)
                assert engine_version == version, rank
                held = torch.load(io.BytesIO(state))
                assert all(torch.equal(held[name], t) for name, t in expected.items()), rank
        for queue in plans:
            queue.put(None)
        for process in processes:
            process.join(60)
            assert process.exitcode == 0
    finally:
        sender.close()
        for process in processes:
            if process.is_alive():
                process.kill()


def test_a_sync_whose_peer_died_fails_within_its_timeout() -> None:
    context = mp.get_context("spawn")
    timeout_s = 3.0
    tensors = mixed_tensors()
    plan = plan_weight_sync(tensor_metadata(tensors), version=1, bucket_bytes=1024)
    sender = WeightSyncSender(3, host="127.0.0.1", timeout_s=timeout_s, connect_timeout_s=120)
    plans = [context.Queue() for _ in range(2)]
    results = context.Queue()
    processes = [
        context.Process(
            target=_receiver_process, args=(sender.info.to_dict(), rank, plans[rank - 1], results)
        )
        for rank in (1, 2)
    ]
    for process in processes:
        process.start()
    try:
        sender.connect()  # both receivers have joined
        processes[0].kill()
        processes[0].join()
        plans[1].put(plan.to_dict())
        started = time.monotonic()
        with pytest.raises(WeightSyncError):
            sender.send(plan, iter(tensors))
        assert time.monotonic() - started < timeout_s + 3
        # The surviving receiver gives up within its own timeout instead of hanging.
        assert results.get(timeout=timeout_s + 30) == (2, "WeightSyncError")
        processes[1].join(30)
        assert processes[1].exitcode == 0
        with pytest.raises(WeightSyncError, match="failed earlier"):
            sender.send(plan, iter(tensors))
    finally:
        sender.close()
        for process in processes:
            if process.is_alive():
                process.kill()


def test_bare_broadcast_measurement_runs_on_the_same_group() -> None:
    sender, (receiver,) = connected_group(1)
    sent, received = run_ranks(
        lambda: sender.broadcast_bytes(4096, repeats=3),
        lambda: receiver.broadcast_bytes(4096, repeats=3),
    )
    for seconds in (sent, received):
        assert isinstance(seconds, list) and len(seconds) == 3
        assert all(s > 0 for s in seconds)
    sender.close()


def _zero3_process(results: Any) -> None:
    """A one-rank DeepSpeed ZeRO-3 trainer (its own default group) syncing to an HF engine."""
    import deepspeed

    from rlhf_trainer.modeling.zero import skip_unused_deepspeed_builds
    from rlhf_trainer.rollout.sync_plan import iter_zero3_parameters, zero3_parameter_metadata

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    skip_unused_deepspeed_builds(on_gpu=False)
    deepspeed.init_distributed(dist_backend="gloo")
    config = {**TINY_QWEN2, "tie_word_embeddings": True}
    model = HFEngine(ModelSource(config=config, seed=0)).model
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}
    trainer, *_ = deepspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        },
    )
    ids = torch.randint(0, TINY_QWEN2["vocab_size"], (2, 16))
    trainer.backward(trainer(input_ids=ids, labels=ids).loss)
    trainer.step()
    partitioned = all(param.numel() == 0 for param in trainer.module.parameters())

    engine = HFEngine(ModelSource(config=config, seed=5))
    sender = WeightSyncSender(2, host="127.0.0.1", timeout_s=30)
    run_ranks(sender.connect, lambda: engine.init_weight_sync(sender.info, 1))
    plan = plan_weight_sync(zero3_parameter_metadata(trainer.module), 1, 4096)
    sent, _ = run_ranks(
        lambda: sender.send(plan, iter_zero3_parameters(trainer.module)),
        lambda: engine.receive_weights(plan),
    )
    with deepspeed.zero.GatheredParameters(list(trainer.module.parameters())):
        gathered = {name: p.detach().clone() for name, p in trainer.module.named_parameters()}
    held = engine.named_parameters()
    results.put(
        {
            "partitioned": partitioned,
            "trained": any(not torch.equal(initial[n], gathered[n]) for n in gathered),
            "equal": all(torch.equal(held[n], tensor) for n, tensor in gathered.items()),
            "sent_every_tensor_once": isinstance(sent, SyncStats)
            and sent.tensors == len(gathered),  # tied weights once
        }
    )


@pytest.mark.slow  # imports DeepSpeed in a fresh process
def test_zero3_parameters_gathered_layer_by_layer_reach_the_engine_exactly() -> None:
    pytest.importorskip("deepspeed")
    context = mp.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_zero3_process, args=(results,))
    process.start()
    try:
        outcome = results.get(timeout=600)
        process.join(60)
    finally:
        if process.is_alive():
            process.kill()
    assert outcome == {
        "partitioned": True,  # the sender really had to gather
        "trained": True,  # the optimizer step changed the weights
        "equal": True,
        "sent_every_tensor_once": True,
    }
