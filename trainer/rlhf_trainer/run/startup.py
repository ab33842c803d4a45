"""Before the first step: a run's inputs, and its actors started or adopted (`start_actors`).

`load_inputs` reads what a run needs before any actor starts (the reward function, the prompts,
the model's config), which is where mistakes in a job file show (`NonRetryableError`).

`start_actors` returns the actors of one run as `RunActors`: the ZeRO-3 groups (policy, and
reference and critic where the spec has them) and the rollout (`RolloutFleet` of engine actors,
or `ColocatedRollout`, the engines inside the policy ranks). A driver resuming from a
checkpoint first tries to adopt what a killed predecessor left (`rlhf_trainer.ranks.adoption`):
every ZeRO-3 rank must be there and answer for the same spec within the adoption timeout; rollout
engines that answer with the spec's tag (or are still busy) are kept up to the desired count,
the rest are killed. Failing that it kills whatever is left and starts every role at once, so
actors boot and build their engines side by side. Either way the checkpoint is then loaded
into the ranks (`rlhf_trainer.run.loop.Trainer.restore`), exactly as into fresh ones.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlhf_trainer import topology
from rlhf_trainer.algo.experience import ESTIMATORS
from rlhf_trainer.algo.losses import POLICY_LOSSES
from rlhf_trainer.data.heldout import load_held_out
from rlhf_trainer.data.prompts import PromptCounts, PromptItem, fit_prompts, load_prompts
from rlhf_trainer.data.tokenizer import check_stop_strings, decoder, load_tokenizer, stop_token_ids
from rlhf_trainer.environments.episodes import EpisodeRunner
from rlhf_trainer.environments.loading import load_environment
from rlhf_trainer.modeling.networks import (
    check_context_window,
    check_fused_logprobs,
    check_kernels,
    model_config,
)
from rlhf_trainer.ranks.actors import CriticWorker, PolicyWorker, ReferenceWorker, ZeroWorker
from rlhf_trainer.ranks.adoption import (
    DEFAULT_ADOPT_TIMEOUT_S,
    kill_actors_of_other_specs,
    kill_job_actors,
    spec_digest,
    spec_json,
)
from rlhf_trainer.ranks.group import Groups, WorkerGroup, rank_name
from rlhf_trainer.rewards.functions import (
    CombinedReward,
    Decode,
    RewardFunctionError,
)
from rlhf_trainer.rewards.sources import build_reward
from rlhf_trainer.rollout.base import Rollout
from rlhf_trainer.rollout.colocated import ColocatedRollout
from rlhf_trainer.rollout.engines import EngineLauncher, engine_id_from_name
from rlhf_trainer.rollout.fleet import RolloutFleet
from rlhf_trainer.rollout.model_source import ModelSource
from rlhfjob.api import RLHFJobSpec, RoleSpec

if TYPE_CHECKING:
    from rlhf_trainer.rewards.model import RewardModelFleet

SYNTHETIC_DATASET_SIZE = 1024
"""Prompts drawn for a `synthetic:<task>` dataset."""
SETUP_TIMEOUT_S = 600.0
"""How long actors may take to start (a cold start builds every model)."""
ADOPTED_ENGINE_GRACE_S = 2.0
"""After a warm restart, how long to wait for engines beyond the minimum before training."""


# --------------------------------------------------------------------------------------------
# Inputs


class NonRetryableError(Exception):
    """A problem that retrying cannot fix: the operator fails the job instead of restarting it."""


@dataclass
class Inputs:
    """What a run needs before any actor starts; loading it is where config mistakes show."""

    reward: CombinedReward
    """Every source of the reward, weighted (a model source gets its replicas at start-up)."""
    prompts: list[PromptItem]
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response (`tokenizer.stop_token_ids`)."""
    prompt_counts: PromptCounts | None = None
    """What `dataset.overlongPrompts` did to the dataset."""
    decode: Decode | None = None
    """Token ids to text with the job's tokenizer (None: the job has none)."""
    held_out: list[PromptItem] = field(default_factory=list)
    """The held-out prompts `spec.evaluation` scores; never trained on."""
    episodes: EpisodeRunner | None = None
    """Samples multi-turn trajectories (`spec.environment`); None: one response a sample."""


