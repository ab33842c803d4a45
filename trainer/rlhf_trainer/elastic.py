"""An elastic pool of Ray actors, used as one worker that survives losing some of them.

Rollout engines (`fleet.RolloutFleet`) and reward models (`reward_models.RewardModelFleet`)
are elastic roles (design decision 5): training goes on while at least `minimum` of their
`desired` actors live. The pool keeps that membership: actors start asynchronously and are
admitted once their readiness call answers; an actor whose call raises ``RayActorError`` (its
Ray node went away with its pod) is killed, logged and dropped, and below the minimum the pool
raises the role's capacity error, which the driver reports as retryable. `fan_out` runs a
step's chunks round-robin on the live actors and re-runs those of lost actors on the rest.

Work does not depend on how many actors live. A step's items are split into `desired`
contiguous chunks, chunk ``i`` always seeded with ``derive_seed(step_seed, i)``
(`plan_chunks`), so a step computes the same whichever actors are alive, and a resumed run
repeats an uninterrupted one even across lost actors.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rlhf_trainer.seeds import derive_seed

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
    """Items ``[start, stop)`` of a step, computed with the seed of chunk `index`."""

    index: int
    start: int
    stop: int

    def seed(self, step_seed: int | None) -> int | None:
        return None if step_seed is None else derive_seed(step_seed, self.index)


def plan_chunks(count: int, desired: int) -> list[Chunk]:
    """The non-empty chunks of `count` items split `desired` ways (whatever actors live)."""
    if desired < 1:
        raise ValueError("desired must be at least 1")
    return [
        Chunk(index, start, stop)
        for index, (start, stop) in enumerate(split_evenly(count, desired))
        if start < stop
    ]


def assign_chunks(chunks: Sequence[Chunk], engines: int) -> list[int]:
    """Round-robin: the position (among `engines` live actors) that computes each chunk."""
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


def raise_first_error(results: Sequence[Any]) -> None:
    for result in results:
        if isinstance(result, BaseException):
            raise result


def first_line(error: BaseException, limit: int = 160) -> str:
    """A one-line summary of an error for the log."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# --------------------------------------------------------------------------------------------
# The pool


@dataclass
class Member:
    """One actor of a pool and what the pool knows about it."""

    id: int
    actor: Any
    ready: Any = field(default=None, repr=False)
    """While starting: the ref that resolves once the actor is up."""


@dataclass(frozen=True)
class RoleWords:
    """How a pool's log lines and errors name its actors and its role."""

    one: str
    """One actor, before its id: ``rollout engine`` (``rollout engine 2 rejoined``)."""
    many: str
    """Several, after a count in an error: ``rollout engines``."""
    short: str
    """Several, after a count in the log: ``engines`` (``... rejoined; 2/2 engines``)."""
    role: str
    """Its role in the spec, for the field that sets the minimum (``roles.<role>.minReplicas``)."""
    capacity_error: type[RuntimeError]
    """Raised below the minimum: the step cannot go on (retryable)."""


M = TypeVar("M", bound=Member)


