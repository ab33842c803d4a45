"""NetworkPolicy enforced on real packets between pods of the local cluster (issue 24).

KWOK's pods are fake and no CNI runs, so nothing here enforces the NetworkPolicies the operator
writes; `rlhf_local.netpol` asks cyclonus what they allow. Here a refused connection is a
dropped packet:

* `pod_netns` gives a pod a network namespace that carries its podIP: a veth pair whose host
  end is routed /32, as a routed CNI (kindnet, Calico) wires a pod, so traffic between pods
  crosses the host's forward path. `address_netns` does the same for an address outside the
  cluster (the cloud metadata address, a bucket), routed for the pods' traffic only, so the
  host's own route to it is untouched. `listening` serves TCP in one; `connects` dials from one.
* `running` runs kube-network-policies (SIG Network's enforcer, `build.Binaries.enforcer`), a
  host process as its DaemonSet would be: its daemon looks up the source and destination pods
  by IP through the API server and evaluates the NetworkPolicies (egress of the source, ingress
  of the destination) on the first packet of each connection handed to it over NFQUEUE; the
  kernel drops or passes the packet on its verdict.

The enforcer hands itself packets with nftables' `queue` statement, which some kernels lack
(this machine's: `CONFIG_NFT_QUEUE` unset, no modules); its own table then fails to load (it
logs that and carries on), and whatever loads is left empty by `--hostname-override` naming no
node. The hook is this module's instead: a table whose forward chain sends each new connection
that enters from one of these namespaces to the daemon's queue through the xtables NFQUEUE
target (nft_compat, which every kernel with iptables has). So every connection between them is
judged, whichever fake node the pods are on (the enforcer's own rules take only its node's
pods), and the verdict is still the enforcer's. The table belongs to the netlink socket that
made it: the kernel drops it when this process ends, however it ends.

Needs root, `ip` (iproute2) and `unshare` (util-linux). The enforcer reads its credentials only
from the in-cluster paths; they are mounted in a mount namespace of its own, never on the host.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_local import cluster
from rlhf_local.paths import local_dir, read_ports

NAME = "kube-network-policies"
"""Its ServiceAccount, ClusterRole(Binding), log and credentials directory, and its own table."""
POD_CIDR = "10.244.0.0/16"
"""Where KWOK takes podIPs from (its `--cidr`, `cluster._argv`)."""
QUEUE = 4224
"""The NFQUEUE the enforcer reads (its `--nfqueue-id`)."""
PREFIX = "rlhfnp"
"""Every network namespace and host veth here: `<prefix><pid in hex>-<n>` (the owner's pid)."""
ROUTE_TABLE = 4224
"""The routing table of the addresses outside the cluster (looked up for the pods' traffic)."""
GATEWAY = "169.254.1.1"
"""Each namespace's next hop: its host veth, by a permanent neighbour entry (no ARP proxy)."""
NETNS_DIR = Path("/run/netns")
SA_DIR = "secrets/kubernetes.io/serviceaccount"
"""Where client-go's in-cluster config reads the token and CA, under /var/run."""


# -- nftables over netlink: the queue hook, and a look at what tables exist ----------------

NFNL_SUBSYS_NFTABLES = 10
BATCH_BEGIN, BATCH_END, NLMSG_ERROR, NLMSG_DONE = 16, 17, 2, 3
NEWTABLE, GETTABLE, DELTABLE, NEWCHAIN, NEWRULE = 0, 1, 2, 3, 6
REQUEST, ACK, EXCL, CREATE, APPEND, DUMP = 0x1, 0x4, 0x200, 0x400, 0x800, 0x300
NESTED = 0x8000
FAMILY_IP, FAMILY_INET = 2, 1
TABLE_OWNER = 0x2
"""NFT_TABLE_F_OWNER: the table goes when the socket that made it closes."""
FORWARD_HOOK, META_IIFNAME, CT_STATE, CT_NEW, CMP_EQ, CMP_NEQ = 2, 6, 0, 8, 0, 1


def _attr(kind: int, payload: bytes | str) -> bytes:
    data = payload.encode() + b"\0" if isinstance(payload, str) else payload
    return struct.pack("=HH", 4 + len(data), kind) + data + b"\0" * (-len(data) % 4)


def _nest(kind: int, *attrs: bytes) -> bytes:
    return _attr(kind | NESTED, b"".join(attrs))


def _u32(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack("!I", value))


def _expr(name: str, *attrs: bytes) -> bytes:
    return _nest(1, _attr(1, name), _nest(2, *attrs))


def _message(kind: int, flags: int, family: int, seq: int, body: bytes, res_id: int = 0) -> bytes:
    payload = struct.pack("=BBH", family, 0, socket.htons(res_id)) + body
    return struct.pack("=IHHII", 16 + len(payload), kind, flags, seq, 0) + payload


def _replies(sock: socket.socket, until: int) -> Iterator[tuple[int, int, bytes]]:
    """(type, seq, payload) of each reply, until `until` acks/errors or a dump's end."""
    while until:
        data = sock.recv(1 << 16)
        offset = 0
        while offset < len(data):
            length, kind, _, seq, _ = struct.unpack_from("=IHHII", data, offset)
            yield kind, seq, data[offset + 16 : offset + length]
            until -= kind in (NLMSG_ERROR, NLMSG_DONE)
            offset += (length + 3) & ~3


def _batch(
    sock: socket.socket, *messages: tuple[int, int, int, bytes], missing_ok: bool = False
) -> None:
    """Send nftables messages (type, flags, family, attributes) as one atomic batch."""
    seq = int(time.monotonic() * 1000) & 0xFFFFFF
    wire = [_message(BATCH_BEGIN, REQUEST, 0, seq, b"", NFNL_SUBSYS_NFTABLES)]
    for index, (kind, flags, family, body) in enumerate(messages, 1):
        wire.append(_message(NFNL_SUBSYS_NFTABLES << 8 | kind, REQUEST | ACK | flags, family,
                             seq + index, body))  # fmt: skip
    wire.append(_message(BATCH_END, REQUEST, 0, seq + len(messages) + 1, b"", NFNL_SUBSYS_NFTABLES))
    sock.send(b"".join(wire))
    for kind, reply_seq, payload in _replies(sock, len(messages)):
        code = -struct.unpack_from("=i", payload)[0] if kind == NLMSG_ERROR else 0
        if code and not (missing_ok and code == 2):  # ENOENT
            raise OSError(code, f"nftables message {reply_seq - seq}: {os.strerror(code)}")


def _netfilter_socket() -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
    sock.bind((0, 0))
    sock.settimeout(10)  # a reply that never comes fails instead of hanging the test
    return sock


def nft_tables() -> set[tuple[int, str]]:
    """(family, name) of every nftables table in this network namespace."""
    found = set()
    with _netfilter_socket() as sock:
        sock.send(_message(NFNL_SUBSYS_NFTABLES << 8 | GETTABLE, REQUEST | DUMP, 0, 1, b""))
        for kind, _, payload in _replies(sock, 1):
            offset = 4  # past nfgenmsg
            while kind != NLMSG_DONE and offset + 4 <= len(payload):
                length, attr = struct.unpack_from("=HH", payload, offset)
                if attr == 1:  # NFTA_TABLE_NAME
                    found.add((payload[0], payload[offset + 4 : offset + length - 1].decode()))
                offset += (length + 3) & ~3
    return found


def delete_table(family: int, name: str) -> None:
    """Delete an nftables table if it exists."""
    with _netfilter_socket() as sock:
        _batch(sock, (DELTABLE, 0, family, _attr(1, name)), missing_ok=True)


@contextlib.contextmanager
def _queue_hook(table: str, queue: int) -> Iterator[None]:
    """Table `table` (ip): in its forward chain, `iifname "<PREFIX>*" ct state new` goes to
    NFQUEUE `queue` (xt NFQUEUE v3: one queue, no bypass, so no verdict means a drop)."""
    queue_info = struct.pack("=HHH", queue, 1, 0) + b"\0\0"  # xt_NFQ_info_v3, 8-byte aligned
    reg = 1
    rule = _nest(4,
        _expr("meta", _u32(2, META_IIFNAME), _u32(1, reg)),
        _expr("cmp", _u32(1, reg), _u32(2, CMP_EQ), _nest(3, _attr(1, PREFIX.encode()))),
        _expr("ct", _u32(2, CT_STATE), _u32(1, reg)),
        _expr("bitwise", _u32(1, reg), _u32(2, reg), _u32(3, 4),
              _nest(4, _attr(1, struct.pack("=I", CT_NEW))), _nest(5, _attr(1, bytes(4)))),
        _expr("cmp", _u32(1, reg), _u32(2, CMP_NEQ), _nest(3, _attr(1, bytes(4)))),
        _expr("target", _attr(1, "NFQUEUE"), _u32(2, 3), _attr(3, queue_info)),
    )  # fmt: skip
    hook = _nest(4, _u32(1, FORWARD_HOOK), _u32(2, 0))
    chain = _attr(1, table) + _attr(3, "forward") + hook + _u32(5, 1) + _attr(7, "filter")
    with _netfilter_socket() as sock:
        _batch(sock,
            (NEWTABLE, CREATE | EXCL, FAMILY_IP, _attr(1, table) + _u32(2, TABLE_OWNER)),
            (NEWCHAIN, CREATE, FAMILY_IP, chain),
            (NEWRULE, CREATE | APPEND, FAMILY_IP, _attr(1, table) + _attr(2, "forward") + rule),
        )  # fmt: skip
        try:
            yield
        finally:
            _batch(sock, (DELTABLE, 0, FAMILY_IP, _attr(1, table)), missing_ok=True)


# -- network namespaces -------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """A network namespace holding one address; its host veth has the same name."""

    name: str
    ip: str


_names = itertools.count()


def _die_with_parent() -> None:
    """In a child before exec: SIGKILL it when this process dies (PR_SET_PDEATHSIG), so a
    crashed test leaves no server or enforcer behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def _ip(*args: str, check: bool = True) -> str:
    run = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and run.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {run.stderr.strip()}")
    return run.stdout


def _owner_alive(name: str) -> bool:
    try:
        os.kill(int(name.removeprefix(PREFIX).split("-")[0], 16), 0)
    except (ValueError, ProcessLookupError):
        return False
    return True


def _remove(name: str) -> None:
    """Kill what runs in namespace `name` and delete it and its host veth (the routes through
    the veth go with it)."""
    for pid in _ip("netns", "pids", name, check=False).split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("link", "del", name, check=False)
    _ip("netns", "del", name, check=False)


def _sweep() -> None:
    """Remove the namespaces of test processes that died without cleaning up, and, when no
    namespace of this module is left, the routing rules that led to them."""
    ours = sorted(p.name for p in NETNS_DIR.glob(f"{PREFIX}*")) if NETNS_DIR.is_dir() else []
    for name in ours:
        if not _owner_alive(name):
            _remove(name)
    if not any(NETNS_DIR.glob(f"{PREFIX}*")):
        rules = _ip("rule", "show").splitlines()
        for _ in range(sum(line.endswith(f"lookup {ROUTE_TABLE}") for line in rules)):
            _ip("rule", "del", "table", str(ROUTE_TABLE))


@contextlib.contextmanager
def _netns(ip: str) -> Iterator[Endpoint]:
    """A namespace with `ip` on its eth0, default route to its host veth (forwarding on)."""
    _sweep()
    name = f"{PREFIX}{os.getpid():x}-{next(_names)}"
    assert len(name) <= 15, name  # IFNAMSIZ
    _ip("netns", "add", name)
    try:
        _ip("link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", name)
        Path(f"/proc/sys/net/ipv4/conf/{name}/forwarding").write_text("1")
        _ip("link", "set", name, "up")
        mac = Path(f"/sys/class/net/{name}/address").read_text().strip()
        inside = ("-n", name)
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "addr", "add", f"{ip}/32", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        _ip(*inside, "neigh", "add", GATEWAY, "lladdr", mac, "dev", "eth0", "nud", "permanent")
        _ip(*inside, "route", "add", GATEWAY, "dev", "eth0", "scope", "link")
        _ip(*inside, "route", "add", "default", "via", GATEWAY, "dev", "eth0")
        yield Endpoint(name, ip)
    finally:
        _remove(name)


@contextlib.contextmanager
def pod_netns(pod: Any) -> Iterator[Endpoint]:
    """A network namespace carrying the podIP of `pod` (a V1Pod KWOK runs), routed from the
    host like a pod of a routed CNI; removed on exit."""
    ip = pod.status.pod_ip
    if not ip:
        raise ValueError(f"pod {pod.metadata.namespace}/{pod.metadata.name} has no podIP yet")
    with _netns(ip) as endpoint:
        _ip("route", "add", f"{ip}/32", "dev", endpoint.name)
        yield endpoint


@contextlib.contextmanager
def address_netns(ip: str) -> Iterator[Endpoint]:
    """A network namespace carrying `ip`, an address outside the cluster, reached only by
    traffic from podIPs (a routing rule), so the host's own route to it stays as it was."""
    rule = ("from", POD_CIDR, "to", f"{ip}/32", "lookup", str(ROUTE_TABLE))
    with _netns(ip) as endpoint:
        _ip("route", "add", f"{ip}/32", "dev", endpoint.name, "table", str(ROUTE_TABLE))
        _ip("rule", "add", *rule, "priority", str(ROUTE_TABLE))
        try:
            yield endpoint
        finally:
            _ip("rule", "del", *rule, "priority", str(ROUTE_TABLE), check=False)


SERVER = """
import selectors, socket, sys
selector = selectors.DefaultSelector()
for port in sys.argv[1:]:
    selector.register(socket.create_server(("0.0.0.0", int(port)), backlog=64),
                      selectors.EVENT_READ)
print("listening", flush=True)
while True:
    for key, _ in selector.select():
        key.fileobj.accept()[0].close()
"""

CLIENT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
except TimeoutError:
    sys.exit(3)
"""
TIMED_OUT = 3


def _in_netns(endpoint: Endpoint, code: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", endpoint.name, sys.executable, "-I", "-c", code, *args]


@contextlib.contextmanager
def listening(endpoint: Endpoint, ports: Iterable[int], timeout: float = 30.0) -> Iterator[None]:
    """A TCP server in `endpoint`'s namespace that accepts (and closes) connections on `ports`."""
    process = subprocess.Popen(
        _in_netns(endpoint, SERVER, *map(str, ports)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_die_with_parent,
    )  # fmt: skip
    try:
        assert process.stdout is not None and process.stderr is not None
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        if not ready or process.stdout.readline() != b"listening\n":
            process.kill()
            raise RuntimeError(f"no server in {endpoint}: {process.stderr.read().decode()}")
        yield
    finally:
        process.kill()
        process.wait()


def connects(source: Endpoint, ip: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection from `source`'s namespace to `ip`:`port` opens within
    `timeout` seconds. False only when it timed out (a dropped SYN); any other failure (refused:
    nothing listens; unreachable) raises, so a broken wiring never passes for a blocked one."""
    run = subprocess.run(
        _in_netns(source, CLIENT, ip, str(port), str(timeout)),
        capture_output=True, text=True, timeout=timeout + 60, check=False,
    )  # fmt: skip
    if run.returncode not in (0, TIMED_OUT):
        raise RuntimeError(f"{source.name} ({source.ip}) -> {ip}:{port}: {run.stderr.strip()}")
    return run.returncode == 0


# -- the enforcer -------------------------------------------------------------------------

RBAC = [
    {"apiVersion": "v1", "kind": "ServiceAccount",
     "metadata": {"name": NAME, "namespace": "kube-system"}},
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
     "metadata": {"name": NAME},
     "rules": [{"apiGroups": [""], "resources": ["pods", "namespaces"], "verbs": ["list", "watch"]},
               {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
                "verbs": ["list", "watch"]}]},
    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
     "metadata": {"name": NAME},
     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
     "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": "kube-system"}]},
]  # fmt: skip
"""Upstream's RBAC (its install.yaml): it reads pods, namespaces and NetworkPolicies."""

LAUNCH = """set -eu
mount -t tmpfs -o mode=0755 kube-network-policies "$1"
mkdir -p "$1/$2" && cp "$3/token" "$3/ca.crt" "$1/$2/"
shift 3 && exec "$@"
"""
"""Run in a private mount namespace: the in-cluster credentials on a tmpfs over /var/run."""


def queue_bound(queue: int = QUEUE) -> bool:
    """Whether a process reads NFQUEUE `queue` (the enforcer binds it once its caches synced)."""
    table = Path("/proc/net/netfilter/nfnetlink_queue")
    return any(line.split()[:1] == [str(queue)] for line in table.read_text().splitlines())


@dataclass(frozen=True)
class Enforcer:
    """The running enforcer: its log shows one verdict per connection, with both pods."""

    pid: int
    log: Path

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return f"--- {self.log} (last {lines} lines) ---\n" + "\n".join(text[-lines:])


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGINT (its only clean exit: it closes the queue, then deletes its table), then SIGKILL
    once the queue is closed: it would otherwise sleep 5 s before exiting."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 15
        while process.poll() is None and queue_bound() and time.monotonic() < deadline:
            time.sleep(0.05)
        process.kill()
    process.wait()


@contextlib.contextmanager
def running(timeout: float = 60.0) -> Iterator[Enforcer]:
    """kube-network-policies judging every new connection between this module's namespaces,
    against the running local cluster; on exit it is stopped, its RBAC and credentials removed
    and no nftables table of it or of this module is left."""
    if queue_bound():
        raise RuntimeError(f"NFQUEUE {QUEUE} is taken: is another enforcer running?")
    lay = cluster.Layout(local_dir())
    credentials = lay.root / NAME
    cluster.kubectl("apply", "--server-side", f"--field-manager={cluster.FIELD_MANAGER}",
                    "-f", "-", stdin="\n".join(json.dumps(o) for o in RBAC))  # fmt: skip
    process: subprocess.Popen[bytes] | None = None
    try:
        credentials.mkdir(mode=0o700, exist_ok=True)
        token = cluster.kubectl("create", "token", NAME, "-n", "kube-system").strip()
        (credentials / "token").write_text(token)
        shutil.copyfile(lay.pki / "ca.crt", credentials / "ca.crt")
        flags = [
            "--hostname-override=rlhf-local-no-node",  # its own rules take no pod (see above)
            f"--nfqueue-id={QUEUE}",
            "--metrics-bind-address=127.0.0.1:0",
            "--v=2",  # one line per verdict, with both pods' names
        ]
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(read_ports(lay.root)["kube-apiserver"]),
        }
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", LAUNCH, "sh",
                os.path.realpath("/var/run"), SA_DIR, str(credentials),
                str(cluster.binaries().enforcer), *flags]  # fmt: skip
        log = lay.log(NAME)
        with log.open("ab") as out:
            started = " ".join([str(cluster.binaries().enforcer), *flags])
            out.write(f"\n==== {time.strftime('%H:%M:%S')} start {started}\n".encode())
            out.flush()
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                       stderr=subprocess.STDOUT, env=env,
                                       preexec_fn=_die_with_parent)  # fmt: skip
        enforcer = Enforcer(process.pid, log)
        deadline = time.monotonic() + timeout
        while not queue_bound():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{NAME} did not start reading its queue\n{enforcer.log_tail()}")
            time.sleep(0.05)
        with _queue_hook(f"rlhf-local-{NAME}", QUEUE):
            yield enforcer
    finally:
        if process is not None:
            _stop(process)
        delete_table(FAMILY_INET, NAME)  # its own, had it loaded and not removed it
        shutil.rmtree(credentials, ignore_errors=True)
        cluster.kubectl("delete", "--ignore-not-found", "-f", "-", check=False,
                        stdin="\n".join(json.dumps(o) for o in RBAC))  # fmt: skip
