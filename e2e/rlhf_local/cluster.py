"""Start, inspect and stop the local control plane.

Public API (also used by ``rlhfjob local up|down``)::

    up(*, timeout: float = 600.0, echo: bool = True) -> Path
        Build missing binaries, start whatever is not running, install CRDs and fake nodes,
        wait until every component is healthy and return the admin kubeconfig path. Calling
        it on a running cluster only re-checks health and re-applies CRDs and nodes.
    down(*, keep_data: bool = False, echo: bool = True) -> None
        Stop every process `up` started (stand-in Ray clusters included), sweep orphans, and
        delete etcd's data and the object store's buckets unless `keep_data`. Logs,
        certificates and the object store's credentials stay.
    status() -> dict[str, int | None]
        Pid of each component, or None when it is not running.
    is_running() -> bool
        True when every component runs and the API server answers /readyz.
    healthy(name) -> bool
        Whether one component answers its health check now.
    restart(name, *, timeout=120.0, echo=True) -> float
        Stop one component of a running cluster (etcd, kube-apiserver, kueue or objectstore)
        and start it again in place: same data, ports, certificates and flags; wait until it,
        and the API server when it is etcd, are healthy again. `stopped(name)` is the same as
        a context manager (down for the body), built on `stop_component` and
        `start_component`.

The S3-compatible object store (SeaweedFS, `rlhf_local.objectstore`) is one of the components:
`up` starts it first (it needs nothing else) and waits for it last.

Processes run detached, in their own sessions, with output in ``<local dir>/logs/<name>.log``;
see rlhf_local.paths for the directories and docs/local-cluster.md for the whole picture.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from rlhf_local import objectstore, pki, pools, procs
from rlhf_local.build import Binaries, ensure_binaries
from rlhf_local.paths import (
    REPO_ROOT,
    kubeconfig_path,
    load_ports,
    local_dir,
    port_is_free,
    state_file,
)

#: Start order; `down` stops in reverse.
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "kuberay-operator",
    "kueue",
    "standin-ray",
    objectstore.COMPONENT,
)
#: The loopback ports each component listens on, by their names in ``cluster.json``.
COMPONENT_PORTS: dict[str, tuple[str, ...]] = {
    "etcd": ("etcd", "etcd-peer"),
    "kube-apiserver": ("kube-apiserver",),
    "kube-controller-manager": ("kube-controller-manager",),
    "kube-scheduler": ("kube-scheduler",),
    "kwok": ("kwok",),
    "kuberay-operator": ("kuberay-metrics", "kuberay-probe"),
    "kueue": ("kueue-webhook", "kueue-probe"),
    "standin-ray": (),  # its heads' ports are chosen per head
    objectstore.COMPONENT: objectstore.PORT_NAMES,
}
PORT_NAMES = tuple(port for name in COMPONENTS for port in COMPONENT_PORTS[name])
#: How long a stopped component's port may stay taken (its last connections closing).
PORT_RELEASE_TIMEOUT = 10.0
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"
FIELD_MANAGER = "rlhf-local"
KUEUE_GROUP = "kueue.x-k8s.io"
#: The Secret Kueue's certificate rotator reads (its configuration's default name); `up`
#: creates it from `pki.ensure_kueue_pki`'s files, the rotator finds them valid and keeps them.
KUEUE_SECRET = "kueue-webhook-server-cert"
#: The CRDs Kueue serves conversions for (its kustomize `webhook_in_*` patches). The rotator
#: injects its CA into each and does not start while one lacks a webhook clientConfig.
KUEUE_CONVERSION_CRDS = frozenset(
    f"{plural}.{KUEUE_GROUP}"
    for plural in ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")
)
#: The webhook configurations' names the rotator injects its CA into.
KUEUE_WEBHOOK_CONFIGS = {
    "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
    "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
}


def _echo(enabled: bool, msg: str) -> None:
    if enabled:
        print(f"[cluster] {msg}", file=sys.stderr, flush=True)


class Layout:
    """Paths inside the local state directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pki = root / "pki"
        self.logs = root / "logs"
        self.pids = root / "pids"
        self.etcd_data = root / "etcd"
        self.kubeconfigs = root / "kubeconfigs"
        self.standin = root / "standin"
        self.state = state_file(root)
        self.bin = root / "bin"
        self.kubeconfig = kubeconfig_path()
        self.kueue_pki = self.pki / "kueue"
        #: Kueue's webhook.certDir: tls.crt and tls.key, as a mounted Secret would hold them.
        self.kueue_certs = root / "kueue-certs"
        self.kueue_config = root / "kueue-config.yaml"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def pid(self, name: str) -> Path:
        return self.pids / f"{name}.pid"


