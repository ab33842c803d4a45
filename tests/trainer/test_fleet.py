"""The elastic rollout fleet: chunking and seeds (pure), and losing / regaining engines (Ray).

The Ray tests run real engine actors and a real 2-rank ZeRO-3 policy group on the CPU. The
engines start from other random weights than the policy, so an engine that generated without
having been synced would sample other tokens: equal samples before and after an engine is lost
and replaced show both the determinism across engine counts and the sync before generating.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlhf_trainer.elastic import Chunk, assign_chunks, plan_chunks, split_evenly
from rlhf_trainer.seeds import derive_seed
from trainer.killing import kill_actor
from trainer.recorder import Recorder

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-tiny-cpu.yaml"


# --------------------------------------------------------------------------------------------
# Chunks and seeds


def test_chunks_cover_the_prompts_in_order_with_sizes_within_one() -> None:
    chunks = plan_chunks(10, 4)
    assert [(c.start, c.stop) for c in chunks] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [c.index for c in chunks] == [0, 1, 2, 3]
    assert split_evenly(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_empty_chunks_are_skipped_but_keep_their_index() -> None:
    chunks = plan_chunks(2, 4)
    assert chunks == [Chunk(0, 0, 1), Chunk(1, 1, 2)]
    assert plan_chunks(0, 3) == []
    with pytest.raises(ValueError):
        plan_chunks(4, 0)


def test_chunk_i_is_always_seeded_from_the_step_seed_and_i() -> None:
    chunk = Chunk(index=3, start=0, stop=2)
    assert chunk.seed(11) == derive_seed(11, 3)
    assert chunk.seed(11) != Chunk(index=2, start=0, stop=2).seed(11)
    assert chunk.seed(None) is None  # unseeded steps stay unseeded


def test_chunks_go_round_robin_to_the_live_engines() -> None:
    chunks = plan_chunks(8, 4)
    assert assign_chunks(chunks, 4) == [0, 1, 2, 3]
    assert assign_chunks(chunks, 3) == [0, 1, 2, 0]
    assert assign_chunks(chunks, 1) == [0, 0, 0, 0]
    with pytest.raises(ValueError):
        assign_chunks(chunks, 0)


def test_the_calls_of_a_step_do_not_depend_on_how_many_engines_live() -> None:
    """The (prompts, seed) of every engine call are the same for 1..desired live engines;
    only which engine makes each call changes."""
    desired, step_seed = 4, 1234

    def calls(live: int) -> tuple[set[tuple[int, int, int | None]], list[int]]:
        chunks = plan_chunks(13, desired)
        positions = assign_chunks(chunks, live)
        return {(c.start, c.stop, c.seed(step_seed)) for c in chunks}, positions

    everything, _ = calls(desired)
    for live in range(1, desired + 1):
        same, positions = calls(live)
        assert same == everything
        assert set(positions) == set(range(min(live, desired)))


# --------------------------------------------------------------------------------------------
# Real engines and a real policy group


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    pytest.importorskip("deepspeed")
    from rlhfjob.api import ray_resource

    ray.init(
        num_cpus=2,
        resources={ray_resource("trainer"): 2, ray_resource("rollout"): 2},
        include_dashboard=False,
        log_to_driver=False,
        namespace="test-fleet",
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def spec(ray_cluster: Any) -> Any:
    from rlhfjob.config import load_job

    spec = load_job(EXAMPLE).spec
    rollout = spec.roles.rollout.model_copy(update={"replicas": 2, "min_replicas": 1})
    roles = spec.roles.model_copy(update={"rollout": rollout})
    return spec.model_copy(update={"roles": roles})


@pytest.fixture(scope="module")
def policy(spec: Any) -> Iterator[Any]:
    from rlhf_trainer.ranks.actors import PolicyWorker
    from rlhf_trainer.ranks.group import WorkerGroup

    group = WorkerGroup(PolicyWorker, spec, "trainer", spec.roles.trainer, 10).wait_ready()
    yield group
    group.shutdown()


@pytest.fixture
def make_fleet(spec: Any, policy: Any) -> Iterator[Callable[..., tuple[Any, Recorder]]]:
    from rlhf_trainer.rollout.engines import EngineLauncher
    from rlhf_trainer.rollout.fleet import RolloutFleet
    from rlhf_trainer.rollout.model_source import ModelSource

    fleets: list[Any] = []

    def make(minimum: int = 1, **options: Any) -> tuple[Any, Recorder]:
        # Engines start from other weights than the policy's: only a sync makes them equal.
        source = ModelSource.from_spec(spec.model, seed=spec.algorithm.seed + 1)
        launcher = EngineLauncher(
            spec.roles.rollout, source, seed=1, engine_options={"num_threads": 1}
        )
        recorder = Recorder()
        fleet = RolloutFleet(
            policy,
            launcher.start,
            desired=2,
            minimum=minimum,
            log=recorder.log,
            on_change=recorder.report,
            **options,
        )
        fleets.append(fleet)
        fleet.start(2)
        fleet.wait_ready(300)
        assert len(fleet.live) == 2
        return fleet, recorder

    yield make
    for fleet in fleets:
        fleet.shutdown()


PROMPTS = [[1 + i, 2 + i, 3] for i in range(8)]


def sampling() -> Any:
    from rlhf_trainer.rollout.base import SamplingParams

    return SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=7)


def tokens(results: list[list[Any]]) -> list[list[tuple[list[int], list[float]]]]:
    return [[(c.token_ids, c.logprobs) for c in completions] for completions in results]


def versions(results: list[list[Any]]) -> set[int]:
    return {c.policy_version for completions in results for c in completions}


@pytest.mark.slow
def test_a_lost_engine_is_replaced_and_the_samples_never_change(ray_cluster, make_fleet):
    ray = ray_cluster
    fleet, recorder = make_fleet()
    fleet.sync(1)
    first = fleet.generate(PROMPTS, sampling())
    assert versions(first) == {1}
    expected = tokens(first)

    # An engine dies: its chunks are sampled again by the survivor, with the same seeds.
    lost = fleet.live[1]
    kill_actor(lost.actor)
    again = fleet.generate(PROMPTS, sampling())
    assert tokens(again) == expected
    assert [engine.id for engine in fleet.live] == [0]
    assert recorder.saw(f"rollout engine {lost.id} lost during generation")
    assert recorder.saw("continuing with 1/2 engines")
    assert recorder.counts[-1] == (1, 2)

    # Training goes on with one engine; the fleet remembers the version for newcomers.
    fleet.sync(2)
    assert tokens(fleet.generate(PROMPTS, sampling())) == expected

    # The next step starts a replacement without waiting, and admits it once it is up.
    fleet.maintain()
    assert recorder.saw("starting rollout engine 2")
    wait_for(lambda: (fleet.maintain(), len(fleet.live) == 2)[1], 300, "the replacement")
    assert [engine.id for engine in fleet.live] == [0, 2]
    assert recorder.saw("rollout engine 2 rejoined; 2/2 engines")
    assert recorder.counts[-1] == (2, 2)
    # Synced before it generates: the trainer's version, and the policy's weights (a fresh
    # engine holds other weights and would sample other tokens).
    assert ray.get([engine.actor.policy_version.remote() for engine in fleet.live]) == [2, 2]
    after = fleet.generate(PROMPTS, sampling())
    assert versions(after) == {2}
    assert tokens(after) == expected


@pytest.mark.slow
def test_an_engine_lost_inside_a_sync_is_dropped_and_the_sync_redone(ray_cluster, make_fleet):
    ray = ray_cluster
    fleet, recorder = make_fleet(sync_timeout_s=5.0)
    fleet.sync(1)
    expected = tokens(fleet.generate(PROMPTS, sampling()))
    fleet._probe = lambda: None  # let the loss surface inside the broadcasts, not before
    kill_actor(fleet.live[0].actor)
    started = time.monotonic()
    fleet.sync(2)  # rank 0's send fails on the dead peer; the survivor times out, is resynced
    assert time.monotonic() - started < 5.0 + 60
    assert recorder.saw("rollout engine 0 lost during a weight sync")
    assert [engine.id for engine in fleet.live] == [1]
    assert ray.get(fleet.live[0].actor.policy_version.remote()) == 2
    # Both policy ranks are still in step (rank 0 drained its gathers): syncs keep working.
    fleet.sync(3)
    after = fleet.generate(PROMPTS, sampling())
    assert versions(after) == {3}
    assert tokens(after) == expected


@pytest.mark.slow
def test_without_spare_engines_a_loss_fails_the_step(ray_cluster, make_fleet):
    from rlhf_trainer.rollout.fleet import RolloutCapacityError

    fleet, recorder = make_fleet(minimum=2)  # minReplicas unset: every replica is needed
    fleet.sync(1)
    kill_actor(fleet.live[1].actor)
    with pytest.raises(RolloutCapacityError, match="fewer than the minimum 2"):
        fleet.generate(PROMPTS, sampling())
    assert recorder.saw("lost during generation")