def check_ray_version(spec: RLHFJobSpec, installed: str | None = None) -> None:
    """`spec.rayVersion` names the image's Ray (`installed`: this process's) to the release:
    KubeRay starts the head and workers for the version it is told, and Ray refuses a driver or
    a node of another minor release. A patch release apart is fine."""
    installed = installed or importlib.metadata.version("ray")
    if spec.ray_version.split(".")[:2] != installed.split(".")[:2]:
        raise NonRetryableError(
            f"spec.rayVersion: {spec.ray_version} does not match the image's Ray {installed}"
            f" (set rayVersion to {installed}, or use an image with Ray {spec.ray_version})"
        )


def load_inputs(
    spec: RLHFJobSpec, *, check_model: bool = True, log: Callable[[str], None] = print
) -> Inputs:
    """The reward's sources, the prompts and (with `check_model`) the model config;
    NonRetryableError if unusable."""
    check_ray_version(spec)
    try:
        tokenizer = load_tokenizer(spec)
        decode = decoder(tokenizer) if tokenizer is not None else None
        check_stop_strings(spec, tokenizer)
        ESTIMATORS[spec.algorithm.name]  # UnknownNameError: no estimator of that name
        POLICY_LOSSES[spec.algorithm.policy_loss]  # nor a policy loss
        reward = build_reward(spec, decode)
        environment = load_environment(spec, tokenizer) if spec.environment else None
        load = environment.load if environment is not None else load_prompts
        prompts = load(
            spec.dataset.source,
            spec.dataset.prompt_field,
            tokenizer=tokenizer,
            synthetic_count=SYNTHETIC_DATASET_SIZE,
            seed=spec.algorithm.seed,
            chat_template=spec.dataset.chat_template,
        )
        prompts, counts = fit_prompts(
            prompts, spec.algorithm.max_prompt_length, spec.dataset.overlong_prompts
        )
        prompts, held_out = load_held_out(spec, prompts, tokenizer, load)
        stops = stop_token_ids(spec, tokenizer)
        episodes = environment.episodes(spec, stops, decode) if environment else None
    except (RewardFunctionError, ValueError, OSError) as error:
        raise NonRetryableError(str(error)) from error
    if counts.truncated or counts.skipped:
        total = counts.kept + counts.truncated + counts.skipped
        done = f"{counts.truncated} truncated" if counts.truncated else f"{counts.skipped} skipped"
        log(
            f"{counts.truncated + counts.skipped} of {total} prompts are longer than "
            f"maxPromptLength ({spec.algorithm.max_prompt_length}): {done}"
        )
    if check_model:
        check_model_config(spec)
    return Inputs(
        reward=reward,
        prompts=prompts,
        stop_token_ids=stops,
        prompt_counts=counts,
        decode=decode,
        held_out=held_out,
        episodes=episodes,
    )


def check_model_config(spec: RLHFJobSpec) -> None:
    """NonRetryableError if the model's config cannot be loaded, `model.kernels` cannot patch a
    model of its type (nor `model.fusedLogprobs` serve it), or a prompt and its response do not
    fit the model's context window.

    This imports transformers (seconds): a warm restart skips it, since the attempt that
    started the adopted actors checked the very same spec.
    """
    try:
        config = model_config(spec.model)
        model_type = getattr(config, "model_type", "") or ""
        check_kernels(spec.model.kernels, model_type)
        check_fused_logprobs(spec.model.fused_logprobs, model_type)
        algorithm = spec.algorithm
        field = (
            "environment.maxTrajectoryTokens" if spec.environment else "algorithm.maxResponseLength"
        )
        budget = topology.response_budget(spec)
        check_context_window(config, algorithm.max_prompt_length, budget, field)
    except (ValueError, OSError) as error:
        raise NonRetryableError(str(error)) from error


# --------------------------------------------------------------------------------------------
# What a spec runs


@dataclass(frozen=True)
class ZeroRole:
    """One ZeRO-3 group a spec needs: its role, the role's spec and the rank class."""

    role: str
    spec: RoleSpec
    worker: type[ZeroWorker]
    optimizer_steps: int
    """Optimizer steps of the whole run (0: the role does not train)."""
    ranks: int
    """The group's ranks: the spec's (`topology.role_ranks`) unless the run overrides them."""


