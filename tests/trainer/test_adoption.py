"""Naming a run's actors so that a restarted driver can adopt them (the pure parts)."""

from __future__ import annotations

from pathlib import Path

from rlhf_trainer.actors import rank_name
from rlhf_trainer.adoption import (
    DEFAULT_ADOPT_TIMEOUT_S,
    ENV_ADOPT_TIMEOUT,
    adoption_timeout_s,
    ray_namespace,
    spec_digest,
    spec_json,
)
from rlhf_trainer.engines import engine_id_from_name, engine_name
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
