"""Losing a Ray actor in a test, the way a test of what follows the loss needs it."""

from __future__ import annotations

from typing import Any

from rlhf_local.harness import wait_for


def kill_actor(actor: Any, timeout_s: float = 60) -> None:
    """`ray.kill` a Ray actor and wait until it is dead. `ray.kill` only asks: a call sent
    before the actor dies still answers, so a test of what follows a loss would see none
    (seen on a busy machine: a fleet scored on both reward models after one was killed)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    ray.kill(actor, no_restart=True)

    def dead() -> bool:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except RayActorError:
            return True
        except GetTimeoutError:
            pass
        return False

    wait_for(dead, timeout_s, "the killed actor to be dead", interval=0.05)
