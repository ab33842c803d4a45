"""`task images`: build both images (`rlhf_local.images`), smoke-check each, print their sizes.

The checks run each image as Kubernetes would, under the security context its deployment gives
it, with no network:

* operator: ``rlhfjob --help`` and ``rlhfjob operator --help``; the operator's imports; and,
  under the chart's securityContext (``helm template``): a non-root uid and gid, no capability,
  no-new-privileges, a read-only root. Its USER is numeric and not root (``runAsNonRoot``).
* trainer: ``rlhfjob train`` of a tiny CPU job (examples/grpo-tiny-colocated-cpu.yaml, 3 steps)
  in the head pod the operator renders for it: its securityContext, its emptyDirs (tmpfs), its
  job ConfigMap (a read-only file), its environment and a Ray token as KubeRay passes one. It
  must end with the final status ``Succeeded``.
* trainer-gpu (on request: the Dockerfile's default, with vLLM): what a GPU job imports.
* each: the image's CA bundle is its base's, byte for byte (the host's, mounted for the build,
  is in no layer).

A check's pass is remembered per image tag (``<store>/checks/``): a warm run checks nothing
again. ``task test`` builds in the background during lint and the unit tier, at nice 19, and
its ``images`` tier waits for that build and runs the checks::

    python -m rlhf_local.image_checks [--only NAME] [--base-image IMAGE] [--recheck]
    python -m rlhf_local.image_checks --background | --wait | --stop
    python -m rlhf_local.image_checks --measure --results benchmarks/results/images.json

``--measure`` builds in a fresh, empty store (cold: no base, no layers; pip keeps no cache),
then again (warm), checks each image and writes the figures; it leaves the usual store alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from rlhf_local import images, procs
from rlhf_local.images import ImageRef, RunOptions, Store
from rlhf_local.paths import REPO_ROOT

#: The tiny job the trainer image runs, cut to a few steps.
SMOKE_JOB = REPO_ROOT / "examples" / "grpo-tiny-colocated-cpu.yaml"
SMOKE_STEPS = 3
#: What `--measure` changes in a copy of the build context: a source file of both images.
EDITED_SOURCE = "cli/rlhfjob_cli/__main__.py"
#: The background build's log, pid file and exit status.
STATE_DIR = REPO_ROOT / ".local"

OPERATOR_PROBE = """
import json, os
import kopf, kubernetes, rlhf_operator.handlers, rlhfjob_cli  # what `rlhfjob operator` loads
status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)
root = [l.split()[3] for l in open('/proc/self/mounts') if l.split()[1] == '/'][-1]
print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'caps': status['CapEff'].strip(),
                  'no_new_privs': status['NoNewPrivs'].strip(), 'root': root.split(',')[0]}))
"""


def _log(message: str) -> None:
    print(f"[images] {message}", file=sys.stderr, flush=True)


def _expect(ok: bool, what: str, result: subprocess.CompletedProcess[str] | None = None) -> None:
    if not ok:
        output = "" if result is None else (result.stdout + result.stderr)[-3000:]
        raise AssertionError(f"{what}\n{output}")


# --------------------------------------------------------------------------------------------
# The checks


def operator_options() -> RunOptions:
    """The chart's securityContext for the operator, from `helm template` of the chart."""
    from rlhf_local import operator_process  # helm and the chart's values

    pod = operator_process.chart_deployment()["spec"]["template"]["spec"]
    container = pod["containers"][0]
    options = RunOptions.from_kubernetes(pod["securityContext"], container.get("securityContext"))
    empty_dirs = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
    mounts = container.get("volumeMounts", [])
    return options.with_(tmpfs=tuple(m["mountPath"] for m in mounts if m["name"] in empty_dirs))


def check_user(store: Store, ref: ImageRef) -> None:
    """The image's USER is a uid (runAsNonRoot can verify only a number) and not root."""
    user = store.inspect(ref.tag)["Config"].get("User", "")
    uid = user.split(":")[0]
    _expect(uid.isdigit() and uid != "0", f"{ref.name}: USER {user!r} is not a non-root uid")


