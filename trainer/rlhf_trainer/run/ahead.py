"""The next step's batch, generated while this step trains (`algorithm.maxStaleness`).

The only reader of `maxStaleness` and `partialRolloutTokens`. With staleness 1 the engines
generate step t+1's batch on a thread of the driver while step t scores and updates; the
engines keep the weights they have, one update behind. With partial rollouts the batch is
decoded in segments, and once the step's update is done the weights are synced at the next
segment boundary (`rlhf_trainer.rollout.partial`): the open responses resume under them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from rlhf_trainer.algo.experience import SampledStep
from rlhf_trainer.data.prompts import DataPosition
from rlhf_trainer.run import metrics as m
from rlhf_trainer.run.sampling import Sampler


class BatchAhead:
    """Takes each step's batch: the one generated ahead while it is fresh enough, else a new
    one; and starts generating the next."""

    def __init__(
        self,
        sampler: Sampler,
        total_steps: int,
        sync_weights: Callable[[], None],
        log: Callable[[str], None],
    ) -> None:
        algorithm = sampler.algorithm
        self.sampler = sampler
        self.max_staleness = algorithm.max_staleness
        self.in_segments = algorithm.partial_rollout_tokens > 0
        self.total_steps = total_steps
        self.sync_weights = sync_weights
        self.log = log
        self.next: SampledStep | None = None
        """The next step's batch, generated ahead (or read back from the checkpoint)."""
        self._future: Future[SampledStep] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._started_at: DataPosition | None = None
        self._update_done = threading.Event()
        self._synced = False
        """Whether the batch being generated synced the step's update between segments."""

    def take(self, step: int, version: int) -> SampledStep:
        """Step `step`'s batch: the one generated ahead, unless a sample in it is older than
        `maxStaleness` allows (an engine that missed a sync), else a new one."""
        sampled, self.next = self.next, None
        if sampled is not None:
            oldest = version - min(sampled.rollout.policy_versions)
            if oldest <= self.max_staleness:
                return sampled
            self.log(f"step {step}: the batch generated ahead is {oldest} updates old; again")
        return self.sampler.sample(step)

    def start(self, step: int) -> None:
        """Start generating (and scoring) step `step`'s batch in a thread, if the run
        generates ahead and there is such a step."""
        if not self.max_staleness or step > self.total_steps:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead")
        self._update_done.clear()
        self._synced = False
        self._started_at = self.sampler.data.position
        between = self._between_segments if self.in_segments else None
        self._future = self._pool.submit(self.sampler.sample, step, between)

    def after_update(self) -> bool:
        """The step's update is done: wait for the batch ahead (the engines must be idle to
        take the new weights). True when it already gave the engines the update."""
        if self._future is None:
            return False
        self._update_done.set()  # a partial rollout syncs at its next boundary
        with self.sampler.phase(m.PHASE_GENERATE):
            self.next, self._future = self._future.result(), None
        return self._synced

    def lose(self) -> None:
        """The engines were lost after the update: the batch ahead is lost, its prompts are
        drawn again."""
        if self._future is not None and self._started_at is not None:
            self._future = None
            self.sampler.rewind(self._started_at)

    def settle(self) -> None:
        """Let a batch being generated end (it draws prompts too), whatever its outcome."""
        if self._future is not None:
            with contextlib.suppress(Exception):
                self._future.result()
            self._future = None

    def shutdown(self) -> None:
        if self._pool is not None:  # a batch generated ahead is of no use now
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _between_segments(self) -> bool:
        """At a segment boundary: once the step's update is done, give the engines its weights
        (once); True from then on."""
        if self._update_done.is_set() and not self._synced:
            started = time.perf_counter()
            self.sync_weights()
            self._synced = True
            self.sampler.paused_seconds += time.perf_counter() - started
        return self._synced
