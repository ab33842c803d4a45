"""The run context: what a driver reads from its environment and command line, once."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rlhf_trainer.ranks.adoption import DEFAULT_ADOPT_TIMEOUT_S, ENV_ADOPT_TIMEOUT, ray_namespace
from rlhf_trainer.run.context import ENV_ACTOR_LOGS, ENV_METRICS_PORT, ENV_RAY_ADDRESS, RunContext
from rlhfjob import contract
from rlhfjob.config import load_job

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-tiny-cpu.yaml"

POD = contract.PodEnv(
    job_name="grpo-tiny", job_namespace="team-a", job_config="/etc/rlhfjob/job.yaml", attempt=3
)


def test_a_driver_under_the_operator_reads_the_pod_environment() -> None:
    environ = {
        **POD.to_env(),
        ENV_METRICS_PORT: "9100",
        ENV_ACTOR_LOGS: "1",
        ENV_RAY_ADDRESS: "ray-head:6379",
        ENV_ADOPT_TIMEOUT: "1.5",
    }
    context = RunContext.from_env(environ, resume_from="latest")
    assert context == RunContext(
        job_name="grpo-tiny",
        job_namespace="team-a",
        attempt=3,
        job_config="/etc/rlhfjob/job.yaml",
        resume_from="latest",
        metrics_port=9100,
        ray_address="ray-head:6379",
        actor_logs=True,
        adopt_timeout_s=1.5,
    )


def test_a_local_run_has_the_defaults() -> None:
    context = RunContext.from_env({})
    assert context == RunContext()
    assert (context.job_name, context.attempt, context.metrics_port) == (None, 0, None)
    assert context.adopt_timeout_s == DEFAULT_ADOPT_TIMEOUT_S
    assert not context.actor_logs and context.ray_address is None


def test_the_command_line_wins_over_the_environment() -> None:
    environ = {**POD.to_env(), ENV_METRICS_PORT: "9100"}
    context = RunContext.from_env(environ, config="mine.yaml", metrics_port=0)
    assert (context.job_config, context.metrics_port) == ("mine.yaml", 0)


def test_an_unreadable_number_is_an_error_and_an_unreadable_attempt_counts_as_unset() -> None:
    with pytest.raises(ValueError):
        RunContext.from_env({ENV_METRICS_PORT: "http"})
    with pytest.raises(ValueError):
        RunContext.from_env({ENV_ADOPT_TIMEOUT: "soon"})
    assert RunContext.from_env({contract.ENV_ATTEMPT: "x"}).attempt == 0


def test_an_elastic_restart_trains_on_the_replicas_the_operator_gives() -> None:
    spec = load_job(EXAMPLE).spec  # 2 trainer replicas of one rank each (CPU)
    environ = dataclasses.replace(POD, trainer_replicas=1).to_env()
    context = RunContext.from_env(environ)
    assert context.trainer_replicas == 1
    assert context.zero_ranks_for(spec) == {"trainer": 1}
    assert RunContext.from_env(POD.to_env()).zero_ranks_for(spec) == {}  # the spec's counts


def test_rank_counts_given_in_process_win_and_must_be_positive() -> None:
    spec = load_job(EXAMPLE).spec
    given = RunContext(trainer_replicas=1, zero_ranks={"trainer": 3, "critic": 2})
    assert given.zero_ranks_for(spec) == {"trainer": 3, "critic": 2}
    with pytest.raises(ValueError, match="at least one rank"):
        RunContext(zero_ranks={"trainer": 0})
    with pytest.raises(ValueError, match="at least one rank"):
        RunContext(trainer_replicas=0)


def test_the_context_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunContext().attempt = 1  # type: ignore[misc]


def test_the_ray_namespace_is_the_one_adoption_names() -> None:
    job = load_job(EXAMPLE)
    environ = POD.to_env()
    assert RunContext.from_env(environ).ray_namespace(job) == ray_namespace(job, environ)
    assert RunContext().ray_namespace(job) == ray_namespace(job, {})
    assert RunContext().ray_namespace(job) != RunContext.from_env(environ).ray_namespace(job)