class ElasticPool(Generic[M]):
    """The membership of an elastic role's actors: start, admit, lose, replace.

    `start_actor(id)` starts one actor and `make_member(id, actor)` wraps it with its readiness
    ref; `on_change(live, desired)` hears about every change in the number of live actors; `log`
    gets one line per loss, start and join. Subclasses hear of joins and losses through
    `_joined_hook` and `_lost_hook` (the rollout fleet rebuilds its weight-sync group there).
    """

    def __init__(
        self,
        words: RoleWords,
        start_actor: Callable[[int], Any],
        make_member: Callable[[int, Any], M],
        *,
        desired: int,
        minimum: int,
        log: Callable[[str], None] = print,
        on_change: Callable[[int, int], None] | None = None,
        join_timeout_s: float,
        admit_timeout_s: float = 0.0,
    ) -> None:
        if desired < 1 or not 0 <= minimum <= desired:
            raise ValueError(f"need 1 <= desired and 0 <= minimum <= desired: {minimum}/{desired}")
        self.words = words
        self.start_actor = start_actor
        self.make_member = make_member
        self.desired = desired
        self.minimum = minimum
        self.log = log
        self.on_change = on_change
        self.join_timeout_s = join_timeout_s
        """How long a call waits for a first actor when none is live (a minimum of 0)."""
        self.admit_timeout_s = admit_timeout_s
        """How long `maintain` waits for starting actors to answer (never for placement)."""
        self.live: list[M] = []
        """The admitted actors, by id."""
        self.starting: list[M] = []
        self.next_id = 0

    # -- membership ---------------------------------------------------------------------------

    def add(self, actor_id: int, actor: Any) -> None:
        """Count an actor that was started (or adopted) elsewhere as starting."""
        self.starting.append(self.make_member(actor_id, actor))
        self.next_id = max(self.next_id, actor_id + 1)

    def start(self, count: int) -> None:
        """Start `count` new actors (asynchronously; `wait_ready` or `maintain` admits them)."""
        for _ in range(count):
            actor_id = self.next_id
            self.add(actor_id, self.start_actor(actor_id))

    def wait_ready(self, timeout_s: float, grace_s: float = 30.0) -> None:
        """At startup: admit the starting actors as they come up. Waits for all of them, but
        once the minimum (and at least one) is up, no longer than `grace_s` more, and never
        beyond `timeout_s`; the rest join later through `maintain`."""
        import ray

        needed = max(self.minimum, 1)
        deadline = time.monotonic() + timeout_s
        enough_at: float | None = None
        joined: list[int] = []
        while self.starting:
            refs = [member.ready for member in self.starting]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            joined += self._take_ready(ready)
            now = time.monotonic()
            if enough_at is None and len(self.live) >= needed:
                enough_at = now
            limit = deadline if enough_at is None else min(deadline, enough_at + grace_s)
            if not self.starting or now >= limit:
                break
            ray.wait([m.ready for m in self.starting], num_returns=1, timeout=limit - now)
        self._joined(joined, "up")
        if len(self.live) < needed:
            raise self.words.capacity_error(
                f"only {len(self.live)} of {self.desired} {self.words.many} came up within "
                f"{timeout_s:.0f} s (at least {needed} needed)"
            )
        if self.starting:
            ids = ", ".join(str(member.id) for member in self.starting)
            self.log(f"{self.words.one} {ids} still starting; continuing with {self.count()}")

    def maintain(self) -> None:
        """At the start of a step: admit starting actors that answered within
        `admit_timeout_s`, and start replacements for missing ones unless some are starting
        already. Never waits for an actor that cannot be placed."""
        import ray

        if self.starting:
            refs = [member.ready for member in self.starting]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.admit_timeout_s)
            self._joined(self._take_ready(ready), "rejoined")
        missing = self.desired - len(self.live)
        if missing > 0 and not self.starting:
            first = self.next_id
            self.start(missing)
            ids = ", ".join(str(actor_id) for actor_id in range(first, self.next_id))
            self.log(f"starting {self.words.one} {ids}; {self.count()} live")

    def shutdown(self) -> None:
        """Kill every actor, live or starting."""
        for member in [*self.live, *self.starting]:
            self._kill(member)
        self.live, self.starting = [], []
        self._lost_hook()
        self._report()

    def count(self) -> str:
        """``<live>/<desired> <short>``, for the log."""
        return f"{len(self.live)}/{self.desired} {self.words.short}"

    def _take_ready(self, ready_refs: Sequence[Any]) -> list[int]:
        """Move the starting actors whose ready ref resolved to the live set (dropping those
        that died starting); returns the ids that became live."""
        ready_set = set(ready_refs)
        done = [member for member in self.starting if member.ready in ready_set]
        if not done:
            return []
        self.starting = [member for member in self.starting if member.ready not in ready_set]
        joined = []
        for member, result in zip(done, outcomes([m.ready for m in done], 0), strict=True):
            member.ready = None
            if isinstance(result, BaseException):
                self._kill(member)
                self.log(f"{self.words.one} {member.id} failed to start ({first_line(result)})")
                if not is_actor_lost(result):
                    raise result
                continue
            self.live.append(member)
            joined.append(member.id)
        return joined

    def _joined(self, actor_ids: list[int], verb: str) -> None:
        """After actors joined: the hook (which may lose some of them again), a report, a log."""
        if not actor_ids:
            return
        self.live.sort(key=lambda member: member.id)
        self._report()
        self._joined_hook()
        still = [i for i in actor_ids if any(member.id == i for member in self.live)]
        if still:
            ids = ", ".join(str(actor_id) for actor_id in still)
            self.log(f"{self.words.one} {ids} {verb}; {self.count()}")

    def lose(self, members: Sequence[M], cause: BaseException, during: str) -> None:
        """Drop actors that died; raises the role's capacity error below the minimum."""
        for member in members:
            if member not in self.live:
                continue
            self._kill(member)
            self.live.remove(member)
            self.log(
                f"{self.words.one} {member.id} lost during {during} ({first_line(cause)}); "
                f"continuing with {self.count()}"
            )
        self._lost_hook()
        self._report()
        if len(self.live) < self.minimum:
            raise self.words.capacity_error(
                f"{len(self.live)}/{self.desired} {self.words.many} left, fewer than the minimum "
                f"{self.minimum} "
                f"(roles.{self.words.role}.minReplicas); last loss: {first_line(cause)}"
            )

    def _joined_hook(self) -> None:
        """Actors joined the live set (a subclass's business, e.g. a new sync group)."""

    def _lost_hook(self) -> None:
        """Actors left the live set."""

    @staticmethod
    def _kill(member: Member) -> None:
        import ray

        with contextlib.suppress(Exception):  # already gone is what we want
            ray.kill(member.actor, no_restart=True)

    def _report(self) -> None:
        if self.on_change is not None:
            self.on_change(len(self.live), self.desired)

    # -- work ---------------------------------------------------------------------------------

    def wait_for_one(self) -> None:
        """No actor is live (a role whose minimum is 0): start some and wait for one."""
        import ray

        if not self.starting:
            self.start(self.desired)
        refs = [member.ready for member in self.starting]
        ready, _ = ray.wait(refs, num_returns=1, timeout=self.join_timeout_s)
        self._joined(self._take_ready(ready), "rejoined")
        if not self.live:
            raise self.words.capacity_error(
                f"no {self.words.one} is live, and none came up within {self.join_timeout_s:.0f} s"
            )

    def fan_out(
        self,
        chunks: Sequence[Chunk],
        call: Callable[[M, Chunk], Any],
        *,
        timeout_s: float,
        during: str,
        before_each_round: Callable[[], None] = lambda: None,
    ) -> dict[int, Any]:
        """Each chunk's result by its index: `call(member, chunk)` returns a ref, the chunks
        go round-robin over the live actors, and those of lost actors run again on the rest."""
        results: dict[int, Any] = {}
        todo = list(chunks)
        while todo:
            if not self.live:
                self.wait_for_one()
            before_each_round()
            members = list(self.live)
            calls = [
                (chunk, members[position])
                for chunk, position in zip(todo, assign_chunks(todo, len(members)), strict=True)
            ]
            refs = [call(member, chunk) for chunk, member in calls]
            failed: list[Chunk] = []
            lost: list[M] = []
            cause: BaseException | None = None
            for (chunk, member), result in zip(calls, outcomes(refs, timeout_s), strict=True):
                if is_actor_lost(result):
                    failed.append(chunk)
                    if member not in lost:
                        lost.append(member)
                    cause = result
                elif isinstance(result, BaseException):
                    raise result
                else:
                    results[chunk.index] = result
            if lost:
                assert cause is not None
                self.lose(lost, cause, during)
            todo = failed
        return results