def check_ca_bundle(store: Store, ref: ImageRef) -> None:
    """The image's CA bundle is its base's: the host's, mounted for the build, left nothing."""
    argv = [images.IMAGE_CA_BUNDLE]
    options = RunOptions(entrypoint="sha256sum", user="0")
    digests = [images.run(tag, argv, options, store=store) for tag in (ref.tag, ref.base)]
    for result in digests:
        _expect(result.returncode == 0, f"{ref.name}: sha256sum of the CA bundle", result)
    _expect(digests[0].stdout == digests[1].stdout, f"{ref.name}: the CA bundle is not the base's")


def smoke_operator(store: Store, ref: ImageRef) -> None:
    """`--help`, the imports, and the chart's security context in force."""
    options = operator_options()
    for argv in (["--help"], ["operator", "--help"]):
        result = images.run(ref.tag, argv, options, store=store, timeout=120)
        _expect(result.returncode == 0 and "usage:" in result.stdout, f"rlhfjob {argv}", result)
    probe = options.with_(entrypoint="python")
    result = images.run(ref.tag, ["-c", OPERATOR_PROBE], probe, store=store, timeout=120)
    _expect(result.returncode == 0, "the operator's imports", result)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    uid, _, gid = (options.user or "").partition(":")
    _expect(options.read_only and options.drop_all_capabilities, "the chart's securityContext")
    _expect(str(seen["uid"]) == uid and uid != "0", f"runs as uid {seen['uid']}, not {uid}")
    _expect(not gid or str(seen["gid"]) == gid, f"runs as gid {seen['gid']}, not {gid}")
    _expect(int(seen["caps"], 16) == 0, f"capabilities left: {seen['caps']}")
    _expect(seen["no_new_privs"] == "1", "no_new_privs is not set")
    _expect(seen["root"] == "ro", f"the root filesystem is mounted {seen['root']}")


def smoke_job(steps: int = SMOKE_STEPS) -> dict[str, Any]:
    """The tiny CPU example, `steps` long, a checkpoint on the way."""
    document = yaml.safe_load(SMOKE_JOB.read_text())
    document["spec"]["algorithm"]["totalSteps"] = steps
    document["spec"]["checkpoint"]["intervalSteps"] = max(1, steps - 1)
    return dict(document)


def head_pod_options(document: dict[str, Any], config_dir: Path) -> RunOptions:
    """The head pod the operator renders for `document`, as podman options: its security
    context, emptyDirs as tmpfs, the job ConfigMap's files (written to `config_dir`) read-only,
    its literal environment, and the Ray token KubeRay passes."""
    from rlhf_operator.builder import build_config_map, build_ray_cluster
    from rlhfjob.config import parse_job
    from rlhfjob.contract import ENV_JOB_NAME, ENV_JOB_NAMESPACE

    job = parse_job(document)
    pod = build_ray_cluster(job)["spec"]["headGroupSpec"]["template"]["spec"]
    container = pod["containers"][0]
    security = pod.get("securityContext", {})
    options = RunOptions.from_kubernetes(security, container.get("securityContext"))
    config_dir.chmod(0o755)  # the pod's user reads it
    for name, text in build_config_map(job)["data"].items():
        (config_dir / name).write_text(text)
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    tmpfs, binds, shm = [], [], None
    for mount in container["volumeMounts"]:
        volume, path = volumes[mount["name"]], mount["mountPath"]
        if "emptyDir" in volume and path == "/dev/shm":
            shm = "1g"
        elif "emptyDir" in volume:
            tmpfs.append(path)
        elif "configMap" in volume:
            binds.append(f"{config_dir}:{path}:ro")
        else:
            raise ValueError(f"the smoke pod's volume {mount['name']}: no emptyDir or ConfigMap")
    # Not the job's name: with it the driver keeps its heartbeat Lease, and no API server is here.
    apart = (ENV_JOB_NAME, ENV_JOB_NAMESPACE)
    env = [(e["name"], e["value"]) for e in container.get("env", []) if "value" in e]
    env = [(name, value) for name, value in env if name not in apart]
    env += [("RAY_AUTH_MODE", "token"), ("RAY_AUTH_TOKEN", secrets.token_hex(16))]
    env += [("RAY_USAGE_STATS_ENABLED", "0")]
    return options.with_(tmpfs=tuple(tmpfs), volumes=tuple(binds), shm_size=shm, env=tuple(env))


