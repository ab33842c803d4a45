"""CPU benchmark: weight-sync throughput against a bare gloo broadcast of the same bytes.

The sender runs in this process, the receivers in spawned processes that copy every received
tensor into their own preallocated parameters (as an engine's loader does). For each bucket size
it times full syncs, and on the same group one bare broadcast of all the bytes (no packing, no
unpacking): the ceiling. Prints JSON.

    .venv/bin/python benchmarks/weight_sync.py --total-mib 64 --bucket-mib 1 4 16
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch
import torch.multiprocessing as mp

from rlhf_trainer.rollout.sync_plan import SyncPlan, plan_weight_sync, tensor_metadata
from rlhf_trainer.rollout.weight_sync import WeightSyncReceiver, WeightSyncSender


def synthetic_weights(total_bytes: int, tensor_bytes: int) -> list[tuple[str, torch.Tensor]]:
    """fp32 tensors of `tensor_bytes` each (the last one smaller) adding up to `total_bytes`."""
    weights = []
    remaining, index = total_bytes, 0
    while remaining > 0:
        size = min(tensor_bytes, remaining)
        weights.append((f"layers.{index}.weight", torch.randn(size // 4)))
        remaining -= size
        index += 1
    return weights


def receiver_main(info: dict[str, Any], rank: int, shapes: list[Any], jobs: Any, done: Any) -> None:
    torch.set_num_threads(1)
    params = {name: torch.empty(shape) for name, shape, _ in shapes}
    receiver = WeightSyncReceiver(info, rank)

    def load(items: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            params[name].copy_(tensor)

    while (job := jobs.get())[0] != "stop":
        receiver.broadcast_bytes(64, 1)  # barrier: the sender starts timing after it
        if job[0] == "sync":
            receiver.receive(SyncPlan.from_dict(job[1]), load)
        else:
            receiver.broadcast_bytes(job[1], job[2])
        done.put(rank)
    receiver.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--total-mib", type=int, default=64)
    parser.add_argument("--tensor-kib", type=int, default=1024)
    parser.add_argument("--bucket-mib", type=float, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    weights = synthetic_weights(args.total_mib * 2**20, args.tensor_kib * 2**10)
    metadata = tensor_metadata(weights)
    total_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    context = mp.get_context("spawn")
    sender = WeightSyncSender(args.receivers + 1, host="127.0.0.1", timeout_s=300)
    jobs = [context.Queue() for _ in range(args.receivers)]
    done = context.Queue()
    receivers = [
        context.Process(
            target=receiver_main,
            args=(sender.info.to_dict(), rank, metadata, jobs[rank - 1], done),
        )
        for rank in range(1, args.receivers + 1)
    ]
    for process in receivers:
        process.start()
    sender.connect()

    def everyone(job: tuple[Any, ...]) -> None:
        for queue in jobs:
            queue.put(job)

    def wait_receivers() -> None:
        for _ in receivers:
            done.get(timeout=600)

    bare = []
    for repeat in range(args.repeats + 1):
        everyone(("bare", total_bytes, 1))
        sender.broadcast_bytes(64, 1)  # barrier: every receiver is waiting for the bytes
        elapsed = sender.broadcast_bytes(total_bytes, 1)[0]
        wait_receivers()
        if repeat:  # the first one allocates and warms up
            bare.append(elapsed)
    bare_median = statistics.median(bare)

    results = []
    for bucket_mib in args.bucket_mib:
        bucket_bytes = int(bucket_mib * 2**20) // 64 * 64
        seconds = []
        for repeat in range(args.repeats + 1):
            plan = plan_weight_sync(metadata, version=repeat, bucket_bytes=bucket_bytes)
            everyone(("sync", plan.to_dict()))
            sender.broadcast_bytes(64, 1)  # barrier, as above
            stats = sender.send(plan, iter(weights))
            wait_receivers()
            if repeat:  # the first sync allocates buffers
                seconds.append(stats.seconds)
        median = statistics.median(seconds)
        results.append(
            {
                "bucket_bytes": bucket_bytes,
                "buckets": len(plan.buckets),
                "sync_seconds_median": round(median, 4),
                "sync_GBps": round(total_bytes / median / 1e9, 3),
                "fraction_of_bare": round(bare_median / median, 3),
            }
        )

    everyone(("stop",))
    for process in receivers:
        process.join(60)
    sender.close()
    print(
        json.dumps(
            {
                "backend": "gloo",
                "receivers": args.receivers,
                "total_bytes": total_bytes,
                "tensors": len(weights),
                "repeats": args.repeats,
                "bare_broadcast_seconds_median": round(bare_median, 4),
                "bare_GBps": round(total_bytes / bare_median / 1e9, 3),
                "syncs": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
