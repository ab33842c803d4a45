"""Fixtures for the e2e tier: the local cluster, a namespace and an S3 bucket per test, logs
on failure."""

from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest

from rlhf_local import objectstore
from rlhf_local.testing import (
    LocalCluster,
    failure_report,
    local_cluster,
    namespace,
    unrestricted_namespace,
)

__all__ = ["local_cluster", "namespace", "s3_bucket", "unrestricted_namespace"]


@pytest.fixture
def s3_bucket(local_cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A bucket of its own in the cluster's object store for one test, deleted (with its
    contents) afterwards."""
    with objectstore.bucket(request.node.name) as name:
        yield name


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None]:
    """Attach the control plane's log tails to a failing e2e test's report."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("e2e") is not None:
        report.sections.append(("local cluster logs", failure_report()))