def smoke_trainer(store: Store, ref: ImageRef) -> None:
    """`rlhfjob train` of the tiny job in its head pod's conditions ends Succeeded."""
    from rlhfjob.contract import ExitReason, FinalStatus

    with tempfile.TemporaryDirectory(prefix="rlhfjob-smoke-") as config_dir:
        options = head_pod_options(smoke_job(), Path(config_dir))
        result = images.run(ref.tag, ["rlhfjob", "train"], options, store=store, timeout=600)
    output = result.stdout + result.stderr
    status = FinalStatus.parse(output)
    succeeded = status is not None and status.reason == ExitReason.SUCCEEDED
    _expect(result.returncode == 0 and succeeded, "rlhfjob train did not succeed", result)
    _expect(f"step {SMOKE_STEPS}/{SMOKE_STEPS}" in output, "no last step in the output", result)


def smoke_gpu_trainer(store: Store, ref: ImageRef) -> None:
    """No GPU here: what a GPU job imports (vLLM among them), in the head pod's conditions."""
    with tempfile.TemporaryDirectory(prefix="rlhfjob-smoke-") as config_dir:
        options = head_pod_options(smoke_job(), Path(config_dir)).with_(entrypoint="python")
        argv = ["-c", "import torch, deepspeed, ray, vllm, rlhf_trainer.run.driver"]
        result = images.run(ref.tag, argv, options, store=store, timeout=600)
    _expect(result.returncode == 0, "the GPU trainer's imports", result)


SMOKES = {"operator": smoke_operator, "trainer": smoke_trainer, "trainer-gpu": smoke_gpu_trainer}


def smoke(store: Store, ref: ImageRef, *, again: bool = False) -> tuple[str, float]:
    """Check `ref` (unless it passed before and not `again`): ("passed" or the failure, the
    seconds it took; 0 when remembered)."""
    record = store.root / "checks" / f"{ref.tag.rpartition('/')[2].replace(':', '-')}.json"
    if not again and record.exists():
        return json.loads(record.read_text())["smoke"], 0.0
    started = time.monotonic()
    check_user(store, ref)
    check_ca_bundle(store, ref)
    checks = SMOKES.get(ref.name)
    if checks is not None:
        checks(store, ref)
    seconds = time.monotonic() - started
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"smoke": "passed", "seconds": round(seconds, 1)}) + "\n")
    return "passed", seconds


# --------------------------------------------------------------------------------------------
# `task images`, the background build, the measurement


def build_and_check(
    names: Sequence[str], *, base_image: str | None, again: bool, store: Store | None = None
) -> int:
    """Ensure and check each image; a table of sizes and times. Non-zero if a check failed."""
    store = store or Store.default()
    rows, failed = [], 0
    for name in names:
        ref = images.ensure_image(name, base_image=base_image, store=store)
        try:
            result, seconds = smoke(store, ref, again=again)
        except AssertionError as error:
            _log(f"{name}: check FAILED: {error}")
            result, seconds, failed = f"FAILED: {error}", 0.0, failed + 1
        rows.append(f"{name:12} {ref.size_mb:9.0f} {ref.build_seconds:7.0f} {seconds:7.0f}  "
                    f"{result.splitlines()[0]}  {ref.tag}")  # fmt: skip
    print(f"{'image':12} {'size MB':>9} {'build s':>7} {'check s':>7}  check  tag")
    print("\n".join(rows), flush=True)
    return 1 if failed else 0


def _state_files(state: Path) -> tuple[Path, Path, Path]:
    return state / "images.log", state / "images.pid", state / "images.rc"


