"""Numbers that follow from a job's spec: ranks of a role, rows and steps, rollout engines.

The driver, its actors and the local Ray set-up all need them; they are computed here once so
the places cannot drift apart. Actors per replica (`rlhfjob.api.actor_slots`) stay in the API,
where the operator sizes pods with them; everything here builds on it.
"""

from __future__ import annotations

from rlhfjob.api import RLHFJobSpec, RoleSpec, actor_slots


def role_ranks(role: RoleSpec) -> int:
    """Actors of a role (ZeRO-3 ranks, or rollout engines): replicas x actors per replica."""
    return role.replicas * actor_slots(role)


def rollout_rows(spec: RLHFJobSpec) -> int:
    """Sequences per training step: prompts x samples per prompt (one sample each for PPO)."""
    return spec.algorithm.prompts_per_step * spec.algorithm.samples_per_prompt


def total_steps(spec: RLHFJobSpec, dataset_size: int | None = None) -> int:
    """Training steps: `totalSteps`, or `epochs` passes over a dataset of `dataset_size` prompts."""
    algorithm = spec.algorithm
    if algorithm.total_steps is not None:
        return algorithm.total_steps
    if dataset_size is None:
        raise ValueError("algorithm.epochs needs a dataset of known size")
    return max(1, algorithm.epochs or 1) * max(1, dataset_size // algorithm.prompts_per_step)


def desired_engines(spec: RLHFJobSpec) -> int:
    """Rollout engines a step's prompts are split over (so seeds do not depend on which live):
    every slot of the rollout role, or, colocated, one inside each trainer rank."""
    roles = spec.roles
    return role_ranks(roles.trainer if roles.rollout.colocated else roles.rollout)


def minimum_engines(spec: RLHFJobSpec) -> int:
    """Fewest live engines training goes on with: `minReplicas` x engines per replica.
    Colocated engines live and die with their ranks, so all of them."""
    rollout = spec.roles.rollout
    if rollout.colocated:
        return desired_engines(spec)
    return rollout.effective_min_replicas * actor_slots(rollout)


def response_budget(spec: RLHFJobSpec) -> int:
    """The most tokens after a prompt: a response (`maxResponseLength`), or a multi-turn
    trajectory, the model's turns and the environment's answers together
    (`environment.maxTrajectoryTokens`)."""
    if spec.environment is not None:
        return spec.environment.max_trajectory_tokens
    return spec.algorithm.max_response_length
