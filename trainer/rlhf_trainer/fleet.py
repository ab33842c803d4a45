"""The driver's view of the rollout engines: sampling across them, and syncing weights to them.

`RolloutFleet` splits a step's prompts into contiguous chunks, one per engine, and gives each
engine a seed derived from the step's seed and the engine's index, so a step samples the same
tokens whenever it is replayed with the same weights (resume equivalence).

`WeightSyncLink` wires trainer rank 0 to every engine worker once (see
`rlhf_trainer.weight_sync`) and then pushes a new policy version after every update.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from rlhf_trainer.actors import WorkerGroup
from rlhf_trainer.engines import derive_seed
from rlhf_trainer.rollout import Completion, SamplingParams
from rlhf_trainer.weight_sync import SyncStats


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(start, stop)`` ranges covering ``range(count)``, sizes within 1."""
    base, extra = divmod(count, parts)
    ranges, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


class RolloutFleet:
    """Rollout engine actors used as one engine."""

    def __init__(self, engines: Sequence[Any], timeout_s: float = 1800.0) -> None:
        if not engines:
            raise ValueError("no rollout engines")
        self.engines = list(engines)
        self.timeout_s = timeout_s

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        """`sampling.n` completions per prompt, in prompt order."""
        import ray

        refs = []
        for index, (start, stop) in enumerate(split_evenly(len(prompts), len(self.engines))):
            if start == stop:
                continue
            seed = None if sampling.seed is None else derive_seed(sampling.seed, index)
            refs.append(
                self.engines[index].generate.remote(
                    prompts[start:stop], replace(sampling, seed=seed)
                )
            )
        results = ray.get(refs, timeout=self.timeout_s)
        return [completions for chunk in results for completions in chunk]


@dataclass
class SyncResult:
    version: int
    seconds: float
    bytes: int


class WeightSyncLink:
    """The sync group between policy rank 0 and every rollout worker, built once."""

    def __init__(self, policy: WorkerGroup, engines: Sequence[Any], timeout_s: float = 900.0):
        import ray

        self.policy = policy
        self.engines = list(engines)
        self.timeout_s = timeout_s
        ranks = ray.get([engine.weight_sync_ranks.remote() for engine in self.engines])
        rank0 = policy.actors[0]
        info = ray.get(rank0.open_weight_sync.remote(1 + sum(ranks)), timeout=timeout_s)
        joins, first = [], 1
        for engine, count in zip(self.engines, ranks, strict=True):
            joins.append(engine.init_weight_sync.remote(info, first))
            first += count
        ray.get([rank0.connect_weight_sync.remote(), *joins], timeout=timeout_s)

    def sync(self, version: int) -> SyncResult:
        """Push the policy's current weights as `version`; raises WeightSyncError on failure."""
        import ray

        started = time.perf_counter()
        plan = ray.get(self.policy.actors[0].weight_sync_plan.remote(version))
        senders = self.policy.submit("send_weights", plan)
        receivers = [engine.receive_weights.remote(plan) for engine in self.engines]
        # Launch everything before waiting: senders and receivers meet in the broadcasts.
        stats: SyncStats = ray.get(senders, timeout=self.timeout_s)[0]
        ray.get(receivers, timeout=self.timeout_s)
        return SyncResult(version, time.perf_counter() - started, stats.bytes)
