"""Handles on the running local cluster for tests, the demo and the benchmarks.

No pytest here: the demo and the benchmarks use these too (`rlhf_local.testing` holds the
fixtures). :func:`wait_for` polls a condition with a timeout (nothing sleeps a fixed time);
:func:`events_for` and :func:`failure_report` explain what the cluster did.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client

from rlhf_local import cluster

T = TypeVar("T")


class WaitTimeoutError(AssertionError):
    """A condition did not come true in time (an assertion: a test that waits for it fails)."""


def wait_for(
    condition: Callable[[], T | None],
    timeout: float,
    what: str,
    interval: float = 0.25,
    details: Callable[[], str] | None = None,
) -> T:
    """Poll `condition` until it returns something truthy and return that value.

    Exceptions from `condition` count as "not yet" (the last one is reported). On timeout
    fail with `what`, the last value or error, and `details()` when given.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = condition()
            if value:
                return value
            last = value
        except Exception as err:
            last = err
        if time.monotonic() > deadline:
            extra = ""
            if details is not None:
                try:
                    extra = "\n" + details()
                except Exception as err:
                    extra = f"\n(details failed: {err})"
            raise WaitTimeoutError(
                f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}{extra}"
            )
        time.sleep(interval)


@dataclass
class LocalCluster:
    """Handle on the running local cluster."""

    kubeconfig: Path
    api: client.ApiClient

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    @property
    def networking(self) -> client.NetworkingV1Api:
        return client.NetworkingV1Api(self.api)

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        return cluster.kubectl(*args, stdin=stdin, check=check)

    def apply(self, manifest: dict[str, Any] | str, namespace: str | None = None) -> str:
        """Server-side apply a manifest (dict or YAML text)."""
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        ns = [f"--namespace={namespace}"] if namespace else []
        return self.kubectl("apply", "--server-side", *ns, "-f", "-", stdin=text)


def events_for(lc: LocalCluster, namespace: str, name: str | None = None) -> list[Any]:
    """Events in `namespace` (about the object `name` when given), oldest first."""
    sel = f"involvedObject.name={name}" if name else None
    items = lc.core.list_namespaced_event(namespace, field_selector=sel).items
    return sorted(
        items, key=lambda e: e.last_timestamp or e.event_time or e.metadata.creation_timestamp
    )


def failure_report(lines: int = 30) -> str:
    """Tails of every component's log, to attach to a failing e2e test."""
    return "\n".join(cluster.log_tail(name, lines) for name in cluster.COMPONENTS)
