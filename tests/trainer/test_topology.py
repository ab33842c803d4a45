"""The numbers derived from a spec, for the examples (each value as the trainer used it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_trainer import topology
from rlhfjob.config import load_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def spec_of(name: str):
    return load_job(EXAMPLES / f"{name}.yaml").spec


def test_ranks_rows_and_steps_of_the_multinode_example() -> None:
    spec = spec_of("ppo-gpu-multinode")
    roles = spec.roles
    assert topology.role_ranks(roles.trainer) == 16  # 2 replicas x 8 GPUs
    assert topology.role_ranks(roles.rollout) == 8  # 2 replicas x 4 GPUs / TP 1
    assert roles.reference is not None and roles.critic is not None
    assert (topology.role_ranks(roles.reference), topology.role_ranks(roles.critic)) == (4, 4)
    assert topology.rollout_rows(spec) == 256  # PPO: one sample per prompt
    assert topology.total_steps(spec, 1000) == 6  # 2 epochs x 1000 // 256
    with pytest.raises(ValueError, match="dataset of known size"):
        topology.total_steps(spec)
    assert (topology.desired_engines(spec), topology.minimum_engines(spec)) == (8, 4)


def test_a_disaggregated_rollout_has_every_slot_of_its_role() -> None:
    spec = spec_of("grpo-tiny-cpu")
    assert topology.rollout_rows(spec) == 64  # 8 prompts x a group of 8
    assert topology.total_steps(spec) == 40
    assert (topology.desired_engines(spec), topology.minimum_engines(spec)) == (2, 2)


def test_a_colocated_rollout_has_one_engine_per_trainer_rank_and_is_not_elastic() -> None:
    spec = spec_of("grpo-tiny-colocated-cpu")
    assert topology.role_ranks(spec.roles.trainer) == 2
    assert (topology.desired_engines(spec), topology.minimum_engines(spec)) == (2, 2)
    one_gpu = spec_of("grpo-1gpu")
    assert (topology.desired_engines(one_gpu), topology.minimum_engines(one_gpu)) == (1, 1)