def ray_temp_root(root: Path | None = None) -> Path:
    """Short per-cluster root for Ray's temp dirs: Ray's unix sockets allow ~107 characters."""
    digest = hashlib.sha256(str(root or local_dir()).encode()).hexdigest()[:6]
    return Path("/tmp") / f"rr-{digest}"


def log_tail(name: str, lines: int = 40) -> str:
    """Last lines of a component's log, for error messages and failing tests."""
    path = Layout(local_dir()).log(name)
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return f"--- {path} (last {lines} lines) ---\n" + "\n".join(text[-lines:])


class StartupError(RuntimeError):
    """A component died while we waited for it: waiting longer cannot help."""


def wait_until(
    check: Callable[[], bool], timeout: float, what: str, logs: tuple[str, ...] = ()
) -> None:
    """Poll `check` until it holds; on timeout raise with the named components' log tails."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            if check():
                return
        except StartupError:
            raise
        except Exception:  # a component that is still starting may refuse connections
            pass
        if time.monotonic() > deadline:
            tails = "\n".join(log_tail(n) for n in logs)
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)


def _load_ports(lay: Layout) -> dict[str, int]:
    """Ports chosen at the first `up` of this state dir, reused so kubeconfigs stay valid."""
    return load_ports(lay.root, PORT_NAMES)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _write_kubeconfig(path: Path, server: str, ca: Path, cert: Path, key: Path) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "rlhf-local",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca)},
            }
        ],
        "users": [
            {
                "name": "rlhf-local",
                "user": {
                    "client-certificate-data": _b64(cert),
                    "client-key-data": _b64(key),
                },
            }
        ],
        "contexts": [
            {"name": "rlhf-local", "context": {"cluster": "rlhf-local", "user": "rlhf-local"}}
        ],
        "current-context": "rlhf-local",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(config, sort_keys=False))
    tmp.chmod(0o600)
    tmp.replace(path)


def _kubeconfigs(lay: Layout, ports: dict[str, int]) -> dict[str, Path]:
    server = f"https://127.0.0.1:{ports['kube-apiserver']}"
    out = {}
    for ident in pki.CLIENTS:
        path = lay.kubeconfig if ident is pki.ADMIN else lay.kubeconfigs / f"{ident.stem}.yaml"
        _write_kubeconfig(
            path,
            server,
            lay.pki / "ca.crt",
            lay.pki / f"{ident.stem}.crt",
            lay.pki / f"{ident.stem}.key",
        )
        out[ident.stem] = path
    return out


def _argv(
    name: str, bins: Binaries, lay: Layout, ports: dict[str, int], kcfg: dict[str, Path]
) -> list[str]:
    """Command line of each component. Flags follow envtest's and kubeadm's defaults."""
    p = lay.pki
    admin = str(kcfg["admin"])
    if name == "etcd":
        return [
            str(bins.kube),
            "etcd",
            f"--data-dir={lay.etcd_data}",
            f"--listen-client-urls=http://127.0.0.1:{ports['etcd']}",
            f"--listen-peer-urls=http://127.0.0.1:{ports['etcd-peer']}",
        ]
    if name == "kube-apiserver":
        return [
            str(bins.kube),
            "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={ports['kube-apiserver']}",
            f"--tls-cert-file={p / 'apiserver.crt'}",
            f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}",
            "--authorization-mode=RBAC",
            f"--service-account-key-file={p / 'sa.pub'}",
            f"--service-account-signing-key-file={p / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            # The lease reconciler would try to publish 127.0.0.1 as the `kubernetes`
            # Service's endpoint, which Endpoints validation rejects (loopback).
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            f"--cert-dir={p}",
        ]
    if name in ("kube-controller-manager", "kube-scheduler"):
        own = str(kcfg[name])
        common = [
            str(bins.kube),
            name,
            f"--kubeconfig={own}",
            f"--authentication-kubeconfig={own}",
            f"--authorization-kubeconfig={own}",
            "--bind-address=127.0.0.1",
            f"--secure-port={ports[name]}",
            "--leader-elect=false",
            "--profiling=false",
        ]
        if name == "kube-scheduler":
            return common
        return [
            *common,
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={p / 'sa.key'}",
            f"--root-ca-file={p / 'ca.crt'}",
            f"--cluster-signing-cert-file={p / 'ca.crt'}",
            f"--cluster-signing-key-file={p / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--cert-dir={lay.root / 'kcm-certs'}",
        ]
    if name == "kwok":
        return [
            str(bins.kube),
            "kwok",
            f"--kubeconfig={admin}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={pools.KWOK_ANNOTATION}=fake",
            "--node-lease-duration-seconds=40",
            "--cidr=10.244.0.0/16",
            "--node-ip=10.0.0.1",
            f"--server-address=127.0.0.1:{ports['kwok']}",
            *(f"--config={s}" for s in bins.kwok_stages),
        ]
    if name == "kuberay-operator":
        return [
            str(bins.ray_operator),
            f"--kubeconfig={admin}",
            "--enable-leader-election=false",
            f"--metrics-addr=127.0.0.1:{ports['kuberay-metrics']}",
            f"--health-probe-bind-address=127.0.0.1:{ports['kuberay-probe']}",
            "--log-stdout-encoder=console",
        ]
    if name == "kueue":
        return [
            str(bins.kueue),
            f"--config={lay.kueue_config}",
            f"--kubeconfig={admin}",
            "--zap-encoder=console",
            "--zap-log-level=info",
        ]
    if name == "standin-ray":
        return [
            sys.executable,
            "-m",
            "rlhf_local.standin",
            f"--kubeconfig={admin}",
            f"--state-dir={lay.standin}",
            f"--temp-root={ray_temp_root(lay.root)}",
            f"--log-dir={lay.logs / 'ray'}",
        ]
    raise ValueError(name)


def _env() -> dict[str, str]:
    """Children get our environment with the venv's bin first (the stand-in runs `ray`)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("KUBECONFIG", None)
    return env


