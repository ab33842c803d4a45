"""The reward-model role: the scorer on the tiny hand-weighted reward model (fast), and the
elastic fleet of scorer actors on a real local Ray with the reward role's resource (slow)."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlhf_local.harness import wait_for
from rlhf_local.tiny_models import save_tiny_reward_model, save_tiny_tokenizer, target_token_ids
from trainer.killing import kill_actor
from trainer.recorder import Recorder

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-tiny-cpu.yaml"
TARGET = "4"
PROMPTS = ["what is two plus two? ", "hello ", "", "the answer is "]
RESPONSES = ["the answer is 4", "a b c d e", "4 4", "4 hello world 4 4 b"]
OTHER_CORPUS = ["four is 4", "two and two make four 4", "the sum of two numbers", "e d c b a"]


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reward")
    tokenizer = save_tiny_tokenizer(root / "tokenizer")
    return save_tiny_reward_model(root / "model", tokenizer, TARGET)


@pytest.fixture(scope="module")
def scorer(reward_dir: Path) -> Any:
    from rlhf_trainer.rewards.model import RewardModelScorer

    return RewardModelScorer(reward_dir, device="cpu")


def samples(count: int) -> tuple[list[str], list[str]]:
    """`count` (prompt, response) pairs of different lengths and scores."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(count)]
    responses = [
        " ".join(["4" if (i + j) % 3 == 0 else "a" for j in range(1 + i % 7)]) for i in range(count)
    ]
    return prompts, responses


# --------------------------------------------------------------------------------------------
# The tiny reward model


def test_the_tiny_reward_model_prefers_more_target_tokens(scorer: Any) -> None:
    words = ["a", "b", "c", "d", "e", "a"]
    responses = [" ".join([TARGET] * count + words[count:]) for count in range(len(words) + 1)]
    scores = scorer.score(["the answer is "] * len(responses), responses, batch_size=4)
    assert all(low < high for low, high in itertools.pairwise(scores)), scores
    assert scores[0] == pytest.approx(0.0, abs=1e-6)  # no target token: no reward
    only_targets = scorer.score([""], [TARGET], batch_size=1)[0]
    assert only_targets == pytest.approx(1.0, abs=1e-3)


