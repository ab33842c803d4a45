"""pytest helpers for tests against the local cluster.

Fixtures (import them into a conftest.py):

* ``local_cluster`` (session): a running cluster. Reuses one that is already up (and leaves
  it running); otherwise starts one and stops it at the end of the session unless
  ``RLHF_KEEP_CLUSTER=1``.
* ``namespace``: a fresh namespace per test, deleted afterwards.

Helpers: :func:`wait_for` polls a condition with a timeout (tests never sleep a fixed time),
:func:`events_for` and :func:`failure_report` explain what the cluster did.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client, config

from rlhf_local import cluster

T = TypeVar("T")


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
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}{extra}")
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

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        return cluster.kubectl(*args, stdin=stdin, check=check)

    def apply(self, manifest: dict[str, Any] | str, namespace: str | None = None) -> str:
        """Server-side apply a manifest (dict or YAML text)."""
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        ns = [f"--namespace={namespace}"] if namespace else []
        return self.kubectl("apply", "--server-side", *ns, "-f", "-", stdin=text)


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    """The local cluster, started for this session unless one is already running."""
    reused = cluster.is_running()
    kubeconfig = cluster.kubeconfig_path() if reused else cluster.up()
    api = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        yield LocalCluster(kubeconfig, api)
    finally:
        api.close()
        if not reused and os.environ.get("RLHF_KEEP_CLUSTER") != "1":
            cluster.down()


@pytest.fixture
def namespace(local_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of its own for one test, deleted (and waited for) afterwards."""
    base = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:5]}"
    local_cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        # Wait until it is gone, so its pods no longer hold GPUs the next test needs.
        core = local_cluster.core
        core.delete_namespace(name)

        def gone() -> bool:
            items: list[Any] = core.list_namespace().items
            return name not in {n.metadata.name for n in items}

        wait_for(
            gone,
            120,
            f"namespace {name} to be deleted",
        )


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
