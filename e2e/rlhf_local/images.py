"""Build the project's container images without a daemon, cache them, and run them.

`task images` (``python -m rlhf_local.image_checks``) builds
images/operator/Dockerfile and images/trainer/Dockerfile with buildah into an image store of
the project's own (``<cache>/images``; ``RLHF_IMAGES_DIR`` moves it), and runs them with podman.
Root only: the store is native overlay storage, with no rootless setup to depend on.

* No registry is needed. Each Dockerfile's ``FROM`` is the build argument ``BASE_IMAGE``, whose
  default is the official ``python:3.11-slim``; here it is a stand-in made from Debian's packages
  (``mmdebstrap --variant=minbase`` of bookworm, whose Python is 3.11 like the images' locks),
  unless the caller names a base the store has or can pull.
* An image is tagged with the hash of its inputs: the Dockerfile, every file its ``COPY`` lines
  take from the build context, .dockerignore, its build arguments and the base image's ID. A warm
  run finds the tag and builds nothing; a changed input rebuilds with buildah's layer cache, so a
  source change leaves the dependency layers as they are.
* Builds reach the package index through the host's network and trust the host's CA bundle,
  mounted read-only over the image's for each RUN step only: it is never in a layer.
* podman and buildah read configuration written into the store (storage.conf, containers.conf),
  never /etc: runc (crun refuses hybrid cgroup hierarchies), cgroupfs, and rlimits no higher than
  the caller's own (raising one needs CAP_SYS_RESOURCE).

For tests (an e2e test runs the operator from its image)::

    ref = images.ensure_image("operator")   # built, or found by its inputs' hash
    result = images.run(ref.tag, ["--help"], images.RunOptions(read_only=True))
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import shlex
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_local import procs
from rlhf_local.paths import REPO_ROOT, cache_dir, digest

#: The stand-in base's Debian suite: its Python is 3.11, the version the images' locks are for.
DEBIAN_SUITE = "bookworm"
DEBIAN_SOURCES = (
    f"deb http://deb.debian.org/debian {DEBIAN_SUITE} main",
    f"deb http://deb.debian.org/debian {DEBIAN_SUITE}-updates main",
    f"deb http://deb.debian.org/debian-security {DEBIAN_SUITE}-security main",
)
#: Beside a minimal Debian, what the official python:3.11-slim has that the Dockerfiles use.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
#: Left out of the stand-in's packages, as the slim images leave them out.
BASE_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/info/*", "/usr/share/locale/*")
#: The official image's environment that the stand-in copies.
BASE_CHANGES = ('ENV LANG="C.UTF-8"', 'CMD ["python3"]')
REPOSITORY = "localhost/rlhfjob"
#: The tools, each named as its Debian package.
TOOLS = ("buildah", "podman", "runc", "mmdebstrap")
#: Where the image keeps its CA bundle (Debian's ca-certificates; the Dockerfiles point pip at it).
IMAGE_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
#: The most open files and processes containers.conf asks for, capped at the caller's own limits.
NOFILE, NPROC = 65536, 32768
#: What .dockerignore leaves out of the copied directories, left out of the hash too.
IGNORED_NAMES = ("__pycache__",)
IGNORED_SUFFIXES = (".pyc", ".egg-info")


@dataclass(frozen=True)
class Spec:
    """One image: its Dockerfile (relative to the repository) and build arguments."""

    name: str
    dockerfile: str
    build_args: tuple[tuple[str, str], ...] = ()


SPECS = {
    "operator": Spec("operator", "images/operator/Dockerfile"),
    # CI's trainer: the CPU variant (no vLLM), which `rlhfjob train` runs a tiny job with.
    "trainer": Spec("trainer", "images/trainer/Dockerfile", (("VARIANT", "cpu"),)),
    # The Dockerfile's default (with vLLM): built on request only, several GB more.
    "trainer-gpu": Spec("trainer-gpu", "images/trainer/Dockerfile", (("VARIANT", "gpu"),)),
}
#: What `task images` builds.
DEFAULT_IMAGES = ("operator", "trainer")


@dataclass(frozen=True)
class ImageRef:
    """A built image in the store."""

    name: str
    #: ``localhost/rlhfjob/<name>:<inputs' hash>``: what `run` takes.
    tag: str
    image_id: str
    #: The image it was built on (a tag).
    base: str
    size_mb: float
    #: Seconds this call spent building it; 0.0 when the store had it.
    build_seconds: float

    @property
    def cached(self) -> bool:
        return self.build_seconds == 0.0


def _log(message: str) -> None:
    print(f"[images] {message}", file=sys.stderr, flush=True)


def _digest(*parts: str | bytes) -> str:
    return digest(*parts, length=16)


# --------------------------------------------------------------------------------------------
# The store and its configuration


def storage_conf(graphroot: Path, runroot: Path) -> str:
    """containers-storage.conf(5): native overlay under `graphroot`."""
    return (
        f'[storage]\ndriver = "overlay"\ngraphroot = {json.dumps(str(graphroot))}\n'
        f"runroot = {json.dumps(str(runroot))}\n"
    )


def containers_conf(tmp_dir: Path, nofile: int, nproc: int) -> str:
    """containers.conf(5): runc, cgroupfs, no event log, and explicit rlimits (podman's
    defaults are above what a process without CAP_SYS_RESOURCE may set)."""
    ulimits = json.dumps([f"nofile={nofile}:{nofile}", f"nproc={nproc}:{nproc}"])
    return (
        f"[containers]\ndefault_ulimits = {ulimits}\n\n"
        f'[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "none"\n'
        f"tmp_dir = {json.dumps(str(tmp_dir))}\n"
    )


REGISTRIES_CONF = 'unqualified-search-registries = ["docker.io"]\nshort-name-mode = "permissive"\n'
"""registries.conf(5): short names (a ``--base-image python:3.11-slim``) are Docker Hub's."""
POLICY_JSON = '{"default": [{"type": "insecureAcceptAnything"}]}\n'