def test_the_target_is_every_token_that_decodes_to_it(reward_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    ids = target_token_ids(tokenizer, TARGET)
    assert ids and all(tokenizer.decode([i]).strip() == TARGET for i in ids)
    with pytest.raises(ValueError, match="no token"):
        target_token_ids(tokenizer, "not-a-token")


# --------------------------------------------------------------------------------------------
# The scorer


def test_batched_scores_equal_one_by_one(scorer: Any) -> None:
    prompts, responses = samples(9)
    one_by_one = [
        scorer.score([p], [r], batch_size=1)[0] for p, r in zip(prompts, responses, strict=True)
    ]
    for batch_size in (2, 4, 16):
        batched = scorer.score(prompts, responses, batch_size=batch_size)
        assert batched == pytest.approx(one_by_one, abs=1e-6)
    assert len(set(one_by_one)) > 3  # the samples really score differently


def test_scores_follow_the_text_not_the_policys_tokenization(scorer: Any, tmp_path: Path) -> None:
    """A policy with another tokenizer: its decoded texts, re-tokenized by the reward model's
    tokenizer, score as the texts do; its own ids in the reward vocabulary would not."""
    from transformers import AutoTokenizer

    policy_tokenizer = AutoTokenizer.from_pretrained(
        save_tiny_tokenizer(tmp_path / "policy", corpus=OTHER_CORPUS, vocab_size=280)
    )
    assert len(policy_tokenizer) != len(scorer.tokenizer)
    prompt_ids = [policy_tokenizer(p)["input_ids"] for p in PROMPTS]
    response_ids = [policy_tokenizer(r)["input_ids"] for r in RESPONSES]
    assert [p + r for p, r in zip(prompt_ids, response_ids, strict=True)] != scorer.tokenize(
        PROMPTS, RESPONSES
    )

    decoded_prompts = [policy_tokenizer.decode(ids) for ids in prompt_ids]
    decoded_responses = [policy_tokenizer.decode(ids) for ids in response_ids]
    direct = scorer.score(PROMPTS, RESPONSES, batch_size=2)
    assert scorer.score(decoded_prompts, decoded_responses, batch_size=2) == pytest.approx(
        direct, abs=1e-6
    )
    wrong_vocabulary = scorer.score_ids(
        [p + r for p, r in zip(prompt_ids, response_ids, strict=True) if p + r], batch_size=2
    )
    assert wrong_vocabulary != pytest.approx(direct[: len(wrong_vocabulary)], abs=1e-3)


def test_score_ids_equals_the_score_of_the_decoded_text(scorer: Any) -> None:
    sequences = scorer.tokenize(PROMPTS, RESPONSES)
    texts = [scorer.tokenizer.decode(ids) for ids in sequences]
    by_ids = scorer.score_ids(sequences, batch_size=3)
    assert by_ids == pytest.approx(scorer.score(texts, [""] * len(texts), batch_size=3), abs=1e-6)
    assert by_ids == pytest.approx(scorer.score(PROMPTS, RESPONSES, batch_size=3), abs=1e-6)


def test_the_scorer_rejects_what_it_cannot_score(scorer: Any) -> None:
    with pytest.raises(ValueError, match="prompts but"):
        scorer.score(["a"], ["b", "c"], batch_size=2)
    with pytest.raises(ValueError, match="at least one token"):
        scorer.score_ids([[5], []], batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        scorer.score_ids([[5]], batch_size=0)


def test_a_sample_whose_text_is_empty_is_scored_as_the_eos_token_alone(scorer: Any) -> None:
    # A synthetic prompt and a response of special tokens only both decode to "".
    empty, eos = scorer.score([""], [""]), scorer.score_ids([[scorer.tokenizer.eos_token_id]])
    assert empty == eos and all(map(math.isfinite, empty))


def test_long_sequences_keep_their_last_tokens(scorer: Any) -> None:
    limit = scorer.max_length
    assert limit == 512
    target_id = scorer.tokenizer(TARGET)["input_ids"][0]
    other_id = scorer.tokenizer("a")["input_ids"][0]
    tail = [target_id] * limit
    assert scorer.score_ids([[other_id] * 100 + tail], 1) == scorer.score_ids([tail], 1)


# --------------------------------------------------------------------------------------------
# What a job's spec says


def job_spec(**reward_role: Any) -> Any:
    from rlhfjob.api import ElasticRoleSpec
    from rlhfjob.config import load_job

    spec = load_job(EXAMPLE).spec
    roles = spec.roles.model_copy(update={"reward": ElasticRoleSpec(**reward_role)})
    model = spec.model.model_copy(update={"reward": "/models/rm"})
    return spec.model_copy(update={"roles": roles, "model": model})


def test_desired_and_minimum_follow_the_reward_role() -> None:
    from rlhf_trainer.rewards.model import desired_reward_actors, minimum_reward_actors

    assert (
        desired_reward_actors(job_spec(replicas=3)),
        minimum_reward_actors(job_spec(replicas=3)),
    ) == (3, 3)
    spec = job_spec(replicas=3, min_replicas=1)
    assert (desired_reward_actors(spec), minimum_reward_actors(spec)) == (3, 1)
    spec = job_spec(replicas=2, min_replicas=1, gpus=2)  # one actor per GPU
    assert (desired_reward_actors(spec), minimum_reward_actors(spec)) == (4, 2)


def test_the_launcher_claims_the_reward_resource() -> None:
    from rlhf_trainer.rewards.model import RewardModelLauncher

    cpu = RewardModelLauncher.from_spec(job_spec(replicas=1))
    assert cpu.path == "/models/rm"
    assert cpu.actor_options["resources"] == {"rlhf-role-reward": 1}
    assert (cpu.actor_options["num_gpus"], cpu.actor_options["num_cpus"]) == (0, 0)
    assert cpu.options == {"device": "cpu"}
    gpu = RewardModelLauncher.from_spec(job_spec(replicas=1, gpus=1))
    assert gpu.actor_options["num_gpus"] == 1
    assert gpu.options == {}  # the checkpoint's own dtype
    spec = job_spec(replicas=1)
    with pytest.raises(ValueError, match=r"roles\.reward"):
        RewardModelLauncher.from_spec(
            spec.model_copy(update={"roles": spec.roles.model_copy(update={"reward": None})})
        )


# --------------------------------------------------------------------------------------------
# The fleet on a real local Ray


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    from rlhfjob.api import ray_resource

    ray.init(
        num_cpus=2,
        resources={ray_resource("reward"): 2},
        include_dashboard=False,
        log_to_driver=False,
        namespace="test-reward-models",
    )
    yield ray
    ray.shutdown()


@pytest.fixture
def make_fleet(ray_cluster: Any, reward_dir: Path) -> Iterator[Callable[..., tuple[Any, Recorder]]]:
    from rlhf_trainer.rewards.model import RewardModelFleet, RewardModelLauncher

    fleets: list[Any] = []

    def make(minimum: int = 1) -> tuple[Any, Recorder]:
        launcher = RewardModelLauncher(str(reward_dir), scorer_options={"num_threads": 1})
        recorder = Recorder()
        fleet = RewardModelFleet(
            launcher.start, desired=2, minimum=minimum, log=recorder.log, on_change=recorder.report
        )
        fleets.append(fleet)
        fleet.start(2)
        fleet.wait_ready(300)
        assert len(fleet.live) == 2
        return fleet, recorder

    yield make
    for fleet in fleets:
        fleet.shutdown()


@pytest.fixture(scope="module")
def blocker_class(ray_cluster: Any) -> Any:
    from rlhfjob.api import ray_resource

    @ray_cluster.remote(num_cpus=0, resources={ray_resource("reward"): 1})
    class Blocker:
        """Holds a unit of the reward resource, so no reward actor can be placed."""

        def ping(self) -> bool:
            return True

    return Blocker


BATCH = 3


@pytest.mark.slow
def test_a_fleet_scores_as_a_local_scorer_survives_a_lost_actor_and_admits_its_replacement(
    ray_cluster: Any, make_fleet: Any, scorer: Any
) -> None:
    """One fleet through its life (several checks on one run: each fleet costs two actor
    starts): it scores as a local scorer; a lost actor is dropped and its chunks rescored on
    the survivor; `maintain` starts a replacement, and a later `maintain` admits it."""
    fleet, recorder = make_fleet(minimum=1)
    prompts, responses = samples(11)
    expected = fleet.score(prompts, responses, BATCH)
    assert expected == pytest.approx(scorer.score(prompts, responses, BATCH), abs=1e-6)
    ids = scorer.tokenize(prompts, responses)
    assert fleet.score_ids(ids, BATCH) == expected
    assert fleet.score([], [], BATCH) == []
    assert recorder.counts[-1] == (2, 2) and recorder.saw("up")

    kill_actor(fleet.live[0].actor)
    assert fleet.score(prompts, responses, BATCH) == expected
    assert len(fleet.live) == 1 and recorder.counts[-1] == (1, 2)
    assert recorder.saw("reward model 0 lost during scoring")
    assert fleet.score(prompts, responses, BATCH) == expected  # one actor, all chunks

    fleet.maintain()
    assert len(fleet.starting) == 1 and recorder.saw("starting reward model 2")

    def admitted() -> bool:
        fleet.maintain()
        return len(fleet.live) == 2

    wait_for(admitted, 120, "the replacement to be admitted")
    assert not fleet.starting and [member.id for member in fleet.live] == [1, 2]
    assert recorder.saw("reward model 2 rejoined") and recorder.counts[-1] == (2, 2)
    assert fleet.score(prompts, responses, BATCH) == expected


@pytest.mark.slow
def test_below_the_minimum_scoring_raises_a_capacity_error(
    ray_cluster: Any, make_fleet: Any
) -> None:
    from rlhf_trainer.rewards.model import RewardCapacityError

    fleet, _ = make_fleet(minimum=2)
    prompts, responses = samples(6)
    kill_actor(fleet.live[1].actor)
    with pytest.raises(RewardCapacityError, match="minimum 2"):
        fleet.score(prompts, responses, BATCH)
    assert len(fleet.live) == 1
    with pytest.raises(RewardCapacityError):
        fleet.score(prompts, responses, BATCH)


@pytest.mark.slow
def test_a_replacement_that_cannot_be_placed_never_blocks_scoring(
    ray_cluster: Any, make_fleet: Any, blocker_class: Any
) -> None:
    fleet, _ = make_fleet()
    prompts, responses = samples(8)
    expected = fleet.score(prompts, responses, BATCH)
    kill_actor(fleet.live[1].actor)
    blocker = blocker_class.remote()  # takes the unit the lost actor freed
    try:
        assert ray_cluster.get(blocker.ping.remote(), timeout=60)
        started = time.monotonic()
        fleet.maintain()  # nothing lost yet as far as the fleet knows
        assert fleet.score(prompts, responses, BATCH) == expected
        assert len(fleet.live) == 1
        fleet.maintain()  # starts a replacement, which queues for the resource
        assert len(fleet.starting) == 1
        for _ in range(3):
            fleet.maintain()
            assert fleet.score(prompts, responses, BATCH) == expected
        assert len(fleet.live) == 1 and len(fleet.starting) == 1
        assert time.monotonic() - started < 30  # each maintain waits fleet.admit_timeout_s
    finally:
        ray_cluster.kill(blocker)

    def admitted() -> bool:
        fleet.maintain()
        return len(fleet.live) == 2

    wait_for(admitted, 120, "the replacement to be placed once the resource is free")
    assert fleet.score(prompts, responses, BATCH) == expected