def start_background(
    names: Sequence[str], base_image: str | None = None, state: Path = STATE_DIR
) -> int:
    """Build `names` detached (its own session, nice 19); `wait_background` collects it."""
    log, pid_file, rc_file = _state_files(state)
    procs.stop(pid_file)
    rc_file.unlink(missing_ok=True)
    log.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "rlhf_local.image_checks",
        "--build-only",
        "--status-file",
        str(rc_file),
    ]
    argv += [f"--only={name}" for name in names]
    argv += [f"--base-image={base_image}"] if base_image else []
    pid = procs.start("images", argv, log_dir=state, pid_dir=state, cwd=REPO_ROOT)
    _log(f"building in the background (pid {pid}), log: {log}")
    return pid


def wait_background(state: Path = STATE_DIR) -> int:
    """Wait for the background build; 0 when it succeeded or none was started."""
    log, pid_file, rc_file = _state_files(state)
    if not pid_file.exists():
        return 0
    started = time.monotonic()
    while not rc_file.exists() and procs.running(pid_file) is not None:
        time.sleep(1)
    status = rc_file.read_text().strip() if rc_file.exists() else ""
    pid_file.unlink(missing_ok=True)
    if status == "0":
        _log(f"the background build finished (waited {time.monotonic() - started:.0f}s for it)")
        return 0
    text = log.read_text(errors="replace") if log.exists() else ""
    print("\n".join(text.splitlines()[-60:]), file=sys.stderr)
    _log(f"the background build failed ({status or 'no exit status'}); log: {log}")
    return 1


def _build_only(names: Sequence[str], base_image: str | None, status_file: Path | None) -> int:
    """The background build: every image, at nice 19; its status written last."""
    with contextlib.suppress(OSError):
        os.nice(19 - os.nice(0))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: locks, staging
    rc = 1
    try:
        for name in names:
            images.ensure_image(name, base_image=base_image)
        rc = 0
    except Exception as error:
        traceback.print_exc()
        _log(f"FAILED: {error}")
    finally:
        if status_file is not None:
            status_file.parent.mkdir(parents=True, exist_ok=True)
            status_file.with_suffix(".tmp").write_text(f"{rc}\n")
            status_file.with_suffix(".tmp").rename(status_file)
    return rc


@contextlib.contextmanager
def fresh_store() -> Iterator[Store]:
    """An empty store beside the usual one (same disk), removed after."""
    parent = Store.default().root.parent
    parent.mkdir(parents=True, exist_ok=True)
    store = Store(Path(tempfile.mkdtemp(prefix="images-cold-", dir=parent)))
    try:
        yield store
    finally:
        store.podman("rmi", "--all", "--force", check=False)
        shutil.rmtree(store.root, ignore_errors=True)
        shutil.rmtree(store.runroot, ignore_errors=True)


def copy_context(specs: Sequence[images.Spec], target: Path, source: Path = REPO_ROOT) -> Path:
    """What `specs` are built from (their Dockerfiles, what they COPY, .dockerignore), copied
    to `target`: a build context no later edit of the checkout changes."""
    files = {source / ".dockerignore"}
    for spec in specs:
        text = (source / spec.dockerfile).read_text()
        sources = images.copied_sources(text, dict(spec.build_args))
        files |= {source / spec.dockerfile, *images.context_files(sources, source)}
    for file in files:
        copy = target / file.relative_to(source)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(file, copy)
    return target


def measure_image(
    store: Store, name: str, base_image: str | None, context: Path, edited: Path
) -> dict[str, Any]:
    """One image's figures: cold, warm, checked, and rebuilt after a source change (`edited`:
    `context` with one source file changed)."""
    cold = images.ensure_image(name, base_image=base_image, store=store, context=context)
    started = time.monotonic()
    warm = images.ensure_image(name, base_image=base_image, store=store, context=context)
    warm_seconds = time.monotonic() - started
    try:
        result, check_seconds = smoke(store, warm, again=True)
    except AssertionError as error:
        result, check_seconds = f"failed: {error}"[:2000], 0.0
    change = images.ensure_image(name, base_image=base_image, store=store, context=edited)
    return {
        "built": True,
        "tag": cold.tag,
        "size_mb": cold.size_mb,
        "build_seconds_cold": round(cold.build_seconds, 1),
        "build_seconds_warm": round(warm_seconds, 1),
        "build_seconds_source_change": round(change.build_seconds, 1),
        "smoke": result,
        "smoke_seconds": round(check_seconds, 1),
        "base": cold.base,
        "build_args": dict(images.SPECS[name].build_args),
    }


