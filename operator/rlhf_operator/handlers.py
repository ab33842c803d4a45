"""kopf wiring: every handler only kicks the reconciler (design decision 2).

Changes to an RLHFJob, changes to a RayCluster it owns, and a periodic timer all lead to the same
idempotent `Reconciler.reconcile`. When the policy says something is due sooner than the timer
(a backoff, a deadline), a one-off kick is scheduled for then. `registry(settings)` registers the
handlers for one operator; the settings arrive as an argument (kopf fixes a timer's interval when
it is registered), never through the environment.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
import kopf

from rlhf_operator.kube import Kube, load_kube_config
from rlhf_operator.lifecycle import Event
from rlhf_operator.metrics import OperatorMetrics
from rlhf_operator.names import LABEL_JOB
from rlhf_operator.policy import JobPolicy
from rlhf_operator.ray_auth import RayAuth
from rlhf_operator.rayjobs import RayJobClient
from rlhf_operator.reconciler import Reconciler
from rlhfjob import api
from rlhfjob.contract import kuberay as ray

log = logging.getLogger("rlhf_operator")


@dataclass(frozen=True)
class OperatorSettings:
    """What `rlhfjob operator` takes from its flags."""

    ray_auth: RayAuth
    """Derives each job's Ray token (from the key file the chart mounts)."""
    timer_interval: float = 5.0
    """Seconds between re-reads of each job."""
    metrics_port: int = 8080
    """Prometheus endpoint; 0: none."""
    policy: JobPolicy = field(default_factory=JobPolicy)
    """What a job may ask for (volume types, ServiceAccounts)."""


def _emit(body: dict[str, Any], event: Event) -> None:
    # kopf types this as its Body wrapper; a plain object dict carries the same reference fields.
    kopf.event(cast(Any, body), type=event.type, reason=event.reason, message=event.message)


def registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    """The operator's handlers, for `kopf.run(registry=...)`."""
    operator_settings = settings  # kopf passes its own `settings` to the startup handler
    handlers = kopf.OperatorRegistry()
    state: dict[str, Any] = {}
    kicks: dict[tuple[str, str], asyncio.TimerHandle] = {}

    def reconciler() -> Reconciler:
        found: Reconciler = state["reconciler"]
        return found

    @kopf.on.login(registry=handlers)  # a registry of our own has none of kopf's by default
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=handlers)
    async def start(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.WARNING  # our own Events say what matters; not kopf's
        settings.watching.server_timeout = 300
        metrics = OperatorMetrics()
        if operator_settings.metrics_port:
            metrics.serve(operator_settings.metrics_port)
        session = aiohttp.ClientSession()
        kube = Kube(load_kube_config())
        state.update(
            session=session,
            reconciler=Reconciler(
                kube,
                RayJobClient(session),
                metrics,
                emit=_emit,
                ray_auth=operator_settings.ray_auth,
                policy=operator_settings.policy,
            ),
        )

    @kopf.on.cleanup(registry=handlers)
    async def stop(**_: Any) -> None:
        if session := state.get("session"):
            await session.close()

    async def kick(namespace: str, name: str) -> None:
        """Reconcile now; if something is due before the next timer tick, come back for it."""
        try:
            due = await reconciler().reconcile(namespace, name)
        except Exception:  # a bug or an API-server error: logged with its traceback, retried
            log.exception("%s/%s: reconcile failed; the timer retries", namespace, name)
            return
        if due is not None and due < operator_settings.timer_interval:
            if (old := kicks.pop((namespace, name), None)) is not None:
                old.cancel()
            loop = asyncio.get_running_loop()
            kicks[(namespace, name)] = loop.call_later(
                max(due, 0.05), lambda: asyncio.ensure_future(kick(namespace, name))
            )

    @kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL, registry=handlers)
    @kopf.on.create(api.GROUP, api.VERSION, api.PLURAL, registry=handlers)
    @kopf.on.update(api.GROUP, api.VERSION, api.PLURAL, field="spec", registry=handlers)
    async def job_changed(namespace: str | None, name: str, **_: Any) -> None:
        await kick(namespace or "default", name)

    @kopf.timer(
        api.GROUP,
        api.VERSION,
        api.PLURAL,
        interval=settings.timer_interval,
        idle=0,
        registry=handlers,
    )
    async def job_timer(namespace: str | None, name: str, **_: Any) -> None:
        await kick(namespace or "default", name)

    @kopf.on.event(
        ray.RAY_GROUP,
        ray.RAY_VERSION,
        ray.RAY_CLUSTERS,
        labels={LABEL_JOB: kopf.PRESENT},
        registry=handlers,
    )
    async def cluster_event(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
        await kick(namespace or "default", labels[LABEL_JOB])

    @kopf.on.delete(api.GROUP, api.VERSION, api.PLURAL, optional=True, registry=handlers)
    async def job_deleted(namespace: str | None, name: str, **_: Any) -> None:
        """Owned objects go with the job (owner references); checkpoints are never touched."""
        reconciler().forget(namespace or "default", name)

    return handlers
