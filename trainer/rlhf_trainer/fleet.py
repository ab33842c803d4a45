"""The driver's view of the rollout engines: an elastic fleet that samples and takes weights.

Sampling does not depend on how many engines are alive. A step's prompts are split into
`desired` contiguous chunks (desired = the role's replicas x engines per replica), chunk ``i`` is
always sampled with ``derive_seed(step_seed, i)``, one engine call per chunk, and the chunks go
round-robin to the live engines (`plan_chunks`, `assign_chunks`). An engine is deterministic
given seed, weights and prompts, so a step samples the same tokens whichever engines are alive,
and a resumed run repeats an uninterrupted one even across lost engines.

Rollout is an elastic role (design decision 5). When a call to an engine raises
``RayActorError`` (its actor died, typically because its Ray node went away with its pod), the
fleet kills that actor, logs the loss, rebuilds the weight-sync group over the survivors (and
re-syncs them when the lost engine broke a sync) and re-runs the failed chunks on them. Below the
role's minimum (``minReplicas`` x engines per replica; unset means every replica, i.e. not
elastic) it raises `RolloutCapacityError`, which the driver reports as a retryable failure. At the
start of each step `maintain` starts replacements for missing engines without waiting (they
queue until a node with the rollout resource has room) and admits those that came up: they join
a new sync group and get the current weights before they generate.

`WeightSyncLink` wires trainer rank 0 to a set of engines (see `rlhf_trainer.weight_sync`) and
pushes a policy version to them; the fleet builds a new one whenever the set changes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from rlhf_trainer.rollout import Completion, SamplingParams
from rlhf_trainer.seeds import derive_seed
from rlhf_trainer.weight_sync import SyncStats

if TYPE_CHECKING:
    from rlhf_trainer.actors import WorkerGroup

SYNC_TIMEOUT_S = 60.0
"""Bound on each broadcast of a sync: how long a rank waits for a dead or stalled peer."""
JOIN_TIMEOUT_S = 120.0
"""Bound on joining a sync group (every member is already up when a group is built)."""
CALL_TIMEOUT_S = 900.0
"""Bound on a whole sync or group build as seen by the driver."""
GENERATE_TIMEOUT_S = 1800.0
PROBE_TIMEOUT_S = 5.0
"""How long the liveness probe before a sync waits for idle engines to answer."""


# --------------------------------------------------------------------------------------------
# Chunks and seeds (pure)


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(start, stop)`` ranges covering ``range(count)``, sizes within 1."""
    base, extra = divmod(count, parts)
    ranges, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


@dataclass(frozen=True)
class Chunk:
    """Prompts ``[start, stop)`` of a step, sampled with the seed of chunk `index`."""

    index: int
    start: int
    stop: int

    def seed(self, step_seed: int | None) -> int | None:
        return None if step_seed is None else derive_seed(step_seed, self.index)


def plan_chunks(count: int, desired: int) -> list[Chunk]:
    """The non-empty chunks of `count` prompts split `desired` ways (whatever engines live)."""
    if desired < 1:
        raise ValueError("desired must be at least 1")
    return [
        Chunk(index, start, stop)
        for index, (start, stop) in enumerate(split_evenly(count, desired))
        if start < stop
    ]


def assign_chunks(chunks: Sequence[Chunk], engines: int) -> list[int]:
    """Round-robin: the position (among `engines` live engines) that samples each chunk."""
    if engines < 1:
        raise ValueError("no live engines")
    return [position % engines for position in range(len(chunks))]


# --------------------------------------------------------------------------------------------
# Outcomes of Ray calls


def is_actor_lost(outcome: object) -> bool:
    """True for the error Ray raises when an actor died or cannot be reached."""
    from ray.exceptions import RayActorError

    return isinstance(outcome, RayActorError)


def outcomes(refs: Sequence[Any], timeout_s: float) -> list[Any]:
    """Every ref's value or the exception it raised, in order; raises GetTimeoutError if some
    do not finish within `timeout_s` (a lost actor's ref finishes with its error)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    refs = list(refs)
    if not refs:
        return []
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        raise GetTimeoutError(f"{len(pending)} of {len(refs)} calls unfinished after {timeout_s} s")
    results: list[Any] = []
    for ref in refs:
        try:
            results.append(ray.get(ref))
        except RayError as error:
            results.append(error)
    return results


def first_line(error: BaseException, limit: int = 160) -> str:
    """A one-line summary of an error for the log."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class EnginesLostError(Exception):
    """Engines (by position in the call's engine list) whose actors died during a call."""

    def __init__(self, positions: list[int], cause: BaseException) -> None:
        super().__init__(f"rollout engines at {positions} lost: {first_line(cause)}")
        self.positions = positions
        self.cause = cause


class RolloutCapacityError(RuntimeError):
    """Fewer live rollout engines than the role's minimum: the step cannot go on (retryable:
    the operator restarts from the last checkpoint once the pool has recovered)."""


def _raise_first_error(results: Sequence[Any]) -> None:
    for result in results:
        if isinstance(result, BaseException):
            raise result


