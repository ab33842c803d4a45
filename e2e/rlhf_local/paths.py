"""Where the local cluster keeps things: binaries in a per-user cache, state in the repo.

``RLHF_CACHE_DIR`` (default ``~/.cache/rlhfjob``) holds compiled binaries keyed by version so
that a fresh clone reuses them. ``RLHF_LOCAL_DIR`` (default ``<repo>/.local/cluster``) holds a
running cluster's certificates, kubeconfigs, logs and pid files; it is gitignored. Its
``cluster.json`` is the one registry of the loopback ports every component listens on
(`load_ports`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import random
import socket
import sys
from collections.abc import Collection, Iterable
from pathlib import Path
from types import ModuleType

#: The e2e/ directory of the repository (this package lives in e2e/rlhf_local).
E2E_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = E2E_DIR.parent


def digest(*parts: str | bytes, length: int) -> str:
    """A short hex key of `parts` (each NUL-terminated, so ("ab", "c") != ("a", "bc")): the
    cache keys of built binaries and images."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()[:length]


def cache_dir() -> Path:
    """Root of the binary cache, shared by every clone on this machine."""
    env = os.environ.get("RLHF_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "rlhfjob"


def local_dir() -> Path:
    """State directory of the local cluster (certs, kubeconfig, logs, pids, etcd data)."""
    env = os.environ.get("RLHF_LOCAL_DIR")
    return Path(env).resolve() if env else REPO_ROOT / ".local" / "cluster"


def kubeconfig_path() -> Path:
    """Admin kubeconfig of the local cluster (client certificate in system:masters)."""
    return local_dir() / "kubeconfig"


def state_file(root: Path) -> Path:
    """``cluster.json`` of a state directory: the ports chosen at its first `up`."""
    return root / "cluster.json"


#: Linux's default ephemeral range, assumed where /proc does not give the one in force.
EPHEMERAL_DEFAULT = (32768, 60999)
#: The lowest port `free_listen_ports` draws: above the services most machines run and Ray's default
#: range for its workers' ports (10002-19999), which a local Ray beside the cluster draws from.
LISTEN_FLOOR = 20000


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections."""
    with contextlib.suppress(OSError, ValueError):
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    return EPHEMERAL_DEFAULT


def port_is_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:`port` now (as Go's servers bind, with
    SO_REUSEADDR: a closed server's connections in TIME_WAIT do not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_listen_ports(count: int, exclude: Collection[int] = ()) -> list[int]:
    """Distinct free loopback ports outside the kernel's ephemeral range, none in `exclude`.

    A port is probed free here and listened on later (the cluster's are kept for the life of a
    state dir; a Ray node binds its own seconds later; a driver binds the trainer's metrics port
    at every attempt). One the kernel may hand to an outgoing connection would sooner or later
    be taken in between ("Address already in use"; SeaweedFS, for one, then listens on the next
    port up instead of failing). Ports below the ephemeral range are only ever taken by another
    server."""
    low, high = ephemeral_range()
    pool = range(LISTEN_FLOOR, low) if low - LISTEN_FLOOR >= 1000 else range(high + 1, 65536)
    chosen: list[int] = []
    for port in random.SystemRandom().sample(pool, len(pool)):
        if port not in exclude and port_is_free(port):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"fewer than {count} free ports in {pool.start}-{pool.stop - 1}")


def read_ports(root: Path) -> dict[str, int]:
    """Every port recorded in `root`'s ``cluster.json`` (empty when there is none yet)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        data = json.loads(state_file(root).read_text())["ports"]
        return {k: int(v) for k, v in data.items()}
    return {}


def load_ports(root: Path, names: Iterable[str]) -> dict[str, int]:
    """The ports of `names`, chosen once per state dir and kept, so kubeconfigs, endpoints and
    credentials stay valid across restarts. A name not recorded yet (a new component) gets a
    free port that no recorded name uses; the others keep theirs. Returns every recorded port.
    The caller holds the state dir's lock (`procs.file_lock`)."""
    ports = read_ports(root)
    missing = [n for n in names if n not in ports]
    if not missing:
        return ports
    chosen = free_listen_ports(len(missing), exclude=set(ports.values()))
    ports.update(zip(missing, chosen, strict=True))
    root.mkdir(parents=True, exist_ok=True)
    state_file(root).write_text(json.dumps({"ports": ports}, indent=2) + "\n")
    return ports


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py` as a module (the benchmarks are scripts, not a package), for the
    tests that run a benchmark's properties or figures CI-sized."""
    path = REPO_ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"rlhf_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
