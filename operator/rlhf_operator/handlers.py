"""kopf wiring: every handler only kicks the reconciler (design decision 2).

Changes to an RLHFJob, changes to a RayCluster it owns, and a periodic timer all lead to the same
idempotent `Reconciler.reconcile`. When the policy says something is due sooner than the timer
(a backoff, a deadline), a one-off kick is scheduled for then. `registry(settings)` registers the
handlers for one operator; the settings arrive as an argument (kopf fixes a timer's interval when
it is registered), never through the environment.

The Kubernetes client blocks, so its calls run on `KUBE_THREADS` threads, served by urgency: the
reconciles of a job that was created, resumed or changed go before those of the timer and of
RayCluster events, and older reconciles before newer ones. So when many jobs arrive at once, each
new job's RayCluster is created in the order the jobs came, not after everyone's timer ticks.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import logging
import queue
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
import kopf
from aiohttp import web
from kubernetes import client

from rlhf_operator.kube import Kube, load_kube_config
from rlhf_operator.lifecycle import Event
from rlhf_operator.metrics import OperatorMetrics
from rlhf_operator.names import LABEL_JOB
from rlhf_operator.network import NetworkSettings
from rlhf_operator.policy import JobPolicy
from rlhf_operator.ray_auth import RayAuth
from rlhf_operator.rayjobs import RayJobClient, dashboard_session
from rlhf_operator.readiness import Readiness, jobs_readable
from rlhf_operator.reconciler import Reconciler
from rlhfjob import api
from rlhfjob.contract import kuberay as ray
from rlhfjob.contract import kueue

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
    network: NetworkSettings | None = None
    """Where jobs' pods may connect and who may reach them (None: `Reconciler`'s default)."""
    dashboard_from_annotation: bool = False
    """A test hook: trust the RayCluster's dashboard annotation (`Reconciler`)."""
    readiness_port: int = 0
    """The readiness endpoint (`readiness.Readiness`), opened once started; 0: none."""
    namespaces: tuple[str, ...] = ()
    """The namespaces it serves (empty: every one), where readiness reads RLHFJobs."""


KUBE_THREADS = 32
"""Threads for the blocking Kubernetes client, and its connection pool's size (the client's
default pool, 5 per core, would open and drop a connection for every call beyond it)."""
URGENT, ROUTINE = 0, 1
TIMER_ID, CLUSTER_EVENT_ID, WORKLOAD_EVENT_ID = "job_timer", "cluster_event", "workload_event"
"""kopf's ids of the handlers that run most often."""
_urgency: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar(
    "rlhf_operator_urgency", default=(ROUTINE, 0)
)
"""(URGENT or ROUTINE, the reconcile's number) of the reconcile running in this context."""
_LAST = (ROUTINE + 1, 0)


class _UrgencyQueue:
    """The work queue of `UrgencyExecutor`: what the queue's `put` is called under (the
    submitting task's `_urgency`) orders the work; shutdown's None sentinels come last."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int], int, Any]] = []
        self._order = itertools.count()
        self._ready = threading.Condition()

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        key = _LAST if item is None else _urgency.get()
        with self._ready:
            heapq.heappush(self._heap, (key, next(self._order), item))
            self._ready.notify()

    def put_nowait(self, item: Any) -> None:
        self.put(item)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        with self._ready:
            while not self._heap:
                if not block or not self._ready.wait(timeout):
                    raise queue.Empty
            return heapq.heappop(self._heap)[2]

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def qsize(self) -> int:
        return len(self._heap)

    def empty(self) -> bool:
        return not self._heap


class UrgencyExecutor(ThreadPoolExecutor):
    """A thread pool that runs the most urgent, then the oldest, reconcile's calls first."""

    def __init__(self, max_workers: int = KUBE_THREADS) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix="kube")
        self._work_queue = cast(Any, _UrgencyQueue())


class _QuietSuccesses(logging.Filter):
    """Drops kopf's line for every successful timer tick and RayCluster event: hundreds a
    minute with many jobs, and no news (a failure is still logged, and so are the rest)."""

    def __init__(self, *handlers: tuple[str, str]) -> None:
        super().__init__()
        self.lines = frozenset(f"{kind} {id_!r} succeeded." for kind, id_ in handlers)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg in self.lines)


def _emit(body: dict[str, Any], event: Event) -> None:
    # kopf types this as its Body wrapper; a plain object dict carries the same reference fields.
    kopf.event(cast(Any, body), type=event.type, reason=event.reason, message=event.message)