def measure(names: Sequence[str], results: Path, base_image: str | None) -> int:
    """Cold and warm builds in a fresh store, the checks, a rebuild after a source change,
    and the figures in `results`."""
    with fresh_store() as store:
        images.ensure_tools()
        store.prepare()
        specs = [images.SPECS[name] for name in names]
        context = copy_context(specs, store.root / "context")  # the checkout as it is now
        edited = copy_context(specs, store.root / "edited", source=context)
        with (edited / EDITED_SOURCE).open("a") as file:
            file.write("# a source change\n")
        started = time.monotonic()
        base = base_image or images.ensure_base(store)
        base_seconds = time.monotonic() - started
        entries = {name: measure_image(store, name, base_image, context, edited) for name in names}
        python = images.run(base, ["python3", "--version"], store=store).stdout.strip()
        base_info = {"image": base, "python": python, "seconds_cold": round(base_seconds, 1),
                     "size_mb": round(store.inspect(base)["Size"] / 1e6, 1)}  # fmt: skip
    write_results(results, base_info, entries, base_image)
    return 0 if all(e["smoke"] == "passed" for e in entries.values()) else 1


def write_results(
    path: Path, base: dict[str, Any], entries: dict[str, Any], base_image: str | None
) -> None:
    made_of = (
        f"the stand-in for python:3.11-slim: Debian {images.DEBIAN_SUITE} minbase "
        f"(mmdebstrap) with {', '.join(images.BASE_PACKAGES)}"
    )
    document = {
        "benchmark": "images",
        "command": f"python -m rlhf_local.image_checks --measure --results {path}",
        "machine": f"{os.cpu_count()} cores",
        "load_average_at_end": [round(load, 2) for load in os.getloadavg()],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cold": "a fresh image store: no base, no layers, no pip cache (pip runs with "
        "--no-cache-dir); every package downloaded from the index",
        "warm": "the same command again: the image found by its inputs' hash",
        "source_change": f"a rebuild after a change to {EDITED_SOURCE} (buildah's layer cache "
        "keeps the dependency layers)",
        "base": {**base, "made_of": base_image or made_of},
        "images": entries,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    _log(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_local.image_checks",
        description="Build the operator and trainer images (buildah), check them (podman).",
    )
    parser.add_argument("--only", action="append", choices=sorted(images.SPECS), help="repeatable")
    parser.add_argument("--base-image", help="instead of the stand-in: e.g. python:3.11-slim")
    parser.add_argument("--recheck", action="store_true", help="check images that passed before")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--background", action="store_true", help="build detached, at nice 19")
    mode.add_argument("--wait", action="store_true", help="wait for --background, then check")
    mode.add_argument("--stop", action="store_true", help="stop a --background build")
    mode.add_argument("--measure", action="store_true", help="cold and warm, in a fresh store")
    mode.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, help="with --measure: the JSON to write")
    parser.add_argument("--status-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = args.only or list(images.DEFAULT_IMAGES)
    if args.stop:
        procs.stop(_state_files(STATE_DIR)[1], grace=10.0)
        return 0
    if args.background:
        start_background(names, args.base_image)
        return 0
    if args.build_only:
        return _build_only(names, args.base_image, args.status_file)
    if args.measure:
        if args.results is None:
            parser.error("--measure needs --results")
        return measure(names, args.results, args.base_image)
    if args.wait and wait_background() != 0:
        return 1
    try:
        return build_and_check(names, base_image=args.base_image, again=args.recheck)
    except RuntimeError as error:  # no root, no tools, a failed build: its own words suffice
        _log(f"FAILED: {error}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
