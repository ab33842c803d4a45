"""Training progress for the status: steps per second, the estimated end, the latest reward.

Pure: it reads the heartbeat's report (the step and when it was reached, the last step's reward
and generation throughput) and the progress the status held before, and returns the new one.
The rate is a moving average of the rates between the steps the operator saw advance, measured
on the trainer's own step times, so the operator's polling interval does not bias it. A step
that goes back (a restart resumed from an earlier checkpoint) or stays (a new driver reporting
its checkpoint's step) moves the reference point without a rate, so the time between two
attempts never counts as training time.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from rlhfjob.api import Progress
from rlhfjob.contract import LeaseReport

SMOOTHING = 0.3
"""Weight of the newest rate in the moving average: a few steps to follow a change of pace,
without jumping at every slow checkpoint step."""
MAX_ETA_SECONDS = 100 * 365 * 24 * 3600.0
"""Beyond this an estimate says nothing (and a datetime would overflow far enough out)."""


def _finite(value: float | None) -> float | None:
    """Status numbers must be finite (the API refuses NaN and infinity)."""
    return value if value is not None and math.isfinite(value) else None


def advance(
    previous: Progress | None,
    previous_step: int | None,
    beat: LeaseReport,
    total_steps: int | None,
) -> Progress | None:
    """The progress after the trainer reported `beat`; `previous_step` is the step the status
    showed before it. None while nothing is known."""
    before = previous or Progress()
    reward = _finite(beat.reward_mean)
    tokens = _finite(beat.tokens_per_second)
    rate = before.steps_per_second
    step, reached = beat.step, beat.step_changed
    if step is None or reached is None:
        if previous is None and reward is None and tokens is None:
            return None
        return before.model_copy(
            update={
                "reward_mean": reward if reward is not None else before.reward_mean,
                "tokens_per_second": tokens if tokens is not None else before.tokens_per_second,
            }
        )
    since = before.step_time
    if previous_step is not None and since is not None and step > previous_step:
        seconds = (reached - since).total_seconds()
        if seconds > 0:
            latest = (step - previous_step) / seconds
            rate = latest if rate is None else SMOOTHING * latest + (1 - SMOOTHING) * rate
    rate = _finite(rate)
    return Progress(
        steps_per_second=rate,
        eta=eta(step, total_steps, rate, reached),
        reward_mean=reward if reward is not None else before.reward_mean,
        tokens_per_second=tokens if tokens is not None else before.tokens_per_second,
        step_time=reached,
    )


def eta(
    step: int, total_steps: int | None, steps_per_second: float | None, reached: datetime
) -> datetime | None:
    """When the last step should finish: `reached` (when `step` finished) plus the steps left at
    the rate; `reached` itself once every step is done; None without a rate or a total."""
    if total_steps is None:
        return None
    left = total_steps - step
    if left <= 0:
        return reached
    if not steps_per_second:
        return None
    seconds = left / steps_per_second
    if seconds > MAX_ETA_SECONDS:
        return None
    return reached + timedelta(seconds=seconds)
