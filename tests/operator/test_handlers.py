"""The kopf wiring: the timer's schedule and the Kubernetes client's threads, by urgency."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import pytest

from rlhf_operator import handlers
from rlhf_operator.handlers import ROUTINE, URGENT, OperatorSettings, UrgencyExecutor, registry
from rlhf_operator.ray_auth import RayAuth


def test_the_timer_first_ticks_one_interval_after_creation_kicked() -> None:
    settings = OperatorSettings(ray_auth=RayAuth(b"k" * 32), timer_interval=5.0)
    timers = list(registry(settings)._spawning.get_all_handlers())
    assert [(t.id, t.interval, t.initial_delay) for t in timers] == [("job_timer", 5.0, 5.0)]


def test_kopf_says_nothing_for_each_timer_tick_and_raycluster_event_but_the_rest() -> None:
    quiet = handlers._QuietSuccesses(("Timer", "job_timer"), ("Handler", "cluster_event"))

    def kept(message: str) -> bool:
        record = logging.LogRecord("kopf.objects", logging.INFO, __file__, 1, message, (), None)
        return quiet.filter(record)

    assert not kept("Timer 'job_timer' succeeded.")
    assert not kept("Handler 'cluster_event' succeeded.")
    assert kept("Handler 'registry.<locals>.job_changed' succeeded.")
    assert kept("Timer 'job_timer' failed with an exception and will try again in 60 seconds: x")


def _submit_as(executor: UrgencyExecutor, urgency: tuple[int, int], fn: Callable[[], None]) -> None:
    token = handlers._urgency.set(urgency)
    try:
        executor.submit(fn)
    finally:
        handlers._urgency.reset(token)


def test_urgent_and_older_reconciles_are_served_first() -> None:
    executor = UrgencyExecutor(max_workers=1)
    gate = threading.Event()
    ran: list[str] = []
    executor.submit(gate.wait)  # the one thread is busy: the rest queues
    for urgency, label in [
        ((ROUTINE, 5), "timer 5"),
        ((URGENT, 9), "created 9"),
        ((ROUTINE, 2), "timer 2"),
        ((URGENT, 3), "created 3"),
    ]:
        _submit_as(executor, urgency, lambda label=label: ran.append(label))  # type: ignore[misc]
    gate.set()
    executor.shutdown(wait=True)
    assert ran == ["created 3", "created 9", "timer 2", "timer 5"]


def test_shutting_down_runs_or_cancels_what_is_queued() -> None:
    executor = UrgencyExecutor(max_workers=1)
    gate = threading.Event()
    executor.submit(gate.wait)
    queued = executor.submit(lambda: None)
    threading.Timer(0.05, gate.set).start()
    executor.shutdown(wait=True, cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError):
        executor.submit(lambda: None)


def test_asyncio_to_thread_runs_on_it_under_the_callers_urgency() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        executor = UrgencyExecutor(max_workers=1)
        loop.set_default_executor(executor)
        gate = threading.Event()
        blocked = asyncio.ensure_future(asyncio.to_thread(gate.wait))
        await asyncio.sleep(0.01)
        ran: list[str] = []

        async def call(urgency: tuple[int, int], label: str) -> None:
            handlers._urgency.set(urgency)  # a task of its own: its own context
            await asyncio.to_thread(ran.append, label)

        calls = [
            asyncio.ensure_future(call((ROUTINE, 1), "timer")),
            asyncio.ensure_future(call((URGENT, 2), "created")),
        ]
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(blocked, *calls)
        assert threading.current_thread() is threading.main_thread()
        return ran

    assert asyncio.run(main()) == ["created", "timer"]