def _get(url: str, ctx: ssl.SSLContext | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=3, context=ctx) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def _admin_ssl(lay: Layout) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(lay.pki / "ca.crt"))
    ctx.load_cert_chain(str(lay.pki / "admin.crt"), str(lay.pki / "admin.key"))
    return ctx


def _insecure_ssl() -> ssl.SSLContext:
    """Scheduler and controller manager serve /healthz with a self-signed certificate."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _health_checks(lay: Layout, ports: dict[str, int]) -> dict[str, Callable[[], bool]]:
    def ok(url: str, ctx: ssl.SSLContext | None = None) -> Callable[[], bool]:
        return lambda: _get(url, ctx)[0] == 200

    api = f"https://127.0.0.1:{ports['kube-apiserver']}"
    return {
        "etcd": lambda: '"true"' in _get(f"http://127.0.0.1:{ports['etcd']}/health")[1],
        "kube-apiserver": lambda: _get(f"{api}/readyz", _admin_ssl(lay))[0] == 200,
        "kube-controller-manager": ok(
            f"https://127.0.0.1:{ports['kube-controller-manager']}/healthz", _insecure_ssl()
        ),
        "kube-scheduler": ok(
            f"https://127.0.0.1:{ports['kube-scheduler']}/healthz", _insecure_ssl()
        ),
        "kwok": ok(f"http://127.0.0.1:{ports['kwok']}/healthz"),
        "kuberay-operator": ok(f"http://127.0.0.1:{ports['kuberay-probe']}/readyz"),
        # Ready once its certificates are in place and its webhook server listens.
        "kueue": ok(f"http://127.0.0.1:{ports['kueue-probe']}/readyz"),
        "standin-ray": lambda: (lay.standin / "ready").exists(),
        # ListBuckets succeeds, writes would not wait, old objects read back (objectstore.ready).
        objectstore.COMPONENT: lambda: objectstore.ready(lay.root),
    }


@functools.cache
def binaries() -> Binaries:
    """The cached binaries, built on first use in this process."""
    return ensure_binaries()


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    """Run the cached kubectl against the local cluster and return its stdout."""
    cmd = [str(binaries().kubectl), f"--kubeconfig={kubeconfig_path()}", *args]
    out = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:1] + list(args))} failed:\n{out.stderr}")
    return out.stdout


def _apply_server_side(files: list[Path] | None = None, stdin: str | None = None) -> None:
    args = ["apply", "--server-side", "--force-conflicts", f"--field-manager={FIELD_MANAGER}"]
    if files:
        for f in files:
            kubectl(*args, "-f", str(f))
    if stdin is not None:
        kubectl(*args, "-f", "-", stdin=stdin)


def _install_crds(bins: Binaries, lay: Layout, ports: dict[str, int], echo: bool) -> None:
    """KubeRay's and Kueue's CRDs and every CRD in the repo's crds/ (all server-side: large).

    A repo CRD the API server rejects is reported but does not stop `up`: the cluster is
    still useful, and the tests of that CRD fail with the API server's reason.
    """
    _apply_server_side(list(bins.kuberay_crds))
    _apply_server_side(stdin=_json_stream(kueue_crds(bins, lay, ports)))
    for crd in sorted((REPO_ROOT / "crds").glob("*.yaml")):
        try:
            _apply_server_side([crd])
        except RuntimeError as err:
            _echo(True, f"WARNING: the API server rejected {crd.name}: {err}")
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")


def _json_stream(docs: list[dict[str, Any]]) -> str:
    """Manifests as one YAML stream of JSON documents (much faster to write than YAML)."""
    return "\n---\n".join(json.dumps(d) for d in docs)


def _load_yaml(path: Path) -> list[dict[str, Any]]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the workloads CRD is 1.4 MB
    return [d for d in yaml.load_all(path.read_text(), Loader=loader) if d]


def _kueue_url(ports: dict[str, int], path: str) -> str:
    return f"https://127.0.0.1:{ports['kueue-webhook']}{path}"


def kueue_crds(bins: Binaries, lay: Layout, ports: dict[str, int]) -> list[dict[str, Any]]:
    """Kueue's CRDs; the five with several schemas convert through Kueue's /convert on
    127.0.0.1, trusting Kueue's CA (what its kustomize patches and cert rotator set up)."""
    ca = _b64(lay.kueue_pki / "ca.crt")
    crds = [doc for path in bins.kueue_crds for doc in _load_yaml(path)]
    for crd in crds:
        if crd["metadata"]["name"] in KUEUE_CONVERSION_CRDS:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {"url": _kueue_url(ports, "/convert"), "caBundle": ca},
                    "conversionReviewVersions": ["v1"],
                },
            }
    return crds