def rlimits() -> tuple[int, int]:
    """(open files, processes) for containers: `NOFILE` and `NPROC`, or this process's hard
    limits where lower (a container may not raise them)."""

    def capped(which: int, most: int) -> int:
        hard = resource.getrlimit(which)[1]
        return most if hard == resource.RLIM_INFINITY else min(most, hard)

    return capped(resource.RLIMIT_NOFILE, NOFILE), capped(resource.RLIMIT_NPROC, NPROC)


@dataclass(frozen=True)
class Store:
    """An image store of its own: podman's and buildah's storage, configuration and scratch."""

    root: Path

    @classmethod
    def default(cls) -> Store:
        env = os.environ.get("RLHF_IMAGES_DIR")
        return cls(Path(env) if env else cache_dir() / "images")

    @property
    def runroot(self) -> Path:
        """Run-time state on a tmpfs: podman's lock files and container state must not
        outlive a reboot. One per store."""
        return Path("/run") / f"rlhfjob-images-{_digest(str(self.root.resolve()))[:10]}"

    def env(self) -> dict[str, str]:
        """The environment of every podman and buildah command: this store's configuration,
        and its scratch directory (buildah's temporary files are gigabytes)."""
        return {
            **os.environ,
            "CONTAINERS_CONF": str(self.root / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(self.root / "storage.conf"),
            "CONTAINERS_REGISTRIES_CONF": str(self.root / "registries.conf"),
            "TMPDIR": str(self.root / "tmp"),
        }

    def prepare(self) -> None:
        """Write the configuration (cheap; rlimits are the caller's and may change)."""
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        files = {
            "storage.conf": storage_conf(self.root / "storage", self.runroot),
            "containers.conf": containers_conf(self.runroot / "libpod", *rlimits()),
            "registries.conf": REGISTRIES_CONF,
            "policy.json": POLICY_JSON,
        }
        for name, text in files.items():
            path = self.root / name
            if not path.exists() or path.read_text() != text:
                path.write_text(text)

    def podman(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["podman", *args], env=self.env(), capture_output=True, text=True, check=check
        )

    def exists(self, image: str) -> bool:
        return self.podman("image", "exists", image, check=False).returncode == 0

    def inspect(self, image: str) -> dict[str, Any]:
        return dict(json.loads(self.podman("image", "inspect", image).stdout)[0])

    def tags(self, repository: str) -> list[str]:
        out = self.podman("images", "--format", "{{.Repository}}:{{.Tag}}", repository).stdout
        return [line for line in out.split() if line.startswith(repository + ":")]

    def prune(self, repository: str, keep: str) -> None:
        """Drop `repository`'s other tags and the layers only they used: a rebuilt trainer
        would otherwise leave gigabytes behind."""
        old = [tag for tag in self.tags(repository) if tag != keep]
        if old:
            self.podman("rmi", "--force", *old, check=False)
            self.podman("image", "prune", "--force", check=False)
            _log(f"removed {', '.join(old)}")


# --------------------------------------------------------------------------------------------
# Tools and the base


def ensure_tools() -> None:
    """buildah, podman, runc and mmdebstrap: installed with apt-get when missing (as root on
    Debian), so `task images` sets up a fresh machine itself."""
    if os.geteuid() != 0:
        raise RuntimeError("building and running the images needs root (native overlay storage)")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"missing {', '.join(missing)}: install them with your package manager")
    _log(f"installing {' '.join(missing)} (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if subprocess.run(install, env=env, check=False).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, check=True)  # stale package lists
        subprocess.run(install, env=env, check=True)


def base_command(target: str) -> list[str]:
    """mmdebstrap's command line for the stand-in base, written to `target` as a tarball."""
    return [
        "mmdebstrap",
        "--variant=minbase",
        f"--include={','.join(BASE_PACKAGES)}",
        *(f"--dpkgopt=path-exclude={pattern}" for pattern in BASE_EXCLUDES),
        "--format=tar",
        DEBIAN_SUITE,
        target,
        *DEBIAN_SOURCES,
    ]


def base_tag() -> str:
    """The stand-in's tag: its recipe's hash."""
    return f"{REPOSITORY}/base:{DEBIAN_SUITE}-{_digest(*base_command('-'), *BASE_CHANGES)}"


def ensure_base(store: Store) -> str:
    """The stand-in base image (Debian's packages, no registry), made when the store lacks it:
    about half a minute, about 200 MB."""
    tag = base_tag()
    if store.exists(tag):
        return tag
    tarball = store.root / "tmp" / f"{tag.rpartition(':')[2]}.tar"
    _log(f"making the stand-in base {tag} ({DEBIAN_SUITE}, mmdebstrap)")
    try:
        subprocess.run(base_command(str(tarball)), check=True, stdout=sys.stderr)
        changes = [arg for change in BASE_CHANGES for arg in ("--change", change)]
        store.podman("import", *changes, str(tarball), tag)
    finally:
        tarball.unlink(missing_ok=True)
    store.prune(f"{REPOSITORY}/base", keep=tag)
    return tag


# --------------------------------------------------------------------------------------------
# What an image is built from


def dockerfile_args(text: str, build_args: Mapping[str, str]) -> dict[str, str]:
    """Every ARG's value: its default in the Dockerfile, replaced by `build_args`."""
    defaults = dict(re.findall(r"^\s*ARG\s+(\w+)=(\S*)", text, re.MULTILINE | re.IGNORECASE))
    return {**defaults, **build_args}


def copied_sources(text: str, build_args: Mapping[str, str]) -> list[str]:
    """The build-context paths a Dockerfile's COPY and ADD lines take (not those from a stage),
    with ``${ARG}`` references expanded."""
    args = dockerfile_args(text, build_args)
    joined = text.replace("\\\n", " ")
    sources: list[str] = []
    for rest in re.findall(r"^\s*(?:COPY|ADD)\s+(.+)$", joined, re.MULTILINE | re.IGNORECASE):
        words = shlex.split(rest)
        if any(word.startswith("--from") for word in words):
            continue
        paths = [word for word in words if not word.startswith("--")][:-1]
        for path in paths:
            expanded = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m[1] or m[2]], path)
            sources.append(expanded.rstrip("/"))
    return sources


