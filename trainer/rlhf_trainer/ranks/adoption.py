"""Actors that outlive their driver, so that an in-place restart adopts them (design decision 5).

When the operator restarts a failed or hung driver in place, the Ray cluster and its nodes are
still there, and so are the actors if they are *detached*: starting them again (importing torch
and DeepSpeed, building the ZeRO-3 engines and the rollout engines) is most of a restart's time.
So every actor of a run is named and detached, in a Ray namespace of its own job and job spec
(`ray_namespace`): a later driver of the same job and spec finds them by name, checks that they
answer (`adoption_timeout_s`), loads the checkpoint into them and carries on; a changed spec gets
another namespace and never adopts old actors. It kills them instead
(`kill_actors_of_other_specs`): left alive, they would hold the role's Ray resources, and the new
attempt's actors would wait for them forever (a trainer image whose spec model gained a field
restarts under another digest, for one).

Ownership rule: a driver that exits on its own (success, any error, a stop signal) kills its
job's actors (`kill_job_actors`), since an error may have left an actor broken. Only a driver
that dies without running its cleanup (SIGKILL, or `ray job stop` escalating to it) leaves them
behind for the next attempt; if none comes, they go with the RayCluster.

This module imports only the standard library and `rlhfjob` (the driver uses it before Ray).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from collections.abc import Callable, Iterable, Mapping

from rlhfjob import contract
from rlhfjob.api import RLHFJob, RLHFJobSpec

ENV_ADOPT_TIMEOUT = "RLHF_ADOPT_TIMEOUT_S"
"""Seconds a previous attempt's actors have to answer before the driver starts cold instead."""
DEFAULT_ADOPT_TIMEOUT_S = 5.0
_NAMESPACE_PREFIX = "rlhfjob-"
_MAX_NAMESPACE_LENGTH = 120
_DIGEST_LENGTH = 12


def spec_json(spec: RLHFJobSpec) -> str:
    """The spec as the actors receive it (and as its digest is taken)."""
    return spec.model_dump_json(by_alias=True)


def spec_digest(json_text: str) -> str:
    """A short fingerprint of a job spec's JSON: adopted actors must carry the same one."""
    return hashlib.sha256(json_text.encode()).hexdigest()[:_DIGEST_LENGTH]


def ray_namespace(job: RLHFJob, environ: Mapping[str, str]) -> str:
    """The Ray namespace of one job and spec: ``rlhfjob-<namespace>-<name>-<spec digest>``.

    The job is named by ``$RLHF_JOB_NAMESPACE``/``$RLHF_JOB_NAME`` of `environ` (a pod
    environment, `contract.PodEnv`); see `namespace_of`.
    """
    pod = contract.PodEnv.from_env(environ)
    return namespace_of(job, pod.job_name, pod.job_namespace)


def namespace_of(job: RLHFJob, job_name: str | None, job_namespace: str | None) -> str:
    """The Ray namespace of one job and spec, named by the operator's job name and namespace,
    else (a local run) by its checkpoint directory, so two runs never share actors."""
    name, namespace = job_name, job_namespace
    base = f"{namespace}-{name}" if name and namespace else str(contract.checkpoint_dir(job))
    base = re.sub(r"[^a-z0-9]+", "-", base.lower()).strip("-")
    digest = spec_digest(spec_json(job.spec))
    room = _MAX_NAMESPACE_LENGTH - len(_NAMESPACE_PREFIX) - len(digest) - 1
    return f"{_NAMESPACE_PREFIX}{base[-room:].lstrip('-')}-{digest}"


def adoption_timeout_s(environ: Mapping[str, str]) -> float:
    """How long adoption waits for every actor to answer (``$RLHF_ADOPT_TIMEOUT_S``)."""
    value = environ.get(ENV_ADOPT_TIMEOUT)
    return float(value) if value else DEFAULT_ADOPT_TIMEOUT_S


def other_spec_namespaces(own: str, namespaces: Iterable[str]) -> set[str]:
    """The namespaces among `namespaces` of the job of namespace `own` under another spec:
    the same job part, another digest (`namespace_of`). Another job whose name only begins
    with this one's (``job`` and ``job-b``) has more than a digest after the shared part."""
    base, _, _ = own.rpartition("-")
    digest = re.compile(rf"{re.escape(base)}-[0-9a-f]{{{_DIGEST_LENGTH}}}")
    return {ns for ns in namespaces if ns != own and digest.fullmatch(ns)}


def kill_actors_of_other_specs(
    log: Callable[[str], None] | None = None, own: str | None = None
) -> int:
    """Kill the named actors this job's earlier attempts left under another spec (another
    namespace, `other_spec_namespaces` of `own`, the driver's namespace by default); returns
    how many."""
    import ray

    own = own if own is not None else ray.get_runtime_context().namespace
    found = ray.util.list_named_actors(all_namespaces=True)
    stale = other_spec_namespaces(own, {actor["namespace"] for actor in found})
    killed = 0
    for actor in found:
        if actor["namespace"] in stale:
            with contextlib.suppress(ValueError):  # gone meanwhile
                handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
                ray.kill(handle, no_restart=True)
                killed += 1
    if killed and log is not None:
        log(f"killed {killed} actors an earlier attempt left under another spec")
    return killed


def kill_job_actors(log: Callable[[str], None] | None = None, timeout_s: float = 30.0) -> int:
    """Kill every named actor in the driver's Ray namespace (this job's); returns how many.

    Waits (at most `timeout_s`) until their names are free again, so that new actors can take
    them: Ray releases a name only once its actor is dead.
    """
    import ray

    names = ray.util.list_named_actors()
    for name in names:
        try:
            ray.kill(ray.get_actor(name), no_restart=True)
        except ValueError:  # gone meanwhile
            continue
    if names and log is not None:
        log(f"killed {len(names)} actors left by an earlier attempt")
    deadline = time.monotonic() + timeout_s
    while names and ray.util.list_named_actors() and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(names)