def kueue_webhooks(bins: Binaries, lay: Layout, ports: dict[str, int]) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, only the kueue.x-k8s.io webhooks (Workloads,
    ClusterQueues, ResourceFlavors, Cohorts), called at 127.0.0.1 instead of a Service.

    The frameworks' webhooks (batch Jobs, Pods, RayClusters...) stay out: a Job or Pod of
    another test never waits on Kueue, and `up` needs no Kueue before it creates anything.
    """
    ca = _b64(lay.kueue_pki / "ca.crt")
    out = []
    for config in _load_yaml(bins.kueue_webhooks):
        hooks = []
        for hook in config["webhooks"]:
            if any(set(rule["apiGroups"]) != {KUEUE_GROUP} for rule in hook["rules"]):
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": _kueue_url(ports, path), "caBundle": ca}
            hooks.append(hook)
        name = KUEUE_WEBHOOK_CONFIGS[config["kind"]]
        out.append({**config, "metadata": {"name": name}, "webhooks": hooks})
    return out


def kueue_config(lay: Layout, ports: dict[str, int]) -> dict[str, Any]:
    """Kueue's Configuration: one replica, loopback only, batch/job the one integration."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": pki.KUEUE_NAMESPACE,
        "leaderElection": {"leaderElect": False},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['kueue-probe']}"},
        # "0": no metrics server (Kueue's is TLS with token reviews, nothing here scrapes it).
        "metrics": {"bindAddress": "0"},
        "webhook": {
            "host": "127.0.0.1",
            "port": ports["kueue-webhook"],
            "certDir": str(lay.kueue_certs),
        },
        # On (the default): off makes Kueue load metrics certificates from a fixed /etc path.
        "internalCertManagement": {"enable": True},
        "manageJobsWithoutQueueName": False,
        # Only Jobs with a queue-name label are Kueue's; the operator owns RLHFJob Workloads.
        "integrations": {"frameworks": ["batch/job"]},
        # VisibilityOnDemand would start an aggregated API server on a fixed port (8082).
        "featureGates": {"VisibilityOnDemand": False},
    }


