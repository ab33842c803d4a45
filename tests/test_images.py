"""The images: buildable from the same Dockerfiles here (a stand-in base, buildah) and for users
(`docker build`), non-root as their deployments run them, every dependency pinned with its hash,
no build-time CA in a layer; and the pure parts of `rlhf_local.images` (what an image's cache
key is made of, the configuration it writes, how a pod's security context becomes podman's
flags). The builds themselves and the smoke checks are the `images` tier (`task images`)."""

from __future__ import annotations

import re
import resource
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from rlhf_local import image_checks, images
from rlhf_local.images import RunOptions, Spec

ROOT = Path(__file__).parent.parent
DOCKERFILES = {"operator": "images/operator/Dockerfile", "trainer": "images/trainer/Dockerfile"}
#: Requirements file → the pyproject extras it pins, and the extra requirements lock.sh adds.
LOCKS = {
    "images/operator/requirements.txt": (["operator"], []),
    "images/trainer/requirements-gpu.txt": (["trainer", "tracking"], ["vllm"]),
    "images/trainer/requirements-cpu.txt": (["trainer", "tracking"], []),
}
#: Users and groups Debian's base-passwd ships (the official Python images are Debian): an image
#: user of one of these names fails `useradd` (`group operator exists`).
_DEBIAN_NAMES = """root daemon bin sys sync games man lp mail news uucp proxy www-data backup
    list irc gnats nobody adm tty disk kmem dialout fax voice cdrom floppy tape sudo audio dip
    operator src shadow utmp video sasl plugdev staff users nogroup"""
DEBIAN_SYSTEM_NAMES = set(_DEBIAN_NAMES.split())


def _text(path: str) -> str:
    return (ROOT / path).read_text()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: str) -> dict[str, str]:
    pins = {}
    for line in _text(path).splitlines():
        if match := re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==(\S+)", line):
            pins[_canonical(match.group(1))] = match.group(2)
    return pins


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each line, continuations joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", _text(dockerfile))
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in lines
        if line and not line.startswith("#")
    ]


