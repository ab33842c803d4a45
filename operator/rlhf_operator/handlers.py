"""kopf wiring: every handler only kicks the reconciler (design decision 2).

Changes to an RLHFJob, changes to a RayCluster it owns, and a periodic timer all lead to the same
idempotent `Reconciler.reconcile`. When the policy says something is due sooner than the timer
(a backoff, a deadline), a one-off kick is scheduled for then.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
import kopf

from rlhf_operator.kube import Kube, load_kube_config
from rlhf_operator.lifecycle import Event
from rlhf_operator.metrics import OperatorMetrics
from rlhf_operator.names import LABEL_JOB
from rlhf_operator.rayjobs import RayJobClient
from rlhf_operator.reconciler import Reconciler
from rlhfjob import api

log = logging.getLogger("rlhf_operator")


@dataclass
class OperatorSettings:
    """From the environment, which `rlhfjob operator` sets from its flags before importing."""

    timer_interval: float = float(os.environ.get("RLHF_OPERATOR_TIMER_INTERVAL", "5"))
    metrics_port: int = int(os.environ.get("RLHF_OPERATOR_METRICS_PORT", "8080"))


SETTINGS = OperatorSettings()  # read when kopf registers the handlers, i.e. at import
_state: dict[str, Any] = {}


def _reconciler() -> Reconciler:
    reconciler: Reconciler = _state["reconciler"]
    return reconciler


def _emit(body: dict[str, Any], event: Event) -> None:
    # kopf types this as its Body wrapper; a plain object dict carries the same reference fields.
    kopf.event(cast(Any, body), type=event.type, reason=event.reason, message=event.message)


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = logging.WARNING  # our own Events say what matters; not kopf's
    settings.watching.server_timeout = 300
    metrics = OperatorMetrics()
    if SETTINGS.metrics_port:
        metrics.serve(SETTINGS.metrics_port)
    session = aiohttp.ClientSession()
    _state.update(
        session=session,
        kicks={},
        reconciler=Reconciler(Kube(load_kube_config()), RayJobClient(session), metrics, emit=_emit),
    )


@kopf.on.cleanup()
async def stop(**_: Any) -> None:
    if session := _state.get("session"):
        await session.close()


async def kick(namespace: str, name: str) -> None:
    """Reconcile now; if something is due before the next timer tick, come back for it."""
    try:
        due = await _reconciler().reconcile(namespace, name)
    except Exception:
        log.exception("%s/%s: reconcile failed; the timer retries", namespace, name)
        return
    if due is not None and due < SETTINGS.timer_interval:
        kicks: dict[tuple[str, str], asyncio.TimerHandle] = _state["kicks"]
        if (old := kicks.pop((namespace, name), None)) is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        kicks[(namespace, name)] = loop.call_later(
            max(due, 0.05), lambda: asyncio.ensure_future(kick(namespace, name))
        )


@kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.create(api.GROUP, api.VERSION, api.PLURAL)
@kopf.on.update(api.GROUP, api.VERSION, api.PLURAL, field="spec")
async def job_changed(namespace: str | None, name: str, **_: Any) -> None:
    await kick(namespace or "default", name)


@kopf.timer(api.GROUP, api.VERSION, api.PLURAL, interval=SETTINGS.timer_interval, idle=0)
async def job_timer(namespace: str | None, name: str, **_: Any) -> None:
    await kick(namespace or "default", name)


@kopf.on.event("ray.io", "v1", "rayclusters", labels={LABEL_JOB: kopf.PRESENT})
async def cluster_event(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    await kick(namespace or "default", labels[LABEL_JOB])


@kopf.on.delete(api.GROUP, api.VERSION, api.PLURAL, optional=True)
async def job_deleted(namespace: str | None, name: str, **_: Any) -> None:
    """Owned objects go with the job (owner references); checkpoints are never touched."""
    _reconciler().forget(namespace or "default", name)