def _install_kueue(bins: Binaries, lay: Layout, ports: dict[str, int]) -> None:
    """Everything Kueue needs before it starts (its CRDs come with `_install_crds`): the
    namespace, the certificate Secret and files, the webhook configurations, the config file.
    The certificates are `pki.ensure_kueue_pki`'s (made before the CRDs, which carry the CA)."""
    lay.kueue_certs.mkdir(exist_ok=True)
    for name in ("tls.crt", "tls.key"):
        data = (lay.kueue_pki / name).read_bytes()
        target = lay.kueue_certs / name
        if not target.exists() or target.read_bytes() != data:
            tmp = target.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.chmod(0o600)
            tmp.replace(target)
    lay.kueue_config.write_text(yaml.safe_dump(kueue_config(lay, ports), sort_keys=False))
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": pki.KUEUE_NAMESPACE}}
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": KUEUE_SECRET, "namespace": pki.KUEUE_NAMESPACE},
        "type": "Opaque",
        "data": {name: _b64(lay.kueue_pki / name) for name in pki.KUEUE_FILES},
    }
    _apply_server_side(stdin=_json_stream([namespace, secret, *kueue_webhooks(bins, lay, ports)]))


def _nodes_ready() -> bool:
    data = json.loads(kubectl("get", "nodes", "-o", "json"))
    want = {n["metadata"]["name"] for n in pools.node_manifests()}
    ready = {
        item["metadata"]["name"]
        for item in data["items"]
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in item.get("status", {}).get("conditions", [])
        )
    }
    return want <= ready


def _start_missing(
    names: tuple[str, ...],
    bins: Binaries,
    lay: Layout,
    ports: dict[str, int],
    kcfg: dict[str, Path],
    echo: bool,
) -> None:
    for name in names:
        if procs.running(lay.pid(name)) is not None:
            continue
        if name == "standin-ray":
            (lay.standin / "ready").unlink(missing_ok=True)
        _echo(echo, f"starting {name}")
        _check_ports_free(name, lay, ports)
        if name == objectstore.COMPONENT:  # its config and credentials files, its environment
            objectstore.launch(bins.weed, lay.root, ports)
            continue
        procs.start(
            name,
            _argv(name, bins, lay, ports, kcfg),
            log_dir=lay.logs,
            pid_dir=lay.pids,
            env=_env(),
            cwd=lay.root,
        )


def _check_ports_free(name: str, lay: Layout, ports: dict[str, int]) -> None:
    """Refuse to start `name` while another process listens on one of its ports (another local
    cluster, most likely): a server started anyway would fail, or, as SeaweedFS does, move to
    another port than the one every client of this cluster uses."""
    deadline = time.monotonic() + PORT_RELEASE_TIMEOUT
    while taken := [p for p in COMPONENT_PORTS[name] if not port_is_free(ports[p])]:
        if time.monotonic() > deadline:
            listed = ", ".join(f"{p} {ports[p]}" for p in taken)
            raise RuntimeError(
                f"{name} cannot start: another process listens on its port ({listed}). Stop "
                f"it, or stop this cluster and remove {state_file(lay.root)} to choose new ports."
            )
        time.sleep(0.2)


def _wait_healthy(
    names: tuple[str, ...], checks: dict[str, Callable[[], bool]], lay: Layout, timeout: float
) -> None:
    for name in names:

        def healthy(name: str = name) -> bool:
            if procs.running(lay.pid(name)) is None:
                raise StartupError(f"{name} exited during startup\n{log_tail(name)}")
            return checks[name]()

        wait_until(healthy, timeout, f"{name} to become healthy", logs=(name,))


def _link_tools(bins: Binaries, lay: Layout) -> None:
    """Put kubectl and helm from the cache on a predictable path: <local dir>/bin."""
    bindir = lay.bin
    bindir.mkdir(exist_ok=True)
    for tool in (bins.kubectl, bins.helm):
        link = bindir / tool.name
        link.unlink(missing_ok=True)
        link.symlink_to(tool)