# --------------------------------------------------------------------------------------------
# The Dockerfiles


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_the_base_is_a_build_argument_whose_default_is_the_official_python_image(image):
    instructions = _instructions(DOCKERFILES[image])
    assert instructions[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")
    stages = [args.split()[2] for kind, args in instructions if kind == "FROM" and " AS " in args]
    for kind, args in instructions:
        if kind == "FROM":
            assert args.split()[0] == "${BASE_IMAGE}", args  # never a registry we cannot reach
        if kind == "COPY" and "--from=" in args:
            assert args.split("--from=")[1].split()[0] in stages


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_the_image_runs_as_a_non_root_uid_whose_names_debian_does_not_have(image):
    instructions = _instructions(DOCKERFILES[image])
    users = [args for kind, args in instructions if kind == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:\d+", users[-1]), users  # numeric: runAsNonRoot
    for kind, args in instructions:
        for command in re.findall(r"\b(?:useradd|groupadd)\b[^&;]*", args) if kind == "RUN" else []:
            words = shlex.split(command)
            assert "--user-group" not in words  # a group named after the user: it may exist
            assert words[-1] not in DEBIAN_SYSTEM_NAMES, command
    assert not any("chown" in args for _, args in instructions), "the user must not own the code"


def test_each_image_runs_as_the_user_its_deployment_gives_it():
    deployment = _text("charts/rlhfjob/templates/deployment.yaml")
    uid = re.search(r"runAsUser: (\d+)", deployment)
    gid = re.search(r"runAsGroup: (\d+)", deployment)
    assert uid and gid
    operator_user = [a for k, a in _instructions(DOCKERFILES["operator"]) if k == "USER"][-1]
    assert operator_user == f"{uid[1]}:{gid[1]}"
    head = head_pod(image_checks.smoke_job())
    security = head["securityContext"]
    trainer_user = [a for k, a in _instructions(DOCKERFILES["trainer"]) if k == "USER"][-1]
    assert trainer_user == f"{security['runAsUser']}:{security['runAsGroup']}"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_every_download_is_pinned_with_its_hash_and_the_project_brings_no_other(image):
    runs = [args for kind, args in _instructions(DOCKERFILES[image]) if kind == "RUN"]
    installs = [cmd for run in runs for cmd in re.findall(r"pip (?:install|wheel)[^&]*", run)]
    assert installs
    for command in installs:
        if " -r " in command:
            assert "--require-hashes" in command and "--no-deps" in command, command
        else:  # the project's own wheel: its dependencies are all in the locks
            assert "--no-deps" in command, command
    assert any("pip check" in run for run in runs)
    assert any("--only-binary :all:" in run for run in runs)  # sources only where named


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_no_certificate_or_secret_goes_into_the_image(image):
    instructions = _instructions(DOCKERFILES[image])
    for kind, args in instructions:
        if kind in ("COPY", "ADD"):
            assert not re.search(r"\.(crt|pem|key)\b|pip\.conf|netrc", args), args
        if kind == "ARG":
            assert not re.search(r"CERT|TOKEN|SECRET|PASSWORD|KEY", args, re.IGNORECASE), args
    # pip trusts the image's own bundle, which the tests' builds cover with the host's, read-only.
    certs = set(re.findall(r"PIP_CERT=(\S+)", _text(DOCKERFILES[image])))
    assert certs == {images.IMAGE_CA_BUNDLE}


def test_the_build_context_sends_what_the_dockerfiles_copy_and_no_more():
    ignore = [line for line in _text(".dockerignore").splitlines() if not line.startswith("#")]
    assert ignore[0] == "*"  # an allow-list: a checkout's .venv is gigabytes
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    for spec in images.SPECS.values():
        sources = images.copied_sources(_text(spec.dockerfile), dict(spec.build_args))
        assert sources
        for source in sources:
            assert (ROOT / source).exists(), source
            assert source.split("/")[0] in allowed, source
    for pattern in ("**/__pycache__", "**/*.pyc", "**/*.egg-info"):
        assert pattern in ignore


# --------------------------------------------------------------------------------------------
# The locks


def test_the_locks_pin_every_dependency_as_pyproject_asks():
    extras = tomllib.loads(_text("pyproject.toml"))["project"]["optional-dependencies"]
    for lock, (lock_extras, added) in LOCKS.items():
        pins = _pins(lock)
        for extra in lock_extras:
            for requirement in extras[extra]:
                match = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$", requirement)
                assert match, requirement
                name, spec = _canonical(match.group(1)), match.group(3).split(";")[0].strip()
                assert name in pins, f"{lock}: {name} is not pinned: run images/lock.sh"
                if spec.startswith("=="):
                    assert pins[name] == spec[2:], f"{lock}: {name} {pins[name]}, pyproject {spec}"
        for name in added:
            assert name in pins, f"{lock}: {name}"


def test_the_cpu_trainer_is_the_gpu_trainers_pins_without_vllm():
    cpu, gpu = (
        _pins("images/trainer/requirements-cpu.txt"),
        _pins("images/trainer/requirements-gpu.txt"),
    )
    assert "vllm" not in cpu and "vllm" in gpu
    assert {name: gpu[name] for name in cpu} == cpu


@pytest.mark.parametrize("lock", [*LOCKS, "images/build-requirements.txt"])
def test_every_pin_carries_its_hash(lock):
    entries = re.split(r"\n(?=[A-Za-z0-9])", _text(lock).split("\n", 1)[1])
    assert entries
    for entry in entries:
        assert re.match(r"^[A-Za-z0-9_.\-]+==\S+ \\", entry), entry[:80]
        assert "--hash=sha256:" in entry, entry[:80]


def test_the_build_tools_are_pip_and_the_backend_pyproject_names():
    pins = _pins("images/build-requirements.txt")
    assert set(pins) == {"pip", "setuptools"}
    backend = tomllib.loads(_text("pyproject.toml"))["build-system"]["requires"]
    floor = re.match(r"setuptools>=(\d+)", backend[0])
    assert floor and int(pins["setuptools"].split(".")[0]) >= int(floor[1])


# --------------------------------------------------------------------------------------------
# rlhf_local.images: keys, configuration, commands


def fake_context(tmp_path: Path) -> Path:
    (tmp_path / "src" / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "a.py").write_text("A = 1\n")
    (tmp_path / "src" / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "req-cpu.txt").write_text("x==1\n")
    (tmp_path / "unused.txt").write_text("not copied\n")
    (tmp_path / "Dockerfile").write_text(
        "ARG BASE_IMAGE=python:3.11-slim\nFROM ${BASE_IMAGE} AS build\nARG VARIANT=gpu\n"
        "COPY --chown=0:0 src /src\nCOPY req-${VARIANT}.txt \\\n  /tmp/\n"
        "FROM ${BASE_IMAGE}\nCOPY --from=build /src /src\n"
    )
    return tmp_path


def test_the_copied_sources_expand_build_arguments_and_skip_other_stages(tmp_path):
    text = fake_context(tmp_path).joinpath("Dockerfile").read_text()
    assert images.copied_sources(text, {"VARIANT": "cpu"}) == ["src", "req-cpu.txt"]
    assert images.copied_sources(text, {}) == ["src", "req-gpu.txt"]
    files = images.context_files(["src", "req-cpu.txt"], tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["req-cpu.txt", "src/pkg/a.py"]


def test_the_cache_key_changes_with_every_input_and_nothing_else(tmp_path):
    root = fake_context(tmp_path)
    spec = Spec("x", "Dockerfile", (("VARIANT", "cpu"),))
    key = images.input_key(spec, "sha256:base", root)
    assert images.input_key(spec, "sha256:base", root) == key
    (root / "unused.txt").write_text("changed\n")
    (root / "src" / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\1")
    assert images.input_key(spec, "sha256:base", root) == key
    assert images.input_key(spec, "sha256:other-base", root) != key
    assert images.input_key(Spec("x", "Dockerfile", (("VARIANT", "gpu"),)), "b", root) != key
    (root / ".dockerignore").write_text("*\n")
    changed = images.input_key(spec, "sha256:base", root)
    assert changed != key
    (root / "src" / "pkg" / "a.py").write_text("A = 2\n")
    assert images.input_key(spec, "sha256:base", root) != changed


def test_the_store_configuration_is_valid_toml_within_this_process_limits(tmp_path):
    storage = tomllib.loads(images.storage_conf(tmp_path / "storage", tmp_path / "run"))
    assert storage["storage"] == {
        "driver": "overlay",
        "graphroot": str(tmp_path / "storage"),
        "runroot": str(tmp_path / "run"),
    }
    nofile, nproc = images.rlimits()
    for which, value in ((resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_NPROC, nproc)):
        hard = resource.getrlimit(which)[1]
        assert hard == resource.RLIM_INFINITY or value <= hard
    assert nproc <= 32768
    conf = tomllib.loads(images.containers_conf(tmp_path / "tmp", nofile, nproc))
    assert conf["containers"]["default_ulimits"] == [
        f"nofile={nofile}:{nofile}",
        f"nproc={nproc}:{nproc}",
    ]
    assert conf["engine"]["runtime"] == "runc"
    assert conf["engine"]["cgroup_manager"] == "cgroupfs"
    tomllib.loads(images.REGISTRIES_CONF)


def test_a_store_points_podman_and_buildah_at_its_own_files(tmp_path):
    store = images.Store(tmp_path / "images")
    env = store.env()
    for variable in ("CONTAINERS_CONF", "CONTAINERS_STORAGE_CONF", "CONTAINERS_REGISTRIES_CONF"):
        assert env[variable].startswith(str(store.root))
    assert env["TMPDIR"] == str(store.root / "tmp")
    assert store.runroot != images.Store(tmp_path / "other").runroot


def test_the_build_mounts_the_host_ca_bundle_read_only_for_the_build_only(tmp_path):
    bundle = tmp_path / "ca.crt"
    command = images.build_command(
        images.SPECS["trainer"], "localhost/rlhfjob/trainer:k", "localhost/base:b",
        ca_bundle=bundle, policy=tmp_path / "policy.json", pull="never",
    )  # fmt: skip
    assert command[:3] == ["buildah", "bud", "--layers"]
    assert "--network=host" in command and "--pull=never" in command
    volume = command[command.index("--volume") + 1]
    assert volume == f"{bundle}:{images.IMAGE_CA_BUNDLE}:ro"
    build_args = [command[i + 1] for i, word in enumerate(command) if word == "--build-arg"]
    assert build_args == ["BASE_IMAGE=localhost/base:b", "VARIANT=cpu"]
    assert command[-1] == "."


def test_the_stand_in_base_is_debian_minbase_with_python_3_11():
    command = images.base_command("out.tar")
    assert command[0] == "mmdebstrap" and "--variant=minbase" in command
    assert images.DEBIAN_SUITE == "bookworm"  # Python 3.11, the locks' version
    assert {"python3", "python3-venv", "ca-certificates"} <= set(images.BASE_PACKAGES)
    assert images.base_tag() == images.base_tag()
    assert images.base_tag().startswith("localhost/rlhfjob/base:bookworm-")


# --------------------------------------------------------------------------------------------
# Security contexts as podman's flags


def test_the_charts_security_context_becomes_podmans_flags():
    options = RunOptions.from_kubernetes(
        {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
         "seccompProfile": {"type": "RuntimeDefault"}},
        {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
         "capabilities": {"drop": ["ALL"]}},
    )  # fmt: skip
    flags = options.flags()
    for flag in ("--user=65532:65532", "--group-add=65532", "--read-only", "--cap-drop=ALL"):
        assert flag in flags
    assert "--security-opt=no-new-privileges" in flags
    assert "--read-only-tmpfs=false" in flags  # no writable /tmp the pod would not have
    assert "--network=none" in flags
    with pytest.raises(ValueError, match="seccompProfile"):
        RunOptions.from_kubernetes({"seccompProfile": {"type": "Unconfined"}})
    command = images.run_command("img", ["--help"], options.with_(name="op", network="host"))
    assert command[:2] == ["podman", "run"] and command[-2:] == ["img", "--help"]
    assert "--name=op" in command and "--network=host" in command


def head_pod(document: dict) -> dict:
    from rlhf_operator.builder import build_ray_cluster
    from rlhfjob.config import parse_job

    cluster = build_ray_cluster(parse_job(document))
    return dict(cluster["spec"]["headGroupSpec"]["template"]["spec"])


def test_the_trainer_smoke_runs_as_its_head_pod_would(tmp_path):
    document = image_checks.smoke_job()
    assert document["spec"]["algorithm"]["totalSteps"] == image_checks.SMOKE_STEPS
    options = image_checks.head_pod_options(document, tmp_path)
    assert options.user == "1000:100" and options.read_only and options.drop_all_capabilities
    assert options.no_new_privileges and options.network == "none"
    assert {"/tmp", "/home/ray/.cache", "/home/ray/.triton"} <= set(options.tmpfs)
    assert options.volumes == (f"{tmp_path}:/etc/rlhfjob:ro",)
    job = yaml.safe_load((tmp_path / "job.yaml").read_text())
    assert job["spec"]["algorithm"]["totalSteps"] == image_checks.SMOKE_STEPS
    env = dict(options.env)
    assert env["RLHF_JOB_CONFIG"] == "/etc/rlhfjob/job.yaml"
    assert env["RAY_AUTH_MODE"] == "token" and len(env["RAY_AUTH_TOKEN"]) == 32


def test_a_copied_context_has_the_checkouts_key_until_a_source_changes(tmp_path):
    spec = images.SPECS["trainer"]
    copy = image_checks.copy_context([spec], tmp_path / "context")
    assert images.input_key(spec, "base", copy) == images.input_key(spec, "base")
    assert not (copy / ".venv").exists() and (copy / spec.dockerfile).is_file()
    edited = image_checks.copy_context([spec], tmp_path / "edited", source=copy)
    with (edited / image_checks.EDITED_SOURCE).open("a") as file:
        file.write("# a change\n")
    assert images.input_key(spec, "base", edited) != images.input_key(spec, "base", copy)