class _Operator:
    """One operator's state between its handlers: the reconciler (made at startup, once the
    event loop runs) and the kicks scheduled sooner than the timer."""

    def __init__(self, settings: OperatorSettings) -> None:
        self.settings = settings
        self.session: aiohttp.ClientSession | None = None
        self._reconciler: Reconciler | None = None
        self._readiness: web.AppRunner | None = None
        self._kicks: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._numbers = itertools.count(1)

    @property
    def reconciler(self) -> Reconciler:
        if self._reconciler is None:
            raise RuntimeError("the operator has not started")
        return self._reconciler

    async def start(self, kopf_settings: kopf.OperatorSettings) -> None:
        """Quiet kopf, serve the metrics, and make the clients and the reconciler."""
        kopf_settings.posting.level = logging.WARNING  # our own Events say what matters; not kopf's
        logging.getLogger("kopf.objects").addFilter(
            _QuietSuccesses(
                ("Timer", TIMER_ID),
                ("Handler", CLUSTER_EVENT_ID),
                ("Handler", WORKLOAD_EVENT_ID),
            )
        )
        kopf_settings.watching.server_timeout = 300
        # The chart grants no read on CRDs (least privilege): kopf's one scan at start finds
        # RLHFJob and RayCluster, and its CRD watch would only retry a 403 and warn.
        kopf_settings.scanning.disabled = True
        metrics = OperatorMetrics()
        if self.settings.metrics_port:
            metrics.serve(self.settings.metrics_port)
        # `asyncio.to_thread` (the Kubernetes calls) and aiohttp's name lookups use this one.
        asyncio.get_running_loop().set_default_executor(UrgencyExecutor(KUBE_THREADS))
        self.session = dashboard_session()  # no decompression: a head's answers are untrusted
        configuration = load_kube_config().configuration
        configuration.connection_pool_maxsize = KUBE_THREADS
        self._reconciler = Reconciler(
            Kube(client.ApiClient(configuration)),
            RayJobClient(self.session),
            metrics,
            emit=_emit,
            ray_auth=self.settings.ray_auth,
            policy=self.settings.policy,
            dashboard_from_annotation=self.settings.dashboard_from_annotation,
            network=self.settings.network,
        )
        if self.settings.readiness_port:  # last: ready means started
            check = jobs_readable(client.ApiClient(configuration), self.settings.namespaces)
            self._readiness = await Readiness(check).serve(self.settings.readiness_port)

    async def stop(self) -> None:
        if self._readiness is not None:
            await self._readiness.cleanup()
        if self.session is not None:
            await self.session.close()

    async def kick(self, namespace: str, name: str, *, urgent: bool = False) -> None:
        """Reconcile now; if something is due before the next timer tick, come back for it."""
        token = _urgency.set((URGENT if urgent else ROUTINE, next(self._numbers)))
        try:
            due = await self.reconciler.reconcile(namespace, name)
        except Exception:  # a bug or an API-server error: logged with its traceback, retried
            log.exception("%s/%s: reconcile failed; the timer retries", namespace, name)
            return
        finally:
            _urgency.reset(token)
        if due is not None and due < self.settings.timer_interval:
            if (old := self._kicks.pop((namespace, name), None)) is not None:
                old.cancel()
            loop = asyncio.get_running_loop()
            self._kicks[(namespace, name)] = loop.call_later(
                max(due, 0.05), lambda: asyncio.ensure_future(self.kick(namespace, name))
            )


def registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    """The operator's handlers, for `kopf.run(registry=...)`: each one line of `_Operator`
    (their names, kopf's ids for them, are what its log lines and annotations say)."""
    handlers = kopf.OperatorRegistry()
    operator = _Operator(settings)

    @kopf.on.login(registry=handlers)  # a registry of our own has none of kopf's by default
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=handlers)
    async def start(settings: kopf.OperatorSettings, **_: Any) -> None:
        await operator.start(settings)

    @kopf.on.cleanup(registry=handlers)
    async def stop(**_: Any) -> None:
        await operator.stop()

    @kopf.on.resume(api.GROUP, api.VERSION, api.PLURAL, registry=handlers)
    @kopf.on.create(api.GROUP, api.VERSION, api.PLURAL, registry=handlers)
    @kopf.on.update(api.GROUP, api.VERSION, api.PLURAL, field="spec", registry=handlers)
    async def job_changed(namespace: str | None, name: str, **_: Any) -> None:
        await operator.kick(namespace or "default", name, urgent=True)

    @kopf.timer(
        api.GROUP,
        api.VERSION,
        api.PLURAL,
        interval=settings.timer_interval,
        idle=0,
        # Its first tick one interval on: creation and resumption kick already.
        initial_delay=settings.timer_interval,
        id=TIMER_ID,
        registry=handlers,
    )
    async def job_timer(namespace: str | None, name: str, **_: Any) -> None:
        await operator.kick(namespace or "default", name)

    @kopf.on.event(
        ray.RAY_GROUP,
        ray.RAY_VERSION,
        ray.RAY_CLUSTERS,
        labels={LABEL_JOB: kopf.PRESENT},
        id=CLUSTER_EVENT_ID,
        registry=handlers,
    )
    async def cluster_event(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
        await operator.kick(namespace or "default", labels[LABEL_JOB])

    if settings.policy.kueue:

        @kopf.on.event(
            kueue.KUEUE_GROUP,
            kueue.KUEUE_VERSION,
            kueue.WORKLOADS,
            labels={LABEL_JOB: kopf.PRESENT},
            id=WORKLOAD_EVENT_ID,
            registry=handlers,
        )
        async def workload_event(
            namespace: str | None, labels: Mapping[str, str], **_: Any
        ) -> None:
            """Kueue admitted, evicted or requeued a job's Workload."""
            await operator.kick(namespace or "default", labels[LABEL_JOB])

    @kopf.on.delete(api.GROUP, api.VERSION, api.PLURAL, optional=True, registry=handlers)
    async def job_deleted(namespace: str | None, name: str, **_: Any) -> None:
        """Owned objects go with the job (owner references); checkpoints are never touched."""
        operator.reconciler.forget(namespace or "default", name)

    return handlers