def up(*, timeout: float = 600.0, echo: bool = True) -> Path:
    """Bring the local cluster up (idempotent); return the admin kubeconfig path."""
    started = time.monotonic()
    bins = binaries()
    lay = Layout(local_dir())
    with procs.file_lock(lay.root):
        ports = _load_ports(lay)
        pki.ensure_pki(lay.pki, SERVICE_IP)
        kcfg = _kubeconfigs(lay, ports)
        checks = _health_checks(lay, ports)
        # Needs nothing else: it starts while the control plane does.
        _start_missing((objectstore.COMPONENT,), bins, lay, ports, kcfg, echo)

        core = COMPONENTS[:5]
        _start_missing(core[:1], bins, lay, ports, kcfg, echo)
        _wait_healthy(core[:1], checks, lay, timeout)
        _start_missing(core[1:2], bins, lay, ports, kcfg, echo)
        _wait_healthy(core[1:2], checks, lay, timeout)
        _start_missing(core[2:], bins, lay, ports, kcfg, echo)
        pki.ensure_kueue_pki(lay.kueue_pki)
        _install_crds(bins, lay, ports, echo)
        _install_kueue(bins, lay, ports)
        _apply_server_side(stdin=yaml.safe_dump_all(pools.node_manifests()))
        _start_missing(COMPONENTS[5:], bins, lay, ports, kcfg, echo)
        _wait_healthy(COMPONENTS[2:], checks, lay, timeout)
        wait_until(_nodes_ready, timeout, "fake nodes to become Ready", logs=("kwok",))
        wait_until(
            lambda: bool(kubectl("get", "serviceaccount", "default", "-o", "name", check=False)),
            timeout,
            "the default ServiceAccount (controller manager)",
            logs=("kube-controller-manager",),
        )
    _link_tools(bins, lay)
    _echo(echo, f"up in {time.monotonic() - started:.1f}s; logs in {lay.logs}")
    _echo(echo, f"export KUBECONFIG={lay.kubeconfig} PATH={lay.bin}:$PATH")
    return lay.kubeconfig


def status() -> dict[str, int | None]:
    """Pid of each component, None when it is not running."""
    lay = Layout(local_dir())
    return {name: procs.running(lay.pid(name)) for name in COMPONENTS}


def is_running() -> bool:
    """Every component runs and the API server is ready."""
    lay = Layout(local_dir())
    if any(pid is None for pid in status().values()):
        return False
    try:
        ports = json.loads(lay.state.read_text())["ports"]
        return _health_checks(lay, ports)["kube-apiserver"]()
    except (OSError, ValueError, KeyError, urllib.error.URLError):
        return False


#: Components that `restart` stops and starts in place on a running cluster, and what must
#: be healthy again before it returns (the API server's /readyz checks etcd).
RESTARTABLE: dict[str, tuple[str, ...]] = {
    "etcd": ("etcd", "kube-apiserver"),
    "kube-apiserver": ("kube-apiserver",),
    "kueue": ("kueue",),
    objectstore.COMPONENT: (objectstore.COMPONENT,),
}


def healthy(name: str) -> bool:
    """Whether component `name` answers its health check now (False while it is down)."""
    lay = Layout(local_dir())
    try:
        ports = json.loads(lay.state.read_text())["ports"]
        return bool(_health_checks(lay, ports)[name]())
    except (OSError, ValueError, KeyError):  # URLError, refused, reset, TLS: all OSError
        return False


def _restartable(name: str) -> tuple[str, ...]:
    if name not in RESTARTABLE:
        raise ValueError(f"{name!r} cannot be restarted in place; one of {sorted(RESTARTABLE)}")
    return RESTARTABLE[name]


def _kubeconfig_paths(lay: Layout) -> dict[str, Path]:
    """The kubeconfigs `up` wrote (by identity), without rewriting them."""
    return {
        ident.stem: lay.kubeconfig if ident is pki.ADMIN else lay.kubeconfigs / f"{ident.stem}.yaml"
        for ident in pki.CLIENTS
    }


def _stop(lay: Layout, name: str, grace: float = 15.0) -> bool:
    """SIGTERM one component's process group (SIGKILL after `grace`); True when it ran."""
    if name == objectstore.COMPONENT:  # also removes its unix sockets
        return objectstore.stop_process(lay.root, grace)
    return procs.stop(lay.pid(name), grace)


def stop_component(name: str, *, echo: bool = True) -> None:
    """Stop one running component (SIGTERM, like `down`); its data, ports and certificates stay.

    etcd keeps its data directory, so `start_component` brings back the same cluster state.
    """
    _restartable(name)
    lay = Layout(local_dir())
    with procs.file_lock(lay.root):
        if not _stop(lay, name):
            raise RuntimeError(f"{name} is not running")
    _echo(echo, f"stopped {name}")


