"""Where a job's Ray pods may connect, as NetworkPolicy peers (`builder.build_network_policies`).

NetworkPolicy matches addresses, not names, so a destination is opened as narrowly as it is
known: an IP literal opens that address alone; a hostname (a bucket endpoint, a reward server)
opens its port to every address, and to every namespace's pods (an in-cluster Service), but
never the cloud metadata address, which every address block here excepts. A cluster whose CNI
has FQDN policies (Cilium's, Calico's) can narrow a hostname further with a policy of its own.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from rlhfjob.api import RLHFJob

METADATA_ADDRESSES = (
    ipaddress.ip_address("169.254.169.254"),  # AWS, GCP, Azure, OpenStack and most clouds
    ipaddress.ip_address("fd00:ec2::254"),  # AWS's IPv6 instance metadata
)
"""The cloud instance metadata service: a pod that reaches it gets the node's identity."""
EVERYWHERE = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
API_SERVER_PORTS = (443, 6443)
"""The API server's Service port and its endpoints' usual port: policies see the address
after the Service's translation, so both."""
DNS_PODS = {"k8s-app": "kube-dns"}
"""The label of the cluster DNS pods (CoreDNS and kube-dns both carry it)."""
AWS_S3_PORT = 443

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class EgressSettingError(ValueError):
    """An installation's egress setting that cannot be read (the operator refuses to start)."""


@dataclass(frozen=True)
class Destination:
    """Addresses (None: every address but the metadata one, and every namespace's pods) and
    the TCP ports open on them (empty: every port)."""

    networks: tuple[Network, ...] | None
    ports: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Destination:
        """`CIDR` or `CIDR:PORT[,PORT...]`, as the chart's `networkPolicy.extraEgress` gives it
        (`10.0.0.0/8`, `10.1.2.3/32:443`, `fd00::/8:443,8443`)."""
        cidr, _, ports = text.partition("/")
        prefix, _, port_list = ports.partition(":")
        try:
            network = ipaddress.ip_network(f"{cidr}/{prefix}", strict=False)
            numbers = tuple(int(p) for p in port_list.split(",")) if port_list else ()
        except ValueError as error:
            raise EgressSettingError(f"egress destination {text!r}: {error}") from None
        if not prefix or any(not 0 < p < 65536 for p in numbers):
            raise EgressSettingError(f"egress destination {text!r}: want CIDR[:PORT[,PORT]]")
        return cls((network,), numbers)


@dataclass(frozen=True)
class NetworkSettings:
    """What the installation says of its network (the chart's `networkPolicy` values)."""

    operator_namespace: str | None = None
    """The operator's namespace: only its pods may call a head's dashboard (None: a
    development operator, matched by label in any namespace)."""
    prometheus_namespaces: tuple[str, ...] = ()
    """Namespaces whose pods may scrape the metrics ports (empty: none outside the job)."""
    api_server: tuple[Destination, ...] = ()
    """The API server's addresses, for the head's heartbeat Lease (empty: any address but the
    metadata one, on `API_SERVER_PORTS`)."""
    extra_egress: tuple[Destination, ...] = field(default=())
    """Destinations every job may reach besides its own (a model hub's mirror, an experiment
    tracker), on top of what its spec declares."""


def url_destination(url: str, default_port: int | None = None) -> Destination:
    """Where an http(s) URL of a job's spec connects: its address if it is an IP literal,
    otherwise any address; on its port (the scheme's when it names none)."""
    parts = urlsplit(url)
    port = parts.port or default_port or (443 if parts.scheme == "https" else 80)
    try:
        address = ipaddress.ip_address(parts.hostname or "")
    except ValueError:
        return Destination(None, (port,))
    return Destination((ipaddress.ip_network(address),), (port,))


def job_destinations(job: RLHFJob) -> list[Destination]:
    """What a job's spec says its pods call outside the job: the checkpoint bucket's endpoint
    (AWS's when none is named), each remote reward server, and the experiment trackers."""
    found: list[Destination] = []
    bucket = job.spec.checkpoint.object_store
    if bucket is not None:
        found.append(
            url_destination(bucket.endpoint)
            if bucket.endpoint
            else Destination(None, (AWS_S3_PORT,))
        )
    for _, source, _ in job.spec.reward.sources():
        if source.type == "remote" and source.remote is not None:
            found.append(url_destination(source.remote.url))
    tracking = job.spec.tracking
    if tracking.mlflow is not None:
        found.append(url_destination(tracking.mlflow.tracking_uri))
    if tracking.wandb is not None and tracking.wandb.api_key_secret is not None:
        found.append(url_destination(tracking.wandb.base_url))  # offline without a key
    return found


def address_blocks(networks: tuple[Network, ...] | None) -> list[dict[str, Any]]:
    """NetworkPolicy `ipBlock` peers for `networks` (None: every address), each with the
    metadata addresses it covers excepted; a block of nothing but one is left out."""
    peers = []
    for network in networks or EVERYWHERE:
        covered = [address for address in METADATA_ADDRESSES if address in network]
        if covered and network.num_addresses == 1:
            continue
        block: dict[str, Any] = {"cidr": str(network)}
        if covered:
            block["except"] = [f"{address}/{address.max_prefixlen}" for address in covered]
        peers.append({"ipBlock": block})
    return peers


def egress_rule(destination: Destination, *, services: bool = True) -> dict[str, Any] | None:
    """One egress rule for `destination` (None when nothing but the metadata address is in
    it). `services`: a destination of any address also opens its ports to every namespace's
    pods, as an in-cluster Service's name resolves to them."""
    peers = address_blocks(destination.networks)
    if destination.networks is None and services:
        peers.append({"namespaceSelector": {}})  # an in-cluster Service's pods
    if not peers:
        return None
    rule: dict[str, Any] = {"to": peers}
    if destination.ports:
        rule["ports"] = [{"protocol": "TCP", "port": port} for port in destination.ports]
    return rule
