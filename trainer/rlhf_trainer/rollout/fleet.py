"""The driver's view of the rollout engines: an elastic pool that samples and takes weights.

Membership, lost engines and the chunking that keeps sampling independent of how many engines
live are `rlhf_trainer.elastic`'s (an `ElasticPool` of engines). What the fleet adds: when an
engine is lost it rebuilds the weight-sync group over the survivors (and re-syncs them when
the lost engine broke a sync); engines that join get a new group and the current weights
before they generate.

`WeightSyncLink` wires trainer rank 0 to a set of engines (see `rlhf_trainer.rollout.weight_sync`)
and pushes a policy version to them; the fleet builds a new one whenever the set changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlhf_trainer.elastic import (
    Chunk,
    ElasticPool,
    Member,
    RoleWords,
    first_line,
    is_actor_lost,
    outcomes,
    plan_chunks,
    raise_first_error,
)
from rlhf_trainer.rollout.base import (
    CALL_TIMEOUT_S,
    GENERATE_TIMEOUT_S,
    Completion,
    SamplingParams,
    SyncResult,
    WeightSource,
)
from rlhf_trainer.rollout.weight_sync import SyncStats

SYNC_TIMEOUT_S = 60.0
"""Bound on each broadcast of a sync: how long a rank waits for a dead or stalled peer."""
JOIN_TIMEOUT_S = 120.0
"""Bound on joining a sync group (every member is already up when a group is built)."""
PROBE_TIMEOUT_S = 5.0
"""How long the liveness probe before a sync waits for idle engines to answer."""


class EnginesLostError(Exception):
    """Engines (by position in the call's engine list) whose actors died during a call."""

    def __init__(self, positions: list[int], cause: BaseException) -> None:
        super().__init__(f"rollout engines at {positions} lost: {first_line(cause)}")
        self.positions = positions
        self.cause = cause


class RolloutCapacityError(RuntimeError):
    """Fewer live rollout engines than the role's minimum: the step cannot go on (retryable:
    the operator restarts from the last checkpoint once the pool has recovered)."""


ENGINES = RoleWords("rollout engine", "rollout engines", "engines", "rollout", RolloutCapacityError)


# --------------------------------------------------------------------------------------------
# Weight sync to a set of engines


class WeightSyncLink:
    """One sync group between policy rank 0 and a fixed set of rollout engines.

    Construction builds the group (rank 0 closes its previous one, each engine its own); an
    engine that dies meanwhile raises `EnginesLostError`, as in `sync`.
    """

    def __init__(
        self,
        policy: WeightSource,
        engines: Sequence[Any],
        *,
        timeout_s: float = SYNC_TIMEOUT_S,
        connect_timeout_s: float = JOIN_TIMEOUT_S,
        call_timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        import ray

        self.policy = policy
        self.engines = list(engines)
        self.call_timeout_s = call_timeout_s
        ranks = outcomes([e.weight_sync_ranks.remote() for e in self.engines], call_timeout_s)
        self._raise_lost(ranks)
        rank0: Any = policy.actors[0]
        info = ray.get(
            rank0.open_weight_sync.remote(1 + sum(ranks), timeout_s, connect_timeout_s),
            timeout=call_timeout_s,
        )
        joins, first = [], 1
        for engine, count in zip(self.engines, ranks, strict=True):
            joins.append(engine.init_weight_sync.remote(info, first))
            first += count
        results = outcomes([rank0.connect_weight_sync.remote(), *joins], call_timeout_s)
        self._raise_lost(results[1:])
        raise_first_error(results)

    def _raise_lost(self, engine_results: Sequence[Any]) -> None:
        lost = [i for i, result in enumerate(engine_results) if is_actor_lost(result)]
        if lost:
            raise EnginesLostError(lost, engine_results[lost[0]])
        raise_first_error(engine_results)

    def sync(self, version: int) -> SyncResult:
        """Push the policy's current weights as `version`; `EnginesLostError` if engines died,
        WeightSyncError (or another error) if the sync failed otherwise."""
        import ray

        started = time.perf_counter()
        rank0: Any = self.policy.actors[0]
        plan = ray.get(rank0.weight_sync_plan.remote(version), timeout=self.call_timeout_s)
        senders = self.policy.submit("send_weights", plan)
        receivers = [engine.receive_weights.remote(plan) for engine in self.engines]
        # Launch everything before waiting: senders and receivers meet in the broadcasts.
        results = outcomes([*senders, *receivers], self.call_timeout_s)
        self._raise_lost(results[len(senders) :])
        raise_first_error(results)
        stats: SyncStats = results[0]
        return SyncResult(version, time.perf_counter() - started, stats.bytes)


# --------------------------------------------------------------------------------------------
# The fleet


# --------------------------------------------------------------------------------------------
# The fleet


@dataclass
class Engine(Member):
    """One rollout engine actor and the policy version it holds."""

    version: int | None = None
    """Policy version it holds (None: unknown, e.g. after a failed sync)."""


class RolloutFleet(ElasticPool[Engine]):
    """The rollout engines of a run, used as one engine that survives losing some of them.

    `start_engine(id)` starts one engine actor
    (`rlhf_trainer.rollout.engines.EngineLauncher.start`); an engine is up once it tells its
    weight-sync ranks. The rest as `ElasticPool`.
    """

    def __init__(
        self,
        policy: WeightSource,
        start_engine: Callable[[int], Any],
        *,
        desired: int,
        minimum: int,
        log: Callable[[str], None] = print,
        on_change: Callable[[int, int], None] | None = None,
        sync_timeout_s: float = SYNC_TIMEOUT_S,
        join_timeout_s: float = JOIN_TIMEOUT_S,
        call_timeout_s: float = CALL_TIMEOUT_S,
        generate_timeout_s: float = GENERATE_TIMEOUT_S,
    ) -> None:
        super().__init__(
            ENGINES,
            start_engine,
            lambda engine_id, actor: Engine(engine_id, actor, actor.weight_sync_ranks.remote()),
            desired=desired,
            minimum=minimum,
            log=log,
            on_change=on_change,
            join_timeout_s=join_timeout_s,
        )
        self.policy = policy
        self.sync_timeout_s = sync_timeout_s
        self.call_timeout_s = call_timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.link: WeightSyncLink | None = None
        self.version: int | None = None
        """The policy version the engines should hold (the last one synced)."""

    def maintain(self) -> None:
        """At the start of a step: admit engines that came up (synced before they generate),
        and start replacements for missing ones unless some are starting already."""
        super().maintain()
        self._ensure_current()

    def _joined_hook(self) -> None:
        self.link = None
        self._ensure_current()  # before they generate (drops any that die meanwhile)

    def _lost_hook(self) -> None:
        self.link = None

    # -- weight sync --------------------------------------------------------------------------

    def _relink(self) -> None:
        """A new sync group over the live engines (dropping any that die meanwhile)."""
        self.link = None
        while self.live:
            members = list(self.live)
            try:
                self.link = WeightSyncLink(
                    self.policy,
                    [engine.actor for engine in members],
                    timeout_s=self.sync_timeout_s,
                    connect_timeout_s=self.join_timeout_s,
                    call_timeout_s=self.call_timeout_s,
                )
                return
            except EnginesLostError as lost:
                self.lose([members[i] for i in lost.positions], lost.cause, "a sync-group build")

    def _sync_live(self, version: int) -> SyncResult:
        """Sync `version` to every live engine, dropping (and re-syncing without) lost ones."""
        while True:
            if self.link is None:
                self._relink()
            if self.link is None:  # no live engine (minimum 0): nothing to sync
                return SyncResult(version, 0.0, 0)
            members = list(self.live)
            try:
                result = self.link.sync(version)
            except EnginesLostError as lost:
                for engine in members:
                    engine.version = None  # a broken sync may have left them half-loaded
                self.lose([members[i] for i in lost.positions], lost.cause, "a weight sync")
                continue
            for engine in members:
                engine.version = version
            return result

    def _ensure_current(self) -> None:
        """Give the live engines a sync group and the current weights if they lack them."""
        if self.live and self.link is None:
            self._relink()
        if self.version is not None and any(e.version != self.version for e in self.live):
            self._sync_live(self.version)

    def _probe(self) -> None:
        """Drop engines that died while idle, so a sync does not wait on them: a dead peer
        leaves the others blocked in the broadcast until `sync_timeout_s`."""
        members = list(self.live)
        if not members:
            return
        import ray

        refs = [engine.actor.ping.remote() for engine in members]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
        ready_set = set(ready)
        answered = [(engine, ref) for engine, ref in zip(members, refs, strict=True)]
        answered = [(engine, ref) for engine, ref in answered if ref in ready_set]
        results = outcomes([ref for _, ref in answered], 0)
        lost = [
            engine
            for (engine, _), result in zip(answered, results, strict=True)
            if is_actor_lost(result)
        ]
        if lost:
            cause = next(r for r in results if is_actor_lost(r))
            self.lose(lost, cause, "the check before a weight sync")

    def sync(self, version: int) -> SyncResult:
        """Push the policy's weights as `version` to every live engine (and remember it, so
        engines that join later get it too)."""
        self.version = version
        self._probe()
        return self._sync_live(version)

    # -- sampling -----------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        """`sampling.n` completions per prompt, in prompt order, from the live engines."""
        chunks = plan_chunks(len(prompts), self.desired)

        def call(engine: Engine, chunk: Chunk) -> Any:
            seeded = sampling.for_prompts(chunk.start, chunk.stop, chunk.seed(sampling.seed))
            return engine.actor.generate.remote(prompts[chunk.start : chunk.stop], seeded)

        results = self.fan_out(
            chunks,
            call,
            timeout_s=self.generate_timeout_s,
            during="generation",
            before_each_round=self._ensure_current,
        )
        return [completions for chunk in chunks for completions in results[chunk.index]]