def start_component(name: str, *, timeout: float = 120.0, echo: bool = True) -> float:
    """Start a component `stop_component` stopped, with the flags `up` gives it, and wait until
    it and what depends on it are healthy; return the seconds that took."""
    must_be_healthy = _restartable(name)
    started = time.monotonic()
    bins = binaries()
    lay = Layout(local_dir())
    with procs.file_lock(lay.root):
        ports = json.loads(lay.state.read_text())["ports"]
        _start_missing((name,), bins, lay, ports, _kubeconfig_paths(lay), echo)
        _wait_healthy(must_be_healthy, _health_checks(lay, ports), lay, timeout)
    took = time.monotonic() - started
    _echo(echo, f"{name} healthy again after {took:.1f}s")
    return took


@contextlib.contextmanager
def stopped(name: str, *, timeout: float = 120.0, echo: bool = True) -> Iterator[None]:
    """Keep `name` stopped while the body runs, then start it again and wait until healthy."""
    stop_component(name, echo=echo)
    try:
        yield
    finally:
        start_component(name, timeout=timeout, echo=echo)


def restart(name: str, *, timeout: float = 120.0, echo: bool = True) -> float:
    """Stop and start one component in place; return the seconds from stop to healthy."""
    started = time.monotonic()
    with stopped(name, timeout=timeout, echo=echo):
        pass
    return time.monotonic() - started


def _orphans(lay: Layout) -> list[int]:
    """Processes of this cluster that no pid file names any more (e.g. after a crash)."""
    found = set(procs.find_by_cmdline(str(ray_temp_root(lay.root))))
    for pid in procs.find_by_cmdline(str(lay.root)):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        exe = cmdline[0].decode(errors="replace")
        binaries = ("/kube", "/ray-operator", "/kueue", "/weed")
        if exe.endswith(binaries) or b"rlhf_local.standin" in cmdline:
            found.add(pid)
    return sorted(found)


def down(*, keep_data: bool = False, echo: bool = True) -> None:
    """Stop everything `up` started, sweep orphans, and drop etcd's data and the object store's
    buckets unless `keep_data` (the store's credentials stay, like the certificates)."""
    lay = Layout(local_dir())
    with procs.file_lock(lay.root):
        for name in reversed(COMPONENTS):
            # The stand-in tears its Ray clusters down on SIGTERM; give it time for that.
            if _stop(lay, name, grace=30.0 if name == "standin-ray" else 15.0):
                _echo(echo, f"stopped {name}")
        orphans = _orphans(lay)
        if orphans:
            _echo(echo, f"killing {len(orphans)} leftover processes: {orphans}")
            procs.kill_pids(orphans)
        shutil.rmtree(ray_temp_root(lay.root), ignore_errors=True)
        shutil.rmtree(lay.standin, ignore_errors=True)
        if not keep_data:
            shutil.rmtree(lay.etcd_data, ignore_errors=True)
            objectstore.remove_data(lay.root)


def _print_status() -> None:
    for name, pid in status().items():
        print(f"{name:26} {'running, pid ' + str(pid) if pid else 'stopped'}")
    print(f"kubeconfig: {kubeconfig_path()}")
    root = local_dir()
    if objectstore.is_running(root):
        store = objectstore.Layout(root)
        print(f"object store (S3): {objectstore.endpoint_url(root)}, keys in {store.credentials}")


def main(argv: list[str] | None = None) -> int:
    """`python -m rlhf_local {build|up|down|status}`."""
    import argparse

    parser = argparse.ArgumentParser(prog="rlhf_local", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build or fetch every binary into the cache")
    sub.add_parser("up", help="start the cluster (idempotent)")
    d = sub.add_parser("down", help="stop the cluster")
    d.add_argument("--keep-data", action="store_true", help="keep etcd's data")
    sub.add_parser("status", help="show which components run")
    args = parser.parse_args(argv)
    if args.cmd == "build":
        bins = binaries()
        for field, value in vars(bins).items():
            shown: Any = value if isinstance(value, Path) else f"{len(value)} files"
            print(f"{field:14} {shown}")
    elif args.cmd == "up":
        print(up())
    elif args.cmd == "down":
        down(keep_data=args.keep_data)
    else:
        _print_status()
    return 0