def context_files(sources: Sequence[str], root: Path = REPO_ROOT) -> list[Path]:
    """The files under `sources`, as .dockerignore sends them (no bytecode, no egg-info)."""
    files: set[Path] = set()
    for source in sources:
        path = root / source
        candidates = path.rglob("*") if path.is_dir() else [path]
        for file in candidates:
            parts = file.relative_to(root).parts
            if any(p in IGNORED_NAMES or p.endswith(IGNORED_SUFFIXES) for p in parts):
                continue
            if file.is_file():
                files.add(file)
    return sorted(files)


def input_key(spec: Spec, base_id: str, root: Path = REPO_ROOT) -> str:
    """The hash of everything the image is built from: a changed one means a rebuild."""
    text = (root / spec.dockerfile).read_text()
    ignore = root / ".dockerignore"
    parts: list[str | bytes] = [text, json.dumps(sorted(spec.build_args)), base_id]
    parts.append(ignore.read_bytes() if ignore.exists() else b"")
    for file in context_files(copied_sources(text, dict(spec.build_args)), root):
        parts += [str(file.relative_to(root)), file.read_bytes()]
    return _digest(*parts)


def host_ca_bundle() -> Path | None:
    """The CA bundle this machine's own clients trust (pip's or OpenSSL's): where a proxy that
    re-signs TLS is trusted, it is in this bundle."""
    for variable in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        value = os.environ.get(variable)
        if value and Path(value).is_file():
            return Path(value).resolve()
    cafile = Path(ssl.get_default_verify_paths().openssl_cafile)
    return cafile.resolve() if cafile.is_file() else None