def zero_roles(
    spec: RLHFJobSpec, total_steps: int, zero_ranks: Mapping[str, int] | None = None
) -> list[ZeroRole]:
    """The policy group, then the reference (if the spec has the role) and the critic (PPO),
    with the ranks `zero_ranks` gives a role (`RunContext.zero_ranks`), else the spec's."""
    roles, algorithm = spec.roles, spec.algorithm
    overrides = zero_ranks or {}
    steps = total_steps * algorithm.update_epochs

    def role(name: str, role_spec: RoleSpec, worker: type[ZeroWorker], steps: int) -> ZeroRole:
        ranks = overrides.get(name, topology.role_ranks(role_spec))
        return ZeroRole(name, role_spec, worker, steps, ranks)

    wanted = [role("trainer", roles.trainer, PolicyWorker, steps)]
    if roles.reference is not None:
        wanted.append(role("reference", roles.reference, ReferenceWorker, 0))
    if ESTIMATORS[algorithm.name].uses_critic:
        assert roles.critic is not None  # the API requires it for PPO
        wanted.append(role("critic", roles.critic, CriticWorker, steps))
    unknown = set(overrides) - {wanted_role.role for wanted_role in wanted}
    if unknown:
        raise ValueError(f"rank counts for roles this job has no group of: {sorted(unknown)}")
    return wanted


def engine_launcher(spec: RLHFJobSpec, *, detached: bool) -> EngineLauncher | None:
    """How the run starts its rollout engine actors; None when colocated (no engine actors).

    Engines answer a ping with the launcher's tag, the spec's digest, which is how adoption
    tells an engine of this spec from a stale one.
    """
    rollout, seed = spec.roles.rollout, spec.algorithm.seed
    if rollout.colocated:
        return None
    return EngineLauncher(
        rollout,
        ModelSource.from_spec(spec.model, seed=seed, on_gpu=rollout.gpus > 0),
        seed=seed,
        engine_options={"num_threads": 1} if rollout.backend == "hf" else {},
        detached=detached,
        tag=spec_digest(spec_json(spec)),
    )


# --------------------------------------------------------------------------------------------
# The result


@dataclass(frozen=True)
class RunActors:
    """Every actor of a run, ready for its first step."""

    groups: Groups
    rollout: Rollout
    reward_models: RewardModelFleet | None = None
    """The reward-model role's replicas (None: the reward uses no reward model)."""
    adopted: int = 0
    """Actors adopted from the previous attempt (0: a cold start)."""
    seconds: float = 0.0
    """How long starting or adopting them took."""

    def shutdown(self) -> None:
        """Kill them all (a driver leaving on its own: the next attempt starts cold)."""
        self.rollout.shutdown()
        if self.reward_models is not None:
            with contextlib.suppress(Exception):
                self.reward_models.shutdown()
        for group in self.groups.all():
            with contextlib.suppress(Exception):
                group.shutdown()


# --------------------------------------------------------------------------------------------
# Adoption


def rank_answers(spec: RLHFJobSpec, world_size: int) -> list[dict[str, Any]]:
    """What every rank of a group set up for `spec` answers to `ZeroWorker.ping`."""
    digest = spec_digest(spec_json(spec))
    return [
        {"spec": digest, "rank": rank, "world_size": world_size, "ready": True}
        for rank in range(world_size)
    ]


