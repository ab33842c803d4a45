"""Naming a run's actors so that a restarted driver can adopt them, and the adoption rules."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlhf_trainer.ranks.actors import ZeroWorker
from rlhf_trainer.ranks.adoption import (
    DEFAULT_ADOPT_TIMEOUT_S,
    ENV_ADOPT_TIMEOUT,
    adoption_timeout_s,
    kill_actors_of_other_specs,
    kill_job_actors,
    other_spec_namespaces,
    ray_namespace,
    spec_digest,
    spec_json,
)
from rlhf_trainer.ranks.group import WorkerGroup, rank_name
from rlhf_trainer.rollout.engines import engine_id_from_name, engine_name
from rlhf_trainer.run.startup import adopt, adopt_group, engine_launcher
from rlhfjob.api import ray_resource
from rlhfjob.config import load_job
from rlhfjob.contract import ENV_JOB_NAME, ENV_JOB_NAMESPACE

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-tiny-cpu.yaml"


def test_the_namespace_names_the_job_and_its_spec() -> None:
    job = load_job(EXAMPLE)
    env = {ENV_JOB_NAME: "grpo-tiny", ENV_JOB_NAMESPACE: "team-a"}
    namespace = ray_namespace(job, env)
    digest = spec_digest(spec_json(job.spec))
    assert namespace == f"rlhfjob-team-a-grpo-tiny-{digest}"
    assert ray_namespace(job, env) == namespace  # stable across attempts

    # Another job, or the same job with another spec, never shares actors with it.
    assert ray_namespace(job, {**env, ENV_JOB_NAME: "other"}) != namespace
    changed = job.model_copy(
        update={"spec": job.spec.model_copy(update={"image": "ghcr.io/rlhfjob/trainer:0.2.0"})}
    )
    assert ray_namespace(changed, env) != namespace


def test_the_namespaces_of_the_same_job_under_other_specs_are_told_apart() -> None:
    job = load_job(EXAMPLE)
    env = {ENV_JOB_NAME: "grpo-tiny", ENV_JOB_NAMESPACE: "team-a"}
    own = ray_namespace(job, env)
    changed = ray_namespace(
        job.model_copy(update={"spec": job.spec.model_copy(update={"image": "trainer:0.2"})}), env
    )
    longer_name = ray_namespace(job, {**env, ENV_JOB_NAME: "grpo-tiny-b"})
    other_job = ray_namespace(job, {**env, ENV_JOB_NAME: "other"})
    found = {own, changed, longer_name, other_job, "test-adoption"}
    assert other_spec_namespaces(own, found) == {changed}
    assert other_spec_namespaces(changed, found) == {own}


def test_without_the_operators_env_the_checkpoint_directory_names_the_job() -> None:
    job = load_job(EXAMPLE)
    namespace = ray_namespace(job, {})
    assert namespace.startswith("rlhfjob-tmp-rlhfjob-checkpoints-default-grpo-tiny-")
    other = job.model_copy(
        update={
            "spec": job.spec.model_copy(
                update={"checkpoint": job.spec.checkpoint.model_copy(update={"path": "/elsewhere"})}
            )
        }
    )
    assert ray_namespace(other, {}) != namespace
    assert len(ray_namespace(job, {ENV_JOB_NAME: "x" * 300, ENV_JOB_NAMESPACE: "n"})) <= 120


def test_the_spec_digest_is_short_and_tells_specs_apart() -> None:
    job = load_job(EXAMPLE)
    text = spec_json(job.spec)
    assert len(spec_digest(text)) == 12
    assert spec_digest(text) == spec_digest(text)
    assert spec_digest(text) != spec_digest(text.replace("grpo", "ppo", 1))


def test_actor_names_round_trip() -> None:
    assert rank_name("trainer", 1) == "trainer-rank-1"
    assert engine_name(7) == "rollout-engine-7"
    assert engine_id_from_name(engine_name(7)) == 7
    assert engine_id_from_name("trainer-rank-0") is None
    assert engine_id_from_name("rollout-engine-x") is None


def test_the_adoption_timeout_is_configurable() -> None:
    assert adoption_timeout_s({}) == DEFAULT_ADOPT_TIMEOUT_S
    assert adoption_timeout_s({ENV_ADOPT_TIMEOUT: "1.5"}) == 1.5


# --------------------------------------------------------------------------------------------
# Adopting ranks on a real Ray (stand-in ranks: no DeepSpeed, just the adoption protocol)


def stand_in_rank() -> type[ZeroWorker]:
    """A rank that sets up instantly and can be made busy, as if stuck in a collective.

    Defined in a function so that Ray ships the class by value (workers cannot import tests).
    """

    class StandInRank(ZeroWorker):
        def setup(self, master_addr: str, master_port: int, total_optimizer_steps: int) -> None:
            self.ready = True

        def busy(self) -> None:
            threading.Event().wait()  # until the actor is killed

    return StandInRank


@pytest.fixture(scope="module")
def ray_namespace_of_a_job() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=1,
        resources={ray_resource("trainer"): 2},
        include_dashboard=False,
        log_to_driver=False,
        namespace="test-adoption",
    )
    yield ray
    ray.shutdown()


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
def test_ranks_are_adopted_only_when_all_answer_for_the_same_spec(ray_namespace_of_a_job):
    ray = ray_namespace_of_a_job
    spec = load_job(EXAMPLE).spec  # two trainer ranks
    role = spec.roles.trainer
    group = WorkerGroup(stand_in_rank(), spec, "trainer", role, 1, detached=True).wait_ready()
    try:
        assert sorted(ray.util.list_named_actors()) == ["trainer-rank-0", "trainer-rank-1"]
        adopted = adopt_group(spec, "trainer", role, timeout_s=30)
        assert adopted is not None
        assert [a._actor_id for a in adopted.actors] == [a._actor_id for a in group.actors]

        other = spec.model_copy(update={"image": "ghcr.io/rlhfjob/trainer:0.2.0"})
        assert adopt_group(other, "trainer", role, timeout_s=30) is None
        assert adopt_group(spec, "reference", role, timeout_s=30) is None  # none there

        group.actors[1].busy.remote()  # e.g. still in a collective of the dead driver
        started = time.monotonic()
        assert adopt_group(spec, "trainer", role, timeout_s=1) is None
        assert time.monotonic() - started < 10
    finally:
        assert kill_job_actors() == 2
    assert ray.util.list_named_actors() == []  # the names are free for a cold start


@pytest.mark.slow
def test_a_missing_rank_means_a_cold_start(ray_namespace_of_a_job):
    ray = ray_namespace_of_a_job
    spec = load_job(EXAMPLE).spec
    role = spec.roles.trainer
    group = WorkerGroup(stand_in_rank(), spec, "trainer", role, 1, detached=True).wait_ready()
    try:
        ray.kill(group.actors[0], no_restart=True)
        wait_for(lambda: "trainer-rank-0" not in ray.util.list_named_actors(), 30, "rank 0 gone")
        assert adopt_group(spec, "trainer", role, timeout_s=30) is None
    finally:
        kill_job_actors()


def stand_in_engine() -> Any:
    """A rollout engine actor that answers `ping` with a given tag, or is kept busy."""
    import ray

    class StandInEngine:
        def __init__(self, tag: str) -> None:
            self.tag = tag

        def ping(self) -> str:
            return self.tag

        def busy(self) -> None:
            threading.Event().wait()  # until the actor is killed

    return ray.remote(num_cpus=0)(StandInEngine)


@pytest.mark.slow
def test_a_resumed_driver_adopts_the_ranks_and_the_engines_of_its_spec(ray_namespace_of_a_job):
    ray = ray_namespace_of_a_job
    spec = load_job(EXAMPLE).spec  # two trainer ranks, two rollout engines desired
    launcher = engine_launcher(spec, detached=True)
    assert launcher is not None
    group = WorkerGroup(stand_in_rank(), spec, "trainer", spec.roles.trainer, 1, detached=True)
    group.wait_ready()
    engine = stand_in_engine()
    tags = {0: "stale", 1: launcher.tag, 3: launcher.tag}
    engines = {
        i: engine.options(name=engine_name(i), lifetime="detached").remote(tag)
        for i, tag in tags.items()
    }
    ray.get([actor.ping.remote() for actor in engines.values()])
    engines[3].busy.remote()  # still finishing a generation of the dead driver
    lines: list[str] = []
    try:
        adopted = adopt(spec, launcher, total_steps=4, timeout_s=1, log=lines.append)
        assert adopted is not None and adopted.engines is not None
        assert [a._actor_id for a in adopted.groups.all()[0].actors] == [
            a._actor_id for a in group.actors
        ]
        assert adopted.groups.reference is None and adopted.groups.critic is None
        assert sorted(adopted.engines.actors) == [1, 3]  # the stale one goes
        assert (adopted.engines.answered, adopted.engines.next_id) == (1, 4)
        assert adopted.count == 4
        assert lines == ["adopting 4 actors from the previous attempt"]
        wait_for(lambda: engine_name(0) not in ray.util.list_named_actors(), 30, "engine 0 gone")
    finally:
        kill_job_actors()


@pytest.mark.slow
def test_nothing_is_adopted_when_a_group_is_missing(ray_namespace_of_a_job):
    ray = ray_namespace_of_a_job
    ppo = load_job(EXAMPLE.with_name("ppo-tiny-cpu.yaml")).spec  # needs a critic group too
    launcher = engine_launcher(ppo, detached=True)
    WorkerGroup(stand_in_rank(), ppo, "trainer", ppo.roles.trainer, 1, detached=True).wait_ready()
    lines: list[str] = []
    try:
        assert adopt(ppo, launcher, total_steps=4, timeout_s=1, log=lines.append) is None
        assert lines == ["the previous attempt's critic ranks are missing or do not answer"]
    finally:
        kill_job_actors()
    assert ray.util.list_named_actors() == []
    assert adopt(ppo, launcher, total_steps=4, timeout_s=1, log=print) is None  # nothing there


@pytest.mark.slow
def test_a_driver_kills_what_an_attempt_under_another_spec_left(ray_namespace_of_a_job):
    """Actors of the same job under another spec hold the role's resources: the new attempt
    kills them (they cannot be adopted); another job's actors stay."""
    ray = ray_namespace_of_a_job
    engine = stand_in_engine()
    own, stale, other_job = (
        "rlhfjob-team-a-job-aaaaaaaaaaaa",
        "rlhfjob-team-a-job-bbbbbbbbbbbb",
        "rlhfjob-team-a-job-b-cccccccccccc",
    )
    left = {
        namespace: engine.options(name="trainer-rank-0", namespace=namespace,
                                  lifetime="detached").remote("tag")
        for namespace in (stale, other_job)
    }  # fmt: skip
    ray.get([actor.ping.remote() for actor in left.values()])
    lines: list[str] = []
    try:
        assert kill_actors_of_other_specs(lines.append, own=own) == 1
        assert lines == ["killed 1 actors an earlier attempt left under another spec"]
        wait_for(
            lambda: (
                {a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)}
                == {other_job}
            ),
            30,
            "the other spec's actor gone",
        )
        assert ray.get(left[other_job].ping.remote()) == "tag"
    finally:
        for actor in left.values():
            ray.kill(actor, no_restart=True)
