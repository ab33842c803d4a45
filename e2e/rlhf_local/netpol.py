"""Whether NetworkPolicies allow a connection, asked of cyclonus (`build.Binaries.cyclonus`).

The local cluster has no CNI, so nothing enforces a NetworkPolicy here; cyclonus implements
NetworkPolicy's semantics (pod and namespace selectors, ports, `ipBlock` with `except`) on its
own, independently of this project, and answers for each connection whether the policies allow
it. The e2e tier gives it the policies as the API server stored them.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NAMESPACE_NAME = "kubernetes.io/metadata.name"
ANSWER = re.compile(r"IS ALLOWED\?\s*\|\s*(TRUE|FALSE)")


@dataclass(frozen=True)
class Peer:
    """One end of a connection: a pod (in `namespace`, with `labels`; its namespace carries
    `namespace_labels` besides its name), or an address outside the cluster (`namespace`
    None)."""

    ip: str
    namespace: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    namespace_labels: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        if self.namespace is None:
            return {"IP": self.ip}
        internal = {
            "PodLabels": self.labels,
            "NamespaceLabels": {**self.namespace_labels, NAMESPACE_NAME: self.namespace},
            "Namespace": self.namespace,
        }
        return {"Internal": internal, "IP": self.ip}


@dataclass(frozen=True)
class Connection:
    source: Peer
    destination: Peer
    port: int
    protocol: str = "TCP"

    def to_json(self) -> dict[str, Any]:
        return {
            "Source": self.source.to_json(),
            "Destination": self.destination.to_json(),
            "Protocol": self.protocol,
            "ResolvedPort": self.port,
            "ResolvedPortName": "",
        }


def allowed(
    cyclonus: Path, policies: list[dict[str, Any]], connections: list[Connection]
) -> list[bool]:
    """For each connection, whether `policies` (NetworkPolicy objects) allow it."""
    with tempfile.TemporaryDirectory() as scratch:
        policy_dir = Path(scratch) / "policies"
        policy_dir.mkdir()
        for index, policy in enumerate(policies):
            (policy_dir / f"{index}.json").write_text(json.dumps(policy))
        traffic = Path(scratch) / "traffic.json"
        traffic.write_text(json.dumps([c.to_json() for c in connections]))
        run = subprocess.run(
            [str(cyclonus), "analyze", "--mode=query-traffic", f"--policy-path={policy_dir}",
             f"--traffic-path={traffic}"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
    answers = [answer == "TRUE" for answer in ANSWER.findall(run.stdout)]
    if len(answers) != len(connections):
        raise RuntimeError(f"cyclonus answered {len(answers)} of {len(connections)}:\n{run.stdout}")
    return answers