def adopt_group(
    spec: RLHFJobSpec,
    role: str,
    role_spec: RoleSpec,
    timeout_s: float,
    setup_timeout_s: float = SETUP_TIMEOUT_S,
    world_size: int | None = None,
) -> WorkerGroup | None:
    """The role's `world_size` ranks (default: the spec's) left by a previous driver, if every
    one exists, is set up for this spec in a group of that size and answers `ZeroWorker.ping`
    within `timeout_s`; otherwise None."""
    import ray
    from ray.exceptions import RayError

    if world_size is None:
        world_size = topology.role_ranks(role_spec)
    try:
        actors: list[Any] = [ray.get_actor(rank_name(role, rank)) for rank in range(world_size)]
    except ValueError:  # a rank is missing
        return None
    refs: list[Any] = [actor.ping.remote() for actor in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(ready) < len(refs):
        return None
    try:
        answers: list[Any] = ray.get(refs)
    except RayError:
        return None
    if answers != rank_answers(spec, world_size):
        return None
    return WorkerGroup.of_actors(spec, role, role_spec, actors, setup_timeout_s)


@dataclass(frozen=True)
class EngineChoice:
    """Which of a previous attempt's engines to keep (in admission order)."""

    keep: list[int]
    answered: int
    """How many of those kept answered at once (the others are still busy)."""


def choose_engines(
    engine_ids: Iterable[int], answers: Mapping[int, str | None], tag: str, desired: int
) -> EngineChoice:
    """The engines to adopt: those that answered with `tag` first, then those that did not
    answer in time (busy finishing a dead driver's generation, say: they join once they
    answer), by id, at most `desired`. `answers` holds what the engines that answered said
    (None: the call failed); an id missing from it did not answer in time."""
    ids = sorted(engine_ids, key=lambda engine_id: (engine_id not in answers, engine_id))
    keep = [i for i in ids if answers.get(i, tag) == tag][:desired]
    return EngineChoice(keep=keep, answered=sum(i in answers for i in keep))


@dataclass(frozen=True)
class AdoptedEngines:
    """A previous attempt's rollout engines that are kept."""

    actors: dict[int, Any]
    """The engine actors by id."""
    answered: int
    """How many of them answered at once."""
    next_id: int
    """Above every engine id the previous attempt used (new engines' names stay unique)."""


@dataclass(frozen=True)
class Adopted:
    """A previous attempt's actors that answered."""

    groups: Groups
    engines: AdoptedEngines | None = None
    """None when colocated: the engines came with the policy ranks."""

    @property
    def count(self) -> int:
        engines = len(self.engines.actors) if self.engines is not None else 0
        return sum(len(g.actors) for g in self.groups.all()) + engines


def adopt_engines(tag: str, desired: int, timeout_s: float) -> AdoptedEngines:
    """The previous attempt's engines that answer with this spec's `tag` (see
    `choose_engines`); the others are killed."""
    import ray

    candidates: dict[int, Any] = {}
    for name in ray.util.list_named_actors():
        engine_id = engine_id_from_name(name)
        if engine_id is not None:
            with contextlib.suppress(ValueError):  # gone meanwhile
                candidates[engine_id] = ray.get_actor(name)
    refs = {engine_id: actor.ping.remote() for engine_id, actor in candidates.items()}
    ready = set()
    if refs:
        ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)[0])
    answers: dict[int, str | None] = {}
    for engine_id, ref in refs.items():
        if ref in ready:
            try:
                answers[engine_id] = ray.get(ref)
            except ray.exceptions.RayError:
                answers[engine_id] = None
    choice = choose_engines(candidates, answers, tag, desired)
    for engine_id, actor in candidates.items():
        if engine_id not in choice.keep:
            ray.kill(actor, no_restart=True)
    return AdoptedEngines(
        actors={engine_id: candidates[engine_id] for engine_id in choice.keep},
        answered=choice.answered,
        next_id=max(candidates, default=-1) + 1,
    )


def adopt(
    spec: RLHFJobSpec,
    launcher: EngineLauncher | None,
    *,
    total_steps: int,
    timeout_s: float,
    log: Callable[[str], None],
    zero_ranks: Mapping[str, int] | None = None,
) -> Adopted | None:
    """The previous attempt's actors, if every ZeRO-3 rank is there and answers in time, with
    the live engines by id (missing ones are started later). None: start cold."""
    import ray

    kill_actors_of_other_specs(log)
    if not ray.util.list_named_actors():
        return None
    by_role = {}
    for wanted in zero_roles(spec, total_steps, zero_ranks):
        group = adopt_group(spec, wanted.role, wanted.spec, timeout_s, world_size=wanted.ranks)
        if group is None:
            log(f"the previous attempt's {wanted.role} ranks are missing or do not answer")
            return None
        by_role[wanted.role] = group
    engines = None
    if launcher is not None:
        engines = adopt_engines(launcher.tag, topology.desired_engines(spec), timeout_s)
    adopted = Adopted(Groups.of(by_role), engines)
    log(f"adopting {adopted.count} actors from the previous attempt")
    return adopted


# --------------------------------------------------------------------------------------------
# Starting


def start_groups(
    spec: RLHFJobSpec,
    total_steps: int,
    *,
    detached: bool,
    zero_ranks: Mapping[str, int] | None = None,
) -> Groups:
    """Start the ZeRO-3 groups; they build their engines while the rollout engines start."""
    by_role = {
        wanted.role: WorkerGroup(
            wanted.worker,
            spec,
            wanted.role,
            wanted.spec,
            wanted.optimizer_steps,
            setup_timeout_s=SETUP_TIMEOUT_S,
            detached=detached,
            world_size=wanted.ranks,
        )
        for wanted in zero_roles(spec, total_steps, zero_ranks)
    }
    return Groups.of(by_role)