# --------------------------------------------------------------------------------------------
# Weight sync to a set of engines


@dataclass
class SyncResult:
    version: int
    seconds: float
    bytes: int


class WeightSyncLink:
    """One sync group between policy rank 0 and a fixed set of rollout engines.

    Construction builds the group (rank 0 closes its previous one, each engine its own); an
    engine that dies meanwhile raises `EnginesLostError`, as in `sync`.
    """

    def __init__(
        self,
        policy: WorkerGroup,
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
        _raise_first_error(results)

    def _raise_lost(self, engine_results: Sequence[Any]) -> None:
        lost = [i for i, result in enumerate(engine_results) if is_actor_lost(result)]
        if lost:
            raise EnginesLostError(lost, engine_results[lost[0]])
        _raise_first_error(engine_results)

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
        _raise_first_error(results)
        stats: SyncStats = results[0]
        return SyncResult(version, time.perf_counter() - started, stats.bytes)


# --------------------------------------------------------------------------------------------
# The fleet


@dataclass
class Engine:
    """One rollout engine actor and what the fleet knows about it."""

    id: int
    actor: Any
    version: int | None = None
    """Policy version it holds (None: unknown, e.g. after a failed sync)."""
    ready: Any = field(default=None, repr=False)
    """While starting: the ref that resolves once the actor is up."""


class RolloutFleet:
    """The rollout engines of a run, used as one engine that survives losing some of them.

    `start_engine(id)` starts one engine actor (`rlhf_trainer.engines.EngineLauncher.start`);
    `on_change(live, desired)` hears about every change in the number of live engines; `log`
    gets one line per loss, start and (re)join.
    """

    def __init__(
        self,
        policy: WorkerGroup,
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
        if desired < 1 or not 0 <= minimum <= desired:
            raise ValueError(f"need 1 <= desired and 0 <= minimum <= desired: {minimum}/{desired}")
        self.policy = policy
        self.start_engine = start_engine
        self.desired = desired
        self.minimum = minimum
        self.log = log
        self.on_change = on_change
        self.sync_timeout_s = sync_timeout_s
        self.join_timeout_s = join_timeout_s
        self.call_timeout_s = call_timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.live: list[Engine] = []
        self.starting: list[Engine] = []
        self.link: WeightSyncLink | None = None
        self.version: int | None = None
        """The policy version the engines should hold (the last one synced)."""
        self.next_id = 0

    # -- membership ---------------------------------------------------------------------------

    def add(self, engine_id: int, actor: Any) -> None:
        """Count an engine actor that was started (or adopted) elsewhere as starting."""
        self.starting.append(Engine(engine_id, actor, ready=actor.weight_sync_ranks.remote()))
        self.next_id = max(self.next_id, engine_id + 1)

    def start(self, count: int) -> None:
        """Start `count` new engines (asynchronously; `wait_ready` or `maintain` admits them)."""
        for _ in range(count):
            engine_id = self.next_id
            self.add(engine_id, self.start_engine(engine_id))

    def wait_ready(self, timeout_s: float, grace_s: float = 30.0) -> None:
        """At startup: admit the starting engines as they come up. Waits for all of them, but
        once the minimum (and at least one) is up, no longer than `grace_s` more, and never
        beyond `timeout_s`; the rest join later through `maintain`."""
        import ray

        needed = max(self.minimum, 1)
        deadline = time.monotonic() + timeout_s
        enough_at: float | None = None
        joined: list[int] = []
        while self.starting:
            refs = [engine.ready for engine in self.starting]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            joined += self._take_ready(ready)
            now = time.monotonic()
            if enough_at is None and len(self.live) >= needed:
                enough_at = now
            limit = deadline if enough_at is None else min(deadline, enough_at + grace_s)
            if not self.starting or now >= limit:
                break
            ray.wait([e.ready for e in self.starting], num_returns=1, timeout=limit - now)
        self._joined(joined, "up")
        if len(self.live) < needed:
            raise RolloutCapacityError(
                f"only {len(self.live)} of {self.desired} rollout engines came up within "
                f"{timeout_s:.0f} s (at least {needed} needed)"
            )
        if self.starting:
            ids = ", ".join(str(engine.id) for engine in self.starting)
            self.log(f"rollout engine {ids} still starting; continuing with {self._count()}")

    def maintain(self) -> None:
        """At the start of a step: admit engines that came up (synced before they generate),
        and start replacements for missing ones unless some are starting already."""
        import ray

        if self.starting:
            refs = [engine.ready for engine in self.starting]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            self._joined(self._take_ready(ready), "rejoined")
        missing = self.desired - len(self.live)
        if missing > 0 and not self.starting:
            first = self.next_id
            self.start(missing)
            ids = ", ".join(str(engine_id) for engine_id in range(first, self.next_id))
            self.log(f"starting rollout engine {ids}; {self._count()} engines live")
        self._ensure_current()

    def _take_ready(self, ready_refs: Sequence[Any]) -> list[int]:
        """Move the starting engines whose ready ref resolved to the live set (dropping those
        that died starting); returns the ids that became live."""
        ready_set = set(ready_refs)
        done = [engine for engine in self.starting if engine.ready in ready_set]
        if not done:
            return []
        self.starting = [engine for engine in self.starting if engine.ready not in ready_set]
        joined = []
        for engine, result in zip(done, outcomes([e.ready for e in done], 0), strict=True):
            engine.ready = None
            if isinstance(result, BaseException):
                self._kill(engine)
                self.log(f"rollout engine {engine.id} failed to start ({first_line(result)})")
                if not is_actor_lost(result):
                    raise result
                continue
            self.live.append(engine)
            joined.append(engine.id)
        return joined

    def _joined(self, engine_ids: list[int], verb: str) -> None:
        """After engines joined: a new sync group, the current weights, a report and a log."""
        if not engine_ids:
            return
        self.live.sort(key=lambda engine: engine.id)
        self.link = None
        self._report()
        self._ensure_current()  # before they generate (drops any that die meanwhile)
        still = [i for i in engine_ids if any(engine.id == i for engine in self.live)]
        if still:
            ids = ", ".join(str(engine_id) for engine_id in still)
            self.log(f"rollout engine {ids} {verb}; {self._count()} engines")

    def _lose(self, engines: Sequence[Engine], cause: BaseException, during: str) -> None:
        """Drop engines whose actors died; raises RolloutCapacityError below the minimum."""
        for engine in engines:
            if engine not in self.live:
                continue
            self._kill(engine)
            self.live.remove(engine)
            self.log(
                f"rollout engine {engine.id} lost during {during} ({first_line(cause)}); "
                f"continuing with {self._count()} engines"
            )
        self.link = None
        self._report()
        if len(self.live) < self.minimum:
            raise RolloutCapacityError(
                f"{self._count()} rollout engines left, fewer than the minimum {self.minimum} "
                f"(roles.rollout.minReplicas); last loss: {first_line(cause)}"
            )

    @staticmethod
    def _kill(engine: Engine) -> None:
        import ray

        with contextlib.suppress(Exception):  # already gone is what we want
            ray.kill(engine.actor, no_restart=True)

    def _count(self) -> str:
        return f"{len(self.live)}/{self.desired}"

    def _report(self) -> None:
        if self.on_change is not None:
            self.on_change(len(self.live), self.desired)

    def shutdown(self) -> None:
        """Kill every engine actor, live or starting."""
        for engine in [*self.live, *self.starting]:
            self._kill(engine)
        self.live, self.starting, self.link = [], [], None
        self._report()

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
                self._lose([members[i] for i in lost.positions], lost.cause, "a sync-group build")

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
                self._lose([members[i] for i in lost.positions], lost.cause, "a weight sync")
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
            self._lose(lost, cause, "the check before a weight sync")

    def sync(self, version: int) -> SyncResult:
        """Push the policy's weights as `version` to every live engine (and remember it, so
        engines that join later get it too)."""
        self.version = version
        self._probe()
        return self._sync_live(version)

    # -- sampling -----------------------------------------------------------------------------

    def _wait_for_an_engine(self) -> None:
        """No engine is live (a role whose minimum is 0): start some and wait for one."""
        import ray

        if not self.starting:
            self.start(self.desired)
        refs = [engine.ready for engine in self.starting]
        ready, _ = ray.wait(refs, num_returns=1, timeout=self.join_timeout_s)
        self._joined(self._take_ready(ready), "rejoined")
        if not self.live:
            raise RolloutCapacityError(
                f"no rollout engine is live, and none came up within {self.join_timeout_s:.0f} s"
            )

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        """`sampling.n` completions per prompt, in prompt order, from the live engines."""
        chunks = plan_chunks(len(prompts), self.desired)
        results: dict[int, list[list[Completion]]] = {}
        todo = chunks
        while todo:
            if not self.live:
                self._wait_for_an_engine()
            self._ensure_current()
            members = list(self.live)
            calls = [
                (chunk, members[position])
                for chunk, position in zip(todo, assign_chunks(todo, len(members)), strict=True)
            ]
            refs = [
                engine.actor.generate.remote(
                    prompts[chunk.start : chunk.stop],
                    replace(sampling, seed=chunk.seed(sampling.seed)),
                )
                for chunk, engine in calls
            ]
            failed: list[Chunk] = []
            lost: list[Engine] = []
            cause: BaseException | None = None
            for (chunk, engine), result in zip(
                calls, outcomes(refs, self.generate_timeout_s), strict=True
            ):
                if is_actor_lost(result):
                    failed.append(chunk)
                    if engine not in lost:
                        lost.append(engine)
                    cause = result
                elif isinstance(result, BaseException):
                    raise result
                else:
                    results[chunk.index] = result
            if lost:
                assert cause is not None
                self._lose(lost, cause, "generation")
            todo = failed
        return [completions for chunk in chunks for completions in results[chunk.index]]
