"""pytest fixtures for tests against the local cluster.

Fixtures (import them into a conftest.py):

* ``local_cluster`` (session): a running cluster. Reuses one that is already up (and leaves
  it running); otherwise starts one and stops it at the end of the session unless
  ``RLHF_KEEP_CLUSTER=1``.
* ``namespace``: a fresh namespace per test that enforces Pod Security "restricted" (so every
  job the tests run proves its pods pass it), deleted afterwards.
* ``unrestricted_namespace``: the same without Pod Security (tests of raw RayClusters).

The helpers the fixtures use live in :mod:`rlhf_local.harness` (no pytest there) and are
re-exported here for the tests.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config

from rlhf_local import cluster
from rlhf_local.harness import LocalCluster, WaitTimeoutError, events_for, failure_report, wait_for
from rlhfjob import api
from rlhfjob.contract.kuberay import RAY_CLUSTERS, RAY_GROUP, RAY_VERSION

__all__ = [
    "LocalCluster",
    "WaitTimeoutError",
    "events_for",
    "failure_report",
    "local_cluster",
    "namespace",
    "unrestricted_namespace",
    "wait_for",
]


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


RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
"""The labels that make the API server refuse pods that fail Pod Security "restricted"."""


@pytest.fixture
def namespace(local_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A restricted namespace of its own for one test, deleted (and waited for) afterwards."""
    yield from fresh_namespace(local_cluster, request, RESTRICTED)


@pytest.fixture
def unrestricted_namespace(
    local_cluster: LocalCluster, request: pytest.FixtureRequest
) -> Iterator[str]:
    yield from fresh_namespace(local_cluster, request, {})


def fresh_namespace(
    local_cluster: LocalCluster, request: pytest.FixtureRequest, labels: dict[str, str]
) -> Iterator[str]:
    """A namespace named after the test (or module) of `request`, with `labels`; deleted after,
    waiting for its pods and RayClusters to go."""
    base = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:5]}"
    metadata = client.V1ObjectMeta(name=name, labels=labels or None)
    local_cluster.core.create_namespace(client.V1Namespace(metadata=metadata))
    try:
        yield name
    finally:
        # Wait until what the next test could meet is gone: pods (they hold GPUs and Kueue's
        # quota) and RayClusters (the stand-in runs a Ray cluster for each). The namespace
        # controller reaches them only after a sweep of every API resource, 5-10 s a test, so
        # they are deleted here at once (the namespace, terminating first, admits no new
        # object); the namespace itself goes a few seconds later in the background.
        core, custom = local_cluster.core, local_cluster.custom
        core.delete_namespace(name)
        for group, version, plural in ((api.GROUP, api.VERSION, api.PLURAL),
                                       (RAY_GROUP, RAY_VERSION, RAY_CLUSTERS)):  # fmt: skip
            custom.delete_collection_namespaced_custom_object(group, version, name, plural)
        core.delete_collection_namespaced_pod(name, grace_period_seconds=0)

        def emptied() -> bool:
            pods: list[Any] = core.list_namespaced_pod(name).items
            listed: Any = custom.list_namespaced_custom_object(
                RAY_GROUP, RAY_VERSION, name, RAY_CLUSTERS
            )
            return not pods and not listed["items"]

        wait_for(emptied, 120, f"the pods and RayClusters of namespace {name} to be deleted")
