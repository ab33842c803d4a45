"""Start-up: which groups a spec starts, how the rollout starts, which engines are adopted."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch")

from rlhf_trainer.ranks.actors import CriticWorker, PolicyWorker, ReferenceWorker
from rlhf_trainer.ranks.adoption import spec_digest, spec_json
from rlhf_trainer.run.startup import (
    EngineChoice,
    choose_engines,
    engine_launcher,
    rank_answers,
    zero_roles,
)
from rlhfjob.api import RLHFJob, ray_resource
from rlhfjob.config import load_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str, **roles: dict) -> RLHFJob:
    document = yaml.safe_load((EXAMPLES / name).read_text())
    document["spec"]["roles"].update(roles)
    return RLHFJob.model_validate(document)


def test_grpo_starts_the_policy_group_only() -> None:
    spec = load_job(EXAMPLES / "grpo-tiny-cpu.yaml").spec
    (policy,) = zero_roles(spec, total_steps=10)
    assert (policy.role, policy.worker, policy.spec) == (
        "trainer",
        PolicyWorker,
        spec.roles.trainer,
    )
    assert policy.optimizer_steps == 10 * spec.algorithm.update_epochs


def test_a_reference_role_and_ppo_add_their_groups() -> None:
    spec = load_job(EXAMPLES / "ppo-tiny-cpu.yaml").spec
    assert [(r.role, r.worker) for r in zero_roles(spec, 4)] == [
        ("trainer", PolicyWorker),
        ("critic", CriticWorker),
    ]
    trainer = yaml.safe_load((EXAMPLES / "grpo-tiny-cpu.yaml").read_text())["spec"]["roles"]
    with_reference = example("grpo-tiny-cpu.yaml", reference=trainer["trainer"]).spec
    roles = zero_roles(with_reference, 4)
    assert [(r.role, r.worker, r.optimizer_steps) for r in roles] == [
        ("trainer", PolicyWorker, 4 * with_reference.algorithm.update_epochs),
        ("reference", ReferenceWorker, 0),  # frozen: never steps
    ]


def test_a_run_may_give_its_groups_other_ranks_than_the_spec() -> None:
    """`RunContext.zero_ranks`: a restart with the ranks it has (elastic training)."""
    spec = load_job(EXAMPLES / "ppo-tiny-cpu.yaml").spec
    assert [(r.role, r.ranks) for r in zero_roles(spec, 4)] == [("trainer", 2), ("critic", 1)]
    fewer = zero_roles(spec, 4, {"trainer": 1})
    assert [(r.role, r.ranks) for r in fewer] == [("trainer", 1), ("critic", 1)]
    more = zero_roles(spec, 4, {"trainer": 3, "critic": 2})
    assert [(r.role, r.ranks) for r in more] == [("trainer", 3), ("critic", 2)]
    with pytest.raises(ValueError, match="no group of: \\['reference'\\]"):
        zero_roles(spec, 4, {"reference": 1})


def test_disaggregated_rollout_launches_tagged_engines_on_the_rollout_pool() -> None:
    spec = load_job(EXAMPLES / "grpo-tiny-cpu.yaml").spec
    launcher = engine_launcher(spec, detached=True)
    assert launcher is not None
    assert launcher.tag == spec_digest(spec_json(spec))  # what adoption checks engines by
    assert launcher.detached
    assert launcher.actor_options["resources"] == {ray_resource("rollout"): 1}
    assert launcher.options == {"num_threads": 1}  # HF engines share the node's cores
    assert launcher.seed == spec.algorithm.seed


def test_colocated_rollout_has_no_engine_launcher() -> None:
    spec = load_job(EXAMPLES / "grpo-tiny-colocated-cpu.yaml").spec
    assert spec.roles.rollout.colocated
    assert engine_launcher(spec, detached=True) is None


def test_ranks_of_the_same_spec_answer_with_its_digest_rank_and_size() -> None:
    spec = load_job(EXAMPLES / "grpo-tiny-cpu.yaml").spec
    digest = spec_digest(spec_json(spec))
    assert rank_answers(spec, 2) == [
        {"spec": digest, "rank": 0, "world_size": 2, "ready": True},
        {"spec": digest, "rank": 1, "world_size": 2, "ready": True},
    ]


def test_engines_that_answer_with_the_tag_come_first_then_busy_ones() -> None:
    # 0 and 4 answered with the tag, 1 with another spec's, 2 failed, 3 and 5 are still busy.
    answers = {4: "tag", 0: "tag", 1: "stale", 2: None}
    choice = choose_engines([5, 4, 3, 2, 1, 0], answers, "tag", desired=8)
    assert choice == EngineChoice(keep=[0, 4, 3, 5], answered=2)


def test_no_more_engines_than_desired_are_adopted() -> None:
    answers = {0: "tag", 2: "tag"}
    assert choose_engines([0, 1, 2], answers, "tag", desired=2) == EngineChoice([0, 2], 2)
    assert choose_engines([0, 1, 2], answers, "tag", desired=1) == EngineChoice([0], 1)
    assert choose_engines([0, 1], {}, "tag", desired=1) == EngineChoice([0], 0)  # busy
    assert choose_engines([], {}, "tag", desired=2) == EngineChoice([], 0)
