"""Fixtures of the e2e tests that need the operator (see rlhf_local.operator_process)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rlhf_local.operator_process import OperatorProcess, operator_kubeconfig
from rlhf_local.testing import LocalCluster


@pytest.fixture(scope="session")
def operator(
    local_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    workdir = tmp_path_factory.mktemp("operator")
    handle = OperatorProcess(
        kubeconfig=operator_kubeconfig(local_cluster, workdir / "kubeconfig"),
        log_path=workdir / "operator.log",
    )
    handle.start()
    try:
        yield handle
    finally:
        handle.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Attach the operator's log to a failing test that used it."""
    outcome = yield
    report = outcome.get_result()
    handle = item.funcargs.get("operator") if hasattr(item, "funcargs") else None
    if report.failed and isinstance(handle, OperatorProcess):
        report.sections.append(("operator log", handle.log_tail(120)))
