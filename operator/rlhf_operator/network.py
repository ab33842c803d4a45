"""Where a job's Ray pods may connect, as NetworkPolicy peers (`builder.build_network_policies`).

A job's spec names the places its pods call (the bucket's endpoint, remote reward servers,
trackers: `job_destinations`), but the installation decides what may be opened: the chart's
`networkPolicy.approvedEgress` lists named entries (`ApprovedEgress`), each address blocks
(`CIDR[:PORT,...]`) or pods by namespace and pod selector on listed ports, with the host names
that select it. A job opens only the entries its destinations match, and the job policy
(`policy_egress`) refuses a job naming a destination none covers:

* an IP literal must fall inside an approved block, on one of its ports; it opens that address
  alone, on that port;
* a hostname matches an entry whose `hosts` name it (`name`, or `*.suffix` for any name below
  `suffix`), or an entry that lists no hosts; either way on one of the entry's ports, and it
  opens that entry's blocks or selector on that port only. NetworkPolicy matches addresses, not
  names, so a name can open no more than an entry approved: never `0.0.0.0/0` or every
  namespace unless an entry says so itself;
* a bucket without an endpoint is AWS S3: the name `s3.<region>.amazonaws.com`, port 443, so
  it too needs an entry (AWS's S3 ranges, a VPC endpoint's, or `0.0.0.0/0:443` named
  `*.amazonaws.com`, as the installation chooses).

`networkPolicy.extraEgress` is opened to every job whatever its spec says, and covers the
destinations in it. The head alone reaches the API server, at `api_server` only (the chart
requires the range or derives it at install). Every address block excepts `NO_EGRESS` (the
link-local ranges and the clouds' metadata addresses, where a pod gets the node's identity),
and the installation's own blocks may not lie inside them.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from rlhfjob.api import RLHFJob

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

NO_EGRESS: tuple[tuple[str, str], ...] = (
    ("169.254.0.0/16", "IPv4 link-local"),
    ("169.254.169.254/32", "instance metadata: AWS, GCP, Azure, OpenStack, Oracle, DigitalOcean"),
    ("169.254.170.2/32", "AWS ECS task and EKS credentials"),
    ("169.254.170.23/32", "EKS Pod Identity Agent"),
    ("169.254.169.252/32", "GKE metadata server"),
    ("168.63.129.16/32", "Azure WireServer"),
    ("100.100.100.200/32", "Alibaba Cloud metadata"),
    ("fe80::/10", "IPv6 link-local"),
    ("fd00:ec2::254/128", "AWS instance metadata (IPv6)"),
    ("fd00:ec2::23/128", "EKS Pod Identity Agent (IPv6)"),
    ("fd20:ce::254/128", "GCP metadata (IPv6)"),
    ("fd00:42::42/128", "Scaleway metadata (IPv6)"),
)
"""What no job's pod may reach, whatever the installation approves: a pod that reaches a cloud's
metadata service gets the node's identity. The one list: every address block excepts it."""
DNS_PODS = {"k8s-app": "kube-dns"}
"""The label of the cluster DNS pods (CoreDNS and kube-dns both carry it)."""
BUCKET = "spec.checkpoint.objectStore.endpoint"
_HOST_PATTERN = re.compile(r"^(\*\.)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ENTRY_KEYS = {"name", "cidrs", "namespaceSelector", "podSelector", "ports", "hosts"}


def _inside(inner: Network, outer: Network) -> bool:
    return inner.version == outer.version and inner.subnet_of(outer)  # type: ignore[arg-type]


_FORBIDDEN = tuple(ipaddress.ip_network(cidr) for cidr, _ in NO_EGRESS)
EXCEPTED: tuple[Network, ...] = tuple(
    n for n in _FORBIDDEN if not any(o != n and _inside(n, o) for o in _FORBIDDEN)
)
"""`NO_EGRESS` without the ranges another one holds: what each address block excepts."""


def forbidden(network: Network) -> str | None:
    """The narrowest `NO_EGRESS` range that holds `network`, named (None: none holds it)."""
    holding = [
        (range_.prefixlen, f"{cidr} ({what})")
        for (cidr, what), range_ in zip(NO_EGRESS, _FORBIDDEN, strict=True)
        if _inside(network, range_)
    ]
    return max(holding)[1] if holding else None


class EgressSettingError(ValueError):
    """An installation's egress setting that cannot be read (the operator refuses to start)."""


def _port(value: Any, text: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise EgressSettingError(f"{text}: port {value!r} is not 1-65535")
    return value


@dataclass(frozen=True)
class Destination:
    """Address blocks and the TCP ports open on them (empty: every port)."""

    networks: tuple[Network, ...]
    ports: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Destination:
        """`CIDR` or `CIDR:PORT[,PORT...]`, as the chart's values give it (`10.0.0.0/8`,
        `10.1.2.3/32:443`, `fd00::/8:443,8443`); a block inside `NO_EGRESS` is refused."""
        cidr, _, ports = text.partition("/")
        prefix, _, port_list = ports.partition(":")
        try:
            network = ipaddress.ip_network(f"{cidr}/{prefix}", strict=False)
            numbers = tuple(int(p) for p in port_list.split(",")) if port_list else ()
        except ValueError as error:
            raise EgressSettingError(f"egress destination {text!r}: {error}") from None
        if not prefix or any(not 0 < p < 65536 for p in numbers):
            raise EgressSettingError(f"egress destination {text!r}: want CIDR[:PORT[,PORT]]")
        if (inside := forbidden(network)) is not None:
            raise EgressSettingError(
                f"egress destination {text!r} lies inside {inside}, which no job may reach"
            )
        return cls((network,), numbers)


@dataclass(frozen=True)
class JobDestination:
    """One place a job's spec says its pods call: the field naming it, the URL, its host (and
    the address, when the host is an IP literal) and TCP port (None: unreadable)."""

    field: str
    url: str
    host: str
    port: int | None
    address: Address | None = None
    shown: str = ""
    """How a refusal quotes it (default: the URL)."""

    def describe(self) -> str:
        return self.shown or repr(self.url)


def _address(host: str) -> Address | None:
    """The address an IP-literal host names, in any spelling a resolver takes (`2852039166`,
    `0xa9.254.169.254`, `::ffff:169.254.169.254` are 169.254.169.254), else None."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def url_destination(field_: str, url: str, shown: str = "") -> JobDestination:
    """Where an http(s) URL of a job's spec connects: its host on its port (the scheme's when
    it names none; None when it names one out of range or has no host)."""
    parts = urlsplit(url)
    host = (parts.hostname or "").rstrip(".").lower()
    try:
        given = parts.port
    except ValueError:  # out of range
        given = 0
    port = (443 if parts.scheme == "https" else 80) if given is None else given
    return JobDestination(field_, url, host, port if host and port else None, _address(host), shown)


def job_destinations(job: RLHFJob) -> list[JobDestination]:
    """What a job's spec says its pods call outside the job: the checkpoint bucket's endpoint
    (AWS S3 when none is named), each remote reward server, and the experiment trackers."""
    found: list[JobDestination] = []
    spec = job.spec
    bucket = spec.checkpoint.object_store
    if bucket is not None and bucket.endpoint:
        found.append(url_destination(BUCKET, bucket.endpoint))
    elif bucket is not None:
        aws = f"https://s3.{bucket.region}.amazonaws.com" if bucket.region else ""
        aws = aws or "https://s3.amazonaws.com"
        found.append(url_destination(BUCKET, aws, f"AWS S3 ({aws!r}: the endpoint is unset)"))
    reward = spec.reward
    if reward.type == "remote" and reward.remote is not None:
        found.append(url_destination("spec.reward.remote.url", reward.remote.url))
    for index, component in enumerate(reward.components):
        if component.type == "remote" and component.remote is not None:
            where = f"spec.reward.components[{index}].remote.url"
            found.append(url_destination(where, component.remote.url))
    tracking = spec.tracking
    if tracking.mlflow is not None:
        found.append(
            url_destination("spec.tracking.mlflow.trackingUri", tracking.mlflow.tracking_uri)
        )
    if tracking.wandb is not None and tracking.wandb.api_key_secret is not None:
        found.append(url_destination("spec.tracking.wandb.baseUrl", tracking.wandb.base_url))
    return found  # W&B without a key runs offline


def address_blocks(networks: tuple[Network, ...]) -> list[dict[str, Any]]:
    """NetworkPolicy `ipBlock` peers for `networks`, each excepting the `NO_EGRESS` ranges
    inside it; a block wholly inside one is left out."""
    peers = []
    for network in networks:
        if forbidden(network) is not None:
            continue
        block: dict[str, Any] = {"cidr": str(network)}
        if inside := [str(r) for r in EXCEPTED if _inside(r, network)]:
            block["except"] = inside
        peers.append({"ipBlock": block})
    return peers


def _rule(peers: list[dict[str, Any]], ports: tuple[int, ...]) -> dict[str, Any]:
    rule: dict[str, Any] = {"to": peers}
    if ports:
        rule["ports"] = [{"protocol": "TCP", "port": port} for port in ports]
    return rule


def _on(ports: tuple[int, ...], port: int) -> bool:
    return not ports or port in ports


def _host_matches(pattern: str, host: str) -> bool:
    if pattern.startswith("*."):
        return host.endswith(pattern[1:]) and len(host) > len(pattern) - 1
    return host == pattern


@dataclass(frozen=True)
class ApprovedEgress:
    """A destination the installation lets a job open by naming it in its spec (one entry of
    the chart's `networkPolicy.approvedEgress`): address blocks, or the pods a selector picks
    (`peer`, on `ports`); `hosts` are the names that select it (empty: any name, by port)."""

    name: str
    blocks: tuple[Destination, ...] = ()
    peer: dict[str, Any] | None = field(default=None, hash=False)
    ports: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> ApprovedEgress:
        """One entry as JSON (the chart renders each as `--approved-egress=<JSON>`)."""
        try:
            entry = json.loads(text)
        except ValueError as error:
            raise EgressSettingError(f"approved egress {text!r}: {error}") from None
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not _NAME_PATTERN.match(name):
            raise EgressSettingError(f"approved egress {text!r}: want an object with a name")
        where = f"approved egress {name!r}"
        if unknown := sorted(set(entry) - _ENTRY_KEYS):
            raise EgressSettingError(f"{where}: unknown keys {', '.join(unknown)}")
        hosts = tuple(entry.get("hosts") or ())
        if bad := [h for h in hosts if not isinstance(h, str) or not _HOST_PATTERN.match(h)]:
            raise EgressSettingError(f"{where}: hosts {bad} are not names or *.suffix")
        cidrs = entry.get("cidrs") or []
        selector = {k: entry[k] for k in ("namespaceSelector", "podSelector") if k in entry}
        ports = tuple(_port(p, where) for p in entry.get("ports") or ())
        if bool(cidrs) == bool(selector):
            raise EgressSettingError(f"{where}: give cidrs or a namespace/pod selector, not both")
        if cidrs:
            if ports:
                raise EgressSettingError(f"{where}: cidrs carry their ports (CIDR:PORT,...)")
            blocks = tuple(Destination.parse(str(c)) for c in cidrs)
            return cls(name, blocks=blocks, hosts=hosts)
        if not ports or not all(isinstance(s, dict) for s in selector.values()):
            raise EgressSettingError(f"{where}: a selector needs label selectors and its ports")
        return cls(name, peer=copy.deepcopy(selector), ports=ports, hosts=hosts)

    def opens(self, destination: JobDestination) -> list[dict[str, Any]]:
        """The egress rules through which `destination` reaches this entry, on its port alone
        (empty: the entry does not cover it)."""
        port, address = destination.port, destination.address
        if port is None or (address is not None and forbidden(ipaddress.ip_network(address))):
            return []
        if address is not None:
            inside = any(
                address in network
                for block in self.blocks if _on(block.ports, port)
                for network in block.networks
            )  # fmt: skip
            return (
                [_rule(address_blocks((ipaddress.ip_network(address),)), (port,))] if inside else []
            )
        if self.hosts and not any(_host_matches(p, destination.host) for p in self.hosts):
            return []
        if self.peer is not None:
            return [_rule([copy.deepcopy(self.peer)], (port,))] if _on(self.ports, port) else []
        networks = tuple(n for b in self.blocks if _on(b.ports, port) for n in b.networks)
        peers = address_blocks(networks)
        return [_rule(peers, (port,))] if peers else []


@dataclass(frozen=True)
class NetworkSettings:
    """What the installation says of its network (the chart's `networkPolicy` values)."""

    operator_namespace: str | None = None
    """The operator's namespace: only its pods may call a head's dashboard (None: a
    development operator, matched by label in any namespace)."""
    prometheus_namespaces: tuple[str, ...] = ()
    """Namespaces whose pods may scrape the metrics ports (empty: none outside the job)."""
    api_server: tuple[Destination, ...] = ()
    """The API server's addresses, the only place the head may reach it for its heartbeat
    Lease (the chart requires or derives them; empty: nowhere)."""
    extra_egress: tuple[Destination, ...] = field(default=())
    """Destinations every job reaches whatever its spec says (a model hub's mirror)."""
    approved_egress: tuple[ApprovedEgress, ...] = ()
    """Destinations a job may open by naming them in its spec; nothing else opens."""

    def __post_init__(self) -> None:
        names = [entry.name for entry in self.approved_egress]
        if twice := sorted({name for name in names if names.count(name) > 1}):
            raise EgressSettingError(f"approved egress named twice: {', '.join(twice)}")

    def _entries(self) -> Iterator[ApprovedEgress]:
        yield from self.approved_egress
        for destination in self.extra_egress:
            yield ApprovedEgress("extraEgress", blocks=(destination,))

    def opens(self, destination: JobDestination) -> list[dict[str, Any]]:
        """The rules that open `destination` (empty: nothing the installation approved)."""
        return [rule for entry in self._entries() for rule in entry.opens(destination)]

    def egress_rules(self, job: RLHFJob) -> list[dict[str, Any]]:
        """The job's pods' egress besides each other and DNS: the extra destinations, and the
        approved entries each destination of its spec matches; each rule once."""
        rules = [_rule(address_blocks(d.networks), d.ports) for d in self.extra_egress]
        for destination in job_destinations(job):
            rules += self.opens(destination)
        unique: list[dict[str, Any]] = []
        for rule in rules:
            if rule["to"] and rule not in unique:
                unique.append(rule)
        return unique

    def api_server_rules(self) -> list[dict[str, Any]]:
        """The head's egress to the API server."""
        rules = [_rule(address_blocks(d.networks), d.ports) for d in self.api_server]
        return [rule for rule in rules if rule["to"]]
