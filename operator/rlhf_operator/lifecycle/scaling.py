"""Elastic roles: which roles are short of pods, an elastic trainer starting on fewer replicas
and growing back, and the Degraded condition.
"""

from __future__ import annotations

from rlhf_operator.lifecycle import drain, shared
from rlhf_operator.lifecycle.builder import PlanBuilder
from rlhf_operator.lifecycle.plan import (
    DEGRADED,
    TRAINER,
)
from rlhfjob.api import ElasticRoleSpec
from rlhfjob.contract import (
    PHASE_EXITING,
    PHASE_STARTING,
    DrainCause,
    EventReason,
    RestartReason,
)

ENGINES_IN_TRANSIT = (PHASE_STARTING, PHASE_EXITING)
"""Driver phases whose engine counts say nothing of the pods: a starting driver reports its
engines as they boot (0/2 first), an exiting one as it takes them down. Counted then, every
healthy job would turn Degraded at its start and again at its end; a lost pod still shows
from the pods themselves."""


def roles_below_minimum(b: PlanBuilder, *, include_elastic: bool = True, skip: str = "") -> str:
    """Roles with fewer Ready pods than training needs, e.g. ``trainer 1/2 pods ready``
    (the trainer needs all: an elastic one goes on with fewer only by `elastic_trainer`)."""
    cluster = b.seen.cluster
    if cluster is None:
        return ""
    short = []
    for role, spec in b.job.spec.roles.enabled().items():
        view = cluster.roles.get(role)
        elastic = isinstance(spec, ElasticRoleSpec)
        if view is None or (elastic and not include_elastic) or role == skip:
            continue
        minimum = view.desired
        if isinstance(spec, ElasticRoleSpec):
            minimum = min(spec.effective_min_replicas, view.desired)
        if view.ready < minimum:
            short.append(f"{role} {view.ready}/{view.desired} pods ready")
    return ", ".join(short)


def elastic_trainer(b: PlanBuilder) -> int | None:
    """Replicas an elastic trainer short of Ready pods starts on now: the Ready ones, once
    the lost pods have had `replacementTimeoutSeconds` to come back, never fewer than
    `minReplicas`. None: wait for every pod (not elastic, too few, or not yet)."""
    trainer = b.job.spec.roles.trainer
    cluster, since = b.seen.cluster, b.status.trainer_short_since
    view = cluster.roles.get(TRAINER) if cluster is not None else None
    if view is None or since is None or view.ready < trainer.effective_min_replicas:
        return None
    left = trainer.replacement_timeout_seconds - b.waited(since)
    if left > 0:
        b.requeue(left)
        return None
    return view.ready


def trainer_pods_back(b: PlanBuilder) -> bool:
    """An elastic trainer running on fewer replicas has every pod Ready again."""
    cluster, running = b.seen.cluster, b.status.trainer_replicas
    view = cluster.roles.get(TRAINER) if cluster is not None else None
    return running is not None and view is not None and view.ready >= view.desired > running


def grow_back(b: PlanBuilder) -> None:
    """Every trainer pod is back: the trainer checkpoints its step and stops (a drain that
    keeps the cluster), then restarts on all its replicas from that checkpoint. A resize,
    not a failure: it counts against no restart budget and waits for no backoff."""
    desired = b.job.spec.roles.trainer.replicas
    running = b.status.trainer_replicas
    if drain.drain(b, f"every trainer pod is back ({desired}/{desired})", DrainCause.RESIZE):
        return
    b.status.trainer_replicas = None
    b.status.resizes += 1
    shared.restart(
        b,
        RestartReason.TRAINER_RESIZED,
        f"the trainer grows from {running} to {desired} replicas",
        last_alive=b.seen.now,
    )


def elastic_shortfall(b: PlanBuilder) -> str:
    """Elastic roles running below their replica count, from the pods and the trainer."""
    short: list[str] = []
    running, desired = b.status.trainer_replicas, b.job.spec.roles.trainer.replicas
    if running is not None and running < desired:
        short.append(f"trainer {running}/{desired} replicas")
    cluster = b.seen.cluster
    elastic = {r for r, s in b.job.spec.roles.enabled().items() if isinstance(s, ElasticRoleSpec)}
    for role, view in sorted((cluster.roles if cluster else {}).items()):
        if role in elastic and view.ready < view.desired:
            short.append(f"{role} {view.ready}/{view.desired} pods ready")
    beat = b.current_heartbeat()
    if beat is not None and beat.phase in ENGINES_IN_TRANSIT:
        beat = None
    for count, what in (
        (beat.rollout_engines if beat else None, "rollout engines"),
        (beat.reward_models if beat else None, "reward models"),
    ):
        if count is not None and count.live < count.desired:
            short.append(f"{count} {what}")
    return ", ".join(short)


def show_degraded(b: PlanBuilder, shortfall: str) -> None:
    """The Degraded condition, and an Event when it turns either way."""
    if shortfall:
        if b.condition(DEGRADED, True, EventReason.BELOW_REPLICAS, shortfall):
            b.event(
                "Warning",
                EventReason.DEGRADED,
                f"training goes on with fewer replicas: {shortfall}",
            )
    elif b.current(DEGRADED) is not None and b.condition(
        DEGRADED, False, EventReason.ALL_REPLICAS, "every role has all its replicas"
    ):
        b.event("Normal", EventReason.REPLICAS_RESTORED, "every role has all its replicas again")


def elastic_hint(b: PlanBuilder) -> str:
    """For a waiting elastic trainer: when it would start on the pods it has."""
    trainer, since = b.job.spec.roles.trainer, b.status.trainer_short_since
    if trainer.effective_min_replicas >= trainer.replicas or since is None:
        return ""
    left = trainer.replacement_timeout_seconds - b.waited(since)
    least = trainer.effective_min_replicas
    if left <= 0:
        return f" (the elastic trainer needs at least {least} Ready)"
    return f" (the elastic trainer starts on the Ready ones, at least {least}, in {left:.0f}s)"
