"""One harness session for the demo and the benchmarks: the local cluster up, a namespace of
their own, and the operator running with the Helm chart's RBAC.

The e2e tests get the same from their fixtures (`rlhf_local.testing`, `e2e/tests/conftest.py`).
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client, config

from rlhf_local import cluster
from rlhf_local.harness import LocalCluster
from rlhf_local.operator_process import OperatorProcess, operator_kubeconfig


@dataclass(frozen=True)
class Session:
    lc: LocalCluster
    namespace: str
    operator: OperatorProcess
    workdir: Path
    """A fresh temporary directory for the session's files."""
    cluster_was_running: bool
    """Whether the cluster was up before: then whoever started it stops it."""


@contextmanager
def operator_session(
    prefix: str,
    *,
    operator_log: Path | None = None,
    keep_namespace: bool = False,
    say: Callable[[str], None] = lambda message: None,
) -> Iterator[Session]:
    """Start (or reuse) the cluster, make namespace ``<prefix>-<random>``, run the operator.

    On leaving, the operator stops and the namespace goes unless `keep_namespace`; the cluster
    stays up (stopping it is the caller's choice, see `Session.cluster_was_running`).
    """
    say("starting the local control plane (the first run builds it from Go modules)")
    was_running = cluster.is_running()
    kubeconfig = cluster.up()
    lc = LocalCluster(kubeconfig, config.new_client_from_config(config_file=str(kubeconfig)))
    namespace = f"{prefix}-{uuid.uuid4().hex[:6]}"
    lc.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    workdir = Path(tempfile.mkdtemp(prefix=f"rlhfjob-{prefix}-"))
    operator = OperatorProcess(
        kubeconfig=operator_kubeconfig(lc, workdir / "kubeconfig"),
        log_path=operator_log or workdir / "operator.log",
    )
    say("starting the operator (with the Helm chart's RBAC)")
    operator.start()
    try:
        yield Session(lc, namespace, operator, workdir, was_running)
    finally:
        operator.stop()
        if not keep_namespace:
            lc.core.delete_namespace(namespace)