def build_command(
    spec: Spec, tag: str, base: str, *, ca_bundle: Path | None, policy: Path, pull: str
) -> list[str]:
    """buildah's command line: layer cache on, the host's network, and the CA bundle as a
    read-only volume, which buildah mounts for each RUN step and never commits."""
    command = [
        *("buildah", "bud", "--layers", f"--pull={pull}", "--network=host"),
        *("--isolation=oci", "--runtime=runc", f"--signature-policy={policy}"),
        *("-f", spec.dockerfile, "-t", tag, "--build-arg", f"BASE_IMAGE={base}"),
    ]
    for name, value in spec.build_args:
        command += ["--build-arg", f"{name}={value}"]
    if ca_bundle is not None:
        command += ["--volume", f"{ca_bundle}:{IMAGE_CA_BUNDLE}:ro"]
    return [*command, "."]


#: buildah's progress lines echoed while a build runs (the rest goes to its log).
PROGRESS = re.compile(r"^(\[\d+/\d+\] )?(STEP \d+/\d+|COMMIT)")


def _build(store: Store, spec: Spec, tag: str, base: str, pull: str, context: Path) -> float:
    """Build `spec` as `tag`; its seconds. The whole output goes to ``<store>/logs``; the
    steps are echoed, and the log's tail on a failure."""
    command = build_command(
        spec, tag, base, ca_bundle=host_ca_bundle(), policy=store.root / "policy.json", pull=pull
    )
    log = store.root / "logs" / f"{spec.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    _log(f"building {tag} on {base} (log: {log})")
    started = time.monotonic()
    with log.open("w") as out, subprocess.Popen(
        command, cwd=context, env=store.env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    ) as proc:  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if PROGRESS.match(line):
                _log(line.rstrip()[:160])
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
        raise RuntimeError(f"{tail}\nbuilding {spec.name} failed (exit {proc.returncode}): {log}")
    _log(f"built {tag} in {seconds:.0f}s")
    return seconds


def ensure_image(
    name: str,
    *,
    base_image: str | None = None,
    store: Store | None = None,
    context: Path = REPO_ROOT,
) -> ImageRef:
    """The image `name` (a key of `SPECS`), built when no image of its inputs' hash is in the
    store, found in about a second when one is. `base_image` replaces the stand-in base (an
    image the store has, or pulls: a machine that reaches Docker Hub can give the official
    ``python:3.11-slim``); `context`, the repository as the build context."""
    spec = SPECS[name]
    store = store or Store.default()
    ensure_tools()
    store.prepare()
    with procs.file_lock(store.root):
        if base_image is None:
            base, pull = ensure_base(store), "never"
        else:
            base, pull = base_image, "false"  # pulled when missing
            if not store.exists(base):
                store.podman("pull", base)
        key = input_key(spec, store.inspect(base)["Id"], context)
        tag = f"{REPOSITORY}/{name}:{key}"
        seconds = 0.0
        if not store.exists(tag):
            seconds = _build(store, spec, tag, base, pull, context)
            store.prune(f"{REPOSITORY}/{name}", keep=tag)
        info = store.inspect(tag)
    return ImageRef(name, tag, info["Id"], base, round(info["Size"] / 1e6, 1), seconds)


# --------------------------------------------------------------------------------------------
# Running an image


