"""Liveness heartbeat: the trainer renews a ``coordination.k8s.io/v1`` Lease (design decision 4).

The operator creates a Lease named after the job; the trainer driver only reads and updates it
(its ServiceAccount may ``get`` and ``update`` that one Lease). Every ``interval_seconds`` a
background thread sets ``spec.renewTime`` (and ``holderIdentity``, ``leaseDurationSeconds``) and
the annotations of a :class:`rlhfjob.contract.LeaseReport`, encoded once for both sides (each
field's annotation and meaning is declared there; `LeaseReport.describe` lists them).

A stale ``renewTime`` means the driver is hung or dead; a fresh ``renewTime`` with an old
``step-time`` means it is alive but stalled (an NCCL hang looks like this). Annotations not
listed here are left untouched. Run locally, with no Lease configured, use
:class:`NoopHeartbeat`, which has the same methods and does nothing; :func:`make_heartbeat`
picks between the two.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from rlhfjob import contract
from rlhfjob.contract.lease import LeaseReport, parse_time
from rlhfjob.contract.lease import format_time as format_time  # re-exported for callers

logger = logging.getLogger(__name__)

_SERVICE_ACCOUNT_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_HTTP_CONFLICT = 409


class LeaseClient(Protocol):
    """The two calls the heartbeat makes; ``kubernetes.client.CoordinationV1Api`` provides them."""

    def read_namespaced_lease(self, name: str, namespace: str) -> Any: ...

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any) -> Any: ...


def utc_now() -> datetime:
    return datetime.now(UTC)


def _lease_time(moment: datetime) -> datetime:
    """A timestamp for a Lease ``MicroTime`` field.

    The Kubernetes client serialises datetimes with ``isoformat()``, which drops the fraction when
    microseconds are 0; the API server's MicroTime parser then rejects the value. Nudge such a
    time by one microsecond.
    """
    moment = moment.astimezone(UTC)
    return moment.replace(microsecond=1) if moment.microsecond == 0 else moment


def default_holder_identity() -> str:
    """``<hostname>/<pid>``: distinguishes a restarted driver from the previous one."""
    return f"{socket.gethostname()}/{os.getpid()}"


class Heartbeat:
    """Renews one Lease from a background thread, carrying the trainer's progress.

    ``update`` only records progress; the next renewal (every ``interval_seconds``, or an explicit
    :meth:`renew`) writes it. A failed renewal is logged and retried at the next interval: an
    API-server hiccup must not kill training, and a Lease that stays stale is exactly what tells
    the operator something is wrong.
    """

    def __init__(
        self,
        client: LeaseClient,
        name: str,
        namespace: str,
        holder_identity: str | None = None,
        interval_seconds: float = 10.0,
        lease_duration_seconds: int = 60,
        attempt: int | None = None,
        total_steps: int | None = None,
        now: Callable[[], datetime] = utc_now,
        on_stop_request: Callable[[datetime], None] | None = None,
    ) -> None:
        if interval_seconds <= 0:
            raise ValueError(f"interval_seconds must be > 0, got {interval_seconds}")
        self.client = client
        self.name = name
        self.namespace = namespace
        self.holder_identity = holder_identity or default_holder_identity()
        self.interval_seconds = interval_seconds
        self.lease_duration_seconds = lease_duration_seconds
        self._now = now
        self.on_stop_request = on_stop_request
        """Called (from the renewing thread) once per new stop request of the operator."""
        self._lock = threading.Lock()  # guards _progress
        self._renew_lock = threading.Lock()  # one renewal at a time (thread vs. explicit renew)
        self._progress = LeaseReport(attempt=attempt, total_steps=total_steps)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: Exception | None = None
        """The exception of the last renewal, or ``None`` if it succeeded."""
        self.renewals = 0
        """Successful renewals so far."""

    @property
    def progress(self) -> LeaseReport:
        with self._lock:
            return self._progress

    def update(self, **changes: Any) -> None:
        """Record progress for the next renewal: keywords are `LeaseReport` fields, and one left
        as ``None`` keeps its value. A new step also sets when it changed."""
        with self._lock:
            progress = self._progress.updated(**changes)
            if progress.step != self._progress.step:
                progress = replace(progress, step_changed=self._now())
            self._progress = progress

    def renew(self) -> bool:
        """Renew the Lease now. Returns whether it worked; never raises for API errors."""
        with self._renew_lock:
            return self._renew()

    def _renew(self) -> bool:
        try:
            try:
                self._read_modify_replace()
            except Exception as error:
                if getattr(error, "status", None) != _HTTP_CONFLICT:
                    raise
                # Someone (the operator) changed the Lease between our read and write: reread.
                self._read_modify_replace()
        except Exception as error:
            if self.last_error is None:
                logger.warning("renewing lease %s/%s failed: %s", self.namespace, self.name, error)
            else:
                logger.debug("renewing lease %s/%s failed: %s", self.namespace, self.name, error)
            self.last_error = error
            return False
        if self.last_error is not None:
            logger.info("renewing lease %s/%s works again", self.namespace, self.name)
        self.last_error = None
        self.renewals += 1
        return True

    def _read_modify_replace(self) -> None:
        from kubernetes.client import V1LeaseSpec, V1ObjectMeta

        lease = self.client.read_namespaced_lease(name=self.name, namespace=self.namespace)
        now = _lease_time(self._now())
        if lease.metadata is None:
            lease.metadata = V1ObjectMeta()
        annotations = dict(lease.metadata.annotations or {})
        self._answer_stop_request(annotations)
        if lease.spec is None or lease.spec.holder_identity != self.holder_identity:
            # A new driver: the report is its own from now on, so that an earlier driver's
            # fields it has not set (a drain's saved step, its engines) do not read as its.
            reported = LeaseReport.keys()
            annotations = {k: v for k, v in annotations.items() if k not in reported}
        annotations.update(self.progress.to_annotations())
        lease.metadata.annotations = annotations

        if lease.spec is None:
            lease.spec = V1LeaseSpec()
        spec = lease.spec
        if spec.holder_identity != self.holder_identity:
            # A new driver process took over: count it the way Kubernetes leader election does.
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + (
                1 if spec.holder_identity else 0
            )
            spec.holder_identity = self.holder_identity
        spec.lease_duration_seconds = self.lease_duration_seconds
        spec.renew_time = now
        self.client.replace_namespaced_lease(name=self.name, namespace=self.namespace, body=lease)

    def _answer_stop_request(self, annotations: dict[str, str]) -> None:
        """The operator's request to checkpoint and stop: acknowledged in this renewal and
        told to the trainer, unless this driver already did. One an earlier driver answered
        was that driver's: its answer is carried, and the trainer not told."""
        requested = parse_time(annotations.get(contract.LEASE_STOP_REQUESTED_AT))
        if requested is None or self.on_stop_request is None:
            return
        if requested == self.progress.checkpoint_requested_at:
            return
        self.update(checkpoint_requested_at=requested)
        answered = parse_time(annotations.get(LeaseReport.key("checkpoint_requested_at")))
        if requested != answered:  # an earlier driver's answer is carried, not obeyed again
            self.on_stop_request(requested)

    def start(self) -> None:
        """Renew once now, then every ``interval_seconds`` from a daemon thread."""
        if self._thread is not None:
            raise RuntimeError("heartbeat already started")
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"heartbeat-{self.name}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.renew()
            if self._stop.wait(self.interval_seconds):
                return

    def stop(self, timeout_seconds: float = 10.0) -> None:
        """Stop the background thread (a renewal in flight finishes first), then renew once
        more: the operator reads the last step and checkpoint (a drain's answer) from here."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)
            self._thread = None
            self.renew()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Heartbeat:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class NoopHeartbeat:
    """Stand-in for :class:`Heartbeat` when no Lease is configured (a local run)."""

    def __init__(self) -> None:
        self._progress = LeaseReport()

    @property
    def progress(self) -> LeaseReport:
        return self._progress

    def update(self, **changes: Any) -> None:
        """Accepted and ignored."""

    def renew(self) -> bool:
        return True

    def start(self) -> None:
        pass

    def stop(self, timeout_seconds: float = 10.0) -> None:
        pass

    @property
    def running(self) -> bool:
        return False

    def __enter__(self) -> NoopHeartbeat:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


def make_heartbeat(
    lease_name: str | None,
    namespace: str | None = None,
    interval_seconds: float = 10.0,
    lease_duration_seconds: int = 60,
    attempt: int | None = None,
    total_steps: int | None = None,
    client: LeaseClient | None = None,
    on_stop_request: Callable[[datetime], None] | None = None,
) -> Heartbeat | NoopHeartbeat:
    """A :class:`Heartbeat` for ``lease_name``, or a :class:`NoopHeartbeat` when it is ``None``.

    Under the operator the Lease is named after the job: pass ``$RLHF_JOB_NAME``,
    ``$RLHF_JOB_NAMESPACE`` and ``$RLHF_ATTEMPT`` (see :mod:`rlhfjob.contract`). Without a
    ``client``, connects with the pod's service account (or the local kubeconfig outside a
    cluster). Without a ``namespace``, uses the pod's own namespace.
    """
    if not lease_name:
        return NoopHeartbeat()
    if namespace is None:
        try:
            namespace = _SERVICE_ACCOUNT_NAMESPACE_FILE.read_text().strip()
        except OSError as error:
            raise ValueError(
                f"lease {lease_name!r} has no namespace and this is not a pod"
            ) from error
    if client is None:
        from kubernetes import client as kubernetes_client
        from kubernetes import config as kubernetes_config

        try:
            kubernetes_config.load_incluster_config()
        except kubernetes_config.ConfigException:
            kubernetes_config.load_kube_config()
        client = kubernetes_client.CoordinationV1Api()
    return Heartbeat(
        client,
        name=lease_name,
        namespace=namespace,
        interval_seconds=interval_seconds,
        lease_duration_seconds=lease_duration_seconds,
        attempt=attempt,
        total_steps=total_steps,
        on_stop_request=on_stop_request,
    )
