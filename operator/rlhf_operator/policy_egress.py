"""The job policy's rule on egress: every destination a job's spec names is one the installation
approved (`network.NetworkSettings`: the chart's `networkPolicy.approvedEgress` and
`extraEgress`), or the job is refused, naming the field.

Without it a job's spec would open its own egress: its NetworkPolicy opens only approved
entries, so an unapproved destination would fail later, unexplained, inside the trainer. The
operator alone checks it, at every reconcile like the rest of the policy (before the job's first
cluster: Failed, `InvalidSpec`). The admission policy does not: matching a URL against the
installation's address blocks and host patterns is not written in CEL, so such a job is
accepted at apply and fails at its first reconcile.
"""

from __future__ import annotations

import ipaddress

from rlhf_operator.network import NetworkSettings, forbidden, job_destinations
from rlhfjob.api import RLHFJob

SETTING = "networkPolicy.approvedEgress"


def problems(job: RLHFJob, network: NetworkSettings) -> list[str]:
    """Each destination of the job that no approved entry covers, naming its field."""
    approved = ", ".join(entry.name for entry in network.approved_egress) or "none"
    found = []
    for destination in job_destinations(job):
        if network.opens(destination):
            continue
        address = destination.address
        if destination.port is None:
            why = "names no host and port the operator can read"
        elif address is not None and (inside := forbidden(ipaddress.ip_network(address))):
            why = f"lies inside {inside}, which no job may reach"
        else:
            why = "is not an approved egress destination"
        found.append(
            f"{destination.field}: {destination.describe()} {why} "
            f"(approved: {approved}; the chart's {SETTING})"
        )
    return found