@dataclass(frozen=True)
class RunOptions:
    """How a container runs: its security context, network, mounts and environment."""

    #: ``UID[:GID]``; None: the image's USER.
    user: str | None = None
    #: Supplementary groups (a pod's fsGroup).
    groups: tuple[str, ...] = ()
    read_only: bool = False
    drop_all_capabilities: bool = False
    add_capabilities: tuple[str, ...] = ()
    no_new_privileges: bool = False
    #: ``none`` (no network but loopback) or ``host`` (e.g. a local API server on 127.0.0.1).
    network: str = "none"
    #: podman ``-v`` values: ``HOST:CONTAINER[:ro]``.
    volumes: tuple[str, ...] = ()
    #: Writable empty directories (a pod's emptyDirs), as tmpfs.
    tmpfs: tuple[str, ...] = ()
    shm_size: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    entrypoint: str | None = None
    #: The container's name (to `stop` it); podman makes one up when None.
    name: str | None = None

    @classmethod
    def from_kubernetes(
        cls, pod: Mapping[str, Any], container: Mapping[str, Any] | None = None
    ) -> RunOptions:
        """The options a pod's and its container's securityContext amount to (the
        container's fields win, as in Kubernetes)."""
        merged = {**pod, **(container or {})}
        uid, gid = merged.get("runAsUser"), merged.get("runAsGroup")
        user = None if uid is None else f"{uid}:{gid}" if gid is not None else str(uid)
        capabilities = merged.get("capabilities") or {}
        seccomp = (merged.get("seccompProfile") or {}).get("type", "RuntimeDefault")
        if seccomp != "RuntimeDefault":
            raise ValueError(f"seccompProfile {seccomp}: only RuntimeDefault (podman's) is run")
        return cls(
            user=user,
            groups=(str(pod["fsGroup"]),) if "fsGroup" in pod else (),
            read_only=bool(merged.get("readOnlyRootFilesystem")),
            drop_all_capabilities="ALL" in capabilities.get("drop", []),
            add_capabilities=tuple(capabilities.get("add", [])),
            no_new_privileges=merged.get("allowPrivilegeEscalation") is False,
        )

    def with_(self, **changes: Any) -> RunOptions:
        return dataclasses.replace(self, **changes)

    def flags(self) -> list[str]:
        """podman run's flags for these options."""
        flags = ["--rm", f"--network={self.network}"]
        flags += [f"--user={self.user}"] if self.user else []
        flags += [f"--group-add={group}" for group in self.groups]
        # As Kubernetes: a read-only root has no writable /tmp unless a volume gives one.
        flags += ["--read-only", "--read-only-tmpfs=false"] if self.read_only else []
        flags += ["--cap-drop=ALL"] if self.drop_all_capabilities else []
        flags += [f"--cap-add={capability}" for capability in self.add_capabilities]
        flags += ["--security-opt=no-new-privileges"] if self.no_new_privileges else []
        flags += [f"--volume={volume}" for volume in self.volumes]
        flags += [f"--tmpfs={path}:rw,mode=1777" for path in self.tmpfs]
        flags += [f"--shm-size={self.shm_size}"] if self.shm_size else []
        flags += [f"--env={name}={value}" for name, value in self.env]
        flags += [f"--entrypoint={self.entrypoint}"] if self.entrypoint else []
        flags += [f"--name={self.name}"] if self.name else []
        return flags


def run_command(image: str, argv: Sequence[str], options: RunOptions) -> list[str]:
    """``podman run`` of `argv` (the image's ENTRYPOINT's arguments) in `image`."""
    return ["podman", "run", *options.flags(), image, *argv]


def run(
    image: str,
    argv: Sequence[str] = (),
    options: RunOptions | None = None,
    *,
    timeout: float = 600,
    store: Store | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `argv` in `image` to its end; its exit code and output (not checked)."""
    store = store or Store.default()
    command = run_command(image, argv, options or RunOptions())
    return subprocess.run(
        command, env=store.env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def popen(
    image: str,
    argv: Sequence[str],
    options: RunOptions,
    *,
    store: Store | None = None,
    **kwargs: Any,
) -> subprocess.Popen[Any]:
    """Start `argv` in `image` and return at once (a server: the operator). Give the options a
    name and `stop` it by that name; `kwargs` go to Popen (stdout, stderr, ...)."""
    store = store or Store.default()
    return subprocess.Popen(run_command(image, argv, options), env=store.env(), **kwargs)


def stop(name: str, *, timeout: int = 10, store: Store | None = None) -> None:
    """Stop the container `name` (SIGTERM, then SIGKILL after `timeout` s); gone already is fine."""
    store = store or Store.default()
    store.podman("stop", f"--time={timeout}", "--ignore", name, check=False)