def start_actors(
    spec: RLHFJobSpec,
    *,
    total_steps: int,
    resume: bool,
    detached: bool = True,
    adopt_timeout_s: float = DEFAULT_ADOPT_TIMEOUT_S,
    log: Callable[[str], None] = print,
    on_engines_change: Callable[[int, int], None] | None = None,
    on_reward_models_change: Callable[[int, int], None] | None = None,
    zero_ranks: Mapping[str, int] | None = None,
) -> RunActors:
    """Adopt the previous attempt's actors if possible (a detached run that resumes), else
    start every role at once; returns them once the groups and enough engines are ready.

    `zero_ranks` gives a ZeRO-3 role other ranks than the spec's (`RunContext.zero_ranks`).

    `on_engines_change(live, desired)` hears about every change in the number of live rollout
    engines, from now on (the rollout keeps calling it); `on_reward_models_change` the same for
    the reward-model replicas. Those are never adopted: they hold no state and start in
    seconds beside the groups.
    """
    started = time.perf_counter()
    launcher = engine_launcher(spec, detached=detached)
    adopted = None
    if detached and resume:
        adopted = adopt(
            spec,
            launcher,
            total_steps=total_steps,
            timeout_s=adopt_timeout_s,
            log=log,
            zero_ranks=zero_ranks,
        )
    if adopted is None:
        check_model_config(spec)
        if detached:
            kill_job_actors(log)  # whatever an earlier attempt left is not trusted
        log("starting actors")
        groups = start_groups(spec, total_steps, detached=detached, zero_ranks=zero_ranks)
    else:
        groups = adopted.groups
    reward_models = None
    if spec.reward.uses_model():
        from rlhf_trainer.rewards.model import RewardModelFleet

        reward_models = RewardModelFleet.from_spec(spec, log=log, on_change=on_reward_models_change)
    rollout: Rollout
    if launcher is None:  # the engines are inside the policy ranks
        for group in groups.all():
            group.wait_ready()
        rollout = ColocatedRollout(groups.policy, on_change=on_engines_change)
    else:
        rollout = _start_fleet(spec, groups, launcher, adopted, log, on_engines_change)
    count = adopted.count if adopted is not None else 0
    seconds = _log_ready(groups.policy, started, count, log)
    if reward_models is not None:
        reward_models.wait_ready()
    return RunActors(groups, rollout, reward_models, adopted=count, seconds=seconds)


def _start_fleet(
    spec: RLHFJobSpec,
    groups: Groups,
    launcher: EngineLauncher,
    adopted: Adopted | None,
    log: Callable[[str], None],
    on_engines_change: Callable[[int, int], None] | None,
) -> RolloutFleet:
    """The adopted engines, new ones up to the desired count, and the groups ready."""
    fleet = RolloutFleet(
        groups.policy,
        launcher.start,
        desired=topology.desired_engines(spec),
        minimum=topology.minimum_engines(spec),
        log=log,
        on_change=on_engines_change,
    )
    if on_engines_change is not None:
        on_engines_change(0, fleet.desired)
    engines = adopted.engines if adopted is not None else None
    if engines is not None:
        for engine_id, actor in sorted(engines.actors.items()):
            fleet.add(engine_id, actor)
        fleet.next_id = max(fleet.next_id, engines.next_id)  # names stay unique
    fleet.start(max(0, fleet.desired - len(fleet.starting)))
    for group in groups.all():
        group.wait_ready()
    if engines is not None and engines.answered >= max(fleet.minimum, 1):
        # Adopted engines answer at once; replacements of missing ones join later.
        fleet.wait_ready(SETUP_TIMEOUT_S, grace_s=ADOPTED_ENGINE_GRACE_S)
    else:
        fleet.wait_ready(SETUP_TIMEOUT_S)
    return fleet


def _log_ready(
    policy: WorkerGroup, started: float, adopted: int, log: Callable[[str], None]
) -> float:
    """Log how rank 0 built its engines and how long start-up took; returns that time."""
    import ray

    built = ray.get(policy.actors[0].build_report_of.remote())
    host, gpu = built["peak_host_bytes"] / 2**30, built["peak_gpu_bytes"] / 2**30
    log(
        f"policy rank 0 built its engines in {built['seconds']:.1f} s "
        f"(peak host memory {host:.1f} GiB, GPU {gpu:.1f} GiB)"
    )
    seconds = time.perf_counter() - started
    how = f"adopted {adopted} actors from the previous attempt" if adopted else "started"
    log(f"actors ready in {seconds:.1f} s ({how})")
    return seconds
