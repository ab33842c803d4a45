"""The driver's handle on one role's ranks: start them as Ray actors on the role's node pool,
call them all, gather their results, adopt them from a killed driver."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from torch import Tensor

from rlhf_trainer.algo.batch import Batch, ShardPlan
from rlhf_trainer.ranks.actors import CHECKPOINT_WRITES, ZeroWorker
from rlhf_trainer.ranks.adoption import spec_json
from rlhf_trainer.topology import role_ranks, rollout_rows
from rlhfjob.api import RLHFJobSpec, RoleSpec, ray_resource


def rank_name(role: str, rank: int) -> str:
    """The actor name of one rank of a role (named actors live in the job's Ray namespace)."""
    return f"{role}-rank-{rank}"


class WorkerGroup:
    """The driver's handle on one role's ranks: start them, call them all, gather results.

    Each rank is a Ray actor that requests one unit of the role's custom resource (and one GPU
    when the role has GPUs), so it lands on the role's node pool. Construction starts the ranks
    and returns; `wait_ready` waits for them, so several groups can start side by side. With
    `detached`, the ranks are named (`rank_name`) and outlive the driver, and the next driver
    adopts them (`rlhf_trainer.run.startup.adopt_group`, `of_actors`; see
    `rlhf_trainer.ranks.adoption`).
    """

    def __init__(
        self,
        worker_class: type[ZeroWorker],
        spec: RLHFJobSpec,
        role: str,
        role_spec: RoleSpec,
        total_optimizer_steps: int,
        setup_timeout_s: float = 600.0,
        *,
        detached: bool = False,
        world_size: int | None = None,
    ) -> None:
        self._init(spec, role, role_spec, setup_timeout_s, world_size)
        on_gpu = role_spec.gpus > 0
        remote: Any = ray.remote  # its typed overloads do not list concurrency_groups
        actor_class: Any = remote(concurrency_groups={CHECKPOINT_WRITES: 1})(worker_class)
        options: dict[str, Any] = {
            "num_cpus": 0 if not on_gpu else 1,
            "num_gpus": 1 if on_gpu else 0,
            "resources": {ray_resource(role): 1},
            "max_restarts": 0,
        }
        json_text = spec_json(spec)
        for rank in range(self.world_size):
            naming = {"name": rank_name(role, rank), "lifetime": "detached"} if detached else {}
            self.actors.append(
                actor_class.options(**options, **naming).remote(json_text, rank, self.world_size)
            )
        address, port = ray.get(self.actors[0].rendezvous_address.remote(), timeout=setup_timeout_s)
        self._setup += [a.setup.remote(address, port, total_optimizer_steps) for a in self.actors]

    def _init(
        self,
        spec: RLHFJobSpec,
        role: str,
        role_spec: RoleSpec,
        setup_timeout_s: float,
        world_size: int | None,
    ) -> None:
        self.role = role
        self.world_size = role_ranks(role_spec) if world_size is None else world_size
        """The spec's ranks of the role, unless the run was started with others
        (`RunContext.zero_ranks`): the global batch is the same either way (`ShardPlan`)."""
        self.plan = ShardPlan(rollout_rows(spec), self.world_size, spec.algorithm.micro_batch_size)
        self.setup_timeout_s = setup_timeout_s
        self.actors: list[Any] = []
        self._setup: list[Any] = []

    @classmethod
    def of_actors(
        cls,
        spec: RLHFJobSpec,
        role: str,
        role_spec: RoleSpec,
        actors: list[Any],
        setup_timeout_s: float = 600.0,
    ) -> WorkerGroup:
        """A handle on ranks that run already, set up (adopted ones: `rlhf_trainer.run.startup`)."""
        group = cls.__new__(cls)
        group._init(spec, role, role_spec, setup_timeout_s, len(actors))
        group.actors = list(actors)
        return group

    def wait_ready(self) -> WorkerGroup:
        """Block until every rank has joined the group and built its engines."""
        self.wait(self._setup, timeout=self.setup_timeout_s)
        return self

    def submit(self, method: str, *args: Any, concurrency_group: str | None = None) -> list[Any]:
        """Start `method(*args)` on every rank (in `concurrency_group`, else the ranks' one
        training thread); returns the Ray object refs in rank order."""
        calls = [getattr(actor, method) for actor in self.actors]
        if concurrency_group is not None:
            calls = [call.options(concurrency_group=concurrency_group) for call in calls]
        return [call.remote(*args) for call in calls]

    @staticmethod
    def wait(refs: list[Any], timeout: float | None = None) -> list[Any]:
        return list(ray.get(refs, timeout=timeout))

    def call(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """`method(*args)` on every rank; the results in rank order."""
        return self.wait(self.submit(method, *args), timeout=timeout)

    def unshard(self, refs: list[Any], timeout: float | None = None) -> Tensor:
        """Wait for per-shard results (refs in rank order) and reassemble them in batch order."""
        return self.plan.unshard(self.wait(refs, timeout=timeout))

    def call_sharded(self, method: str, batch_ref: Any, timeout: float | None = None) -> Tensor:
        """A per-row result computed shard by shard, reassembled in batch order."""
        return self.unshard(self.submit(method, batch_ref), timeout=timeout)

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


@dataclass
class Scores:
    """The ranks' view of a rollout: log-probs before the update (None: the update makes
    them, `losses.old_logprobs_needed`), the reference's, values."""

    old_logprobs: Tensor | None
    ref_logprobs: Tensor | None
    values: Tensor | None


@dataclass(frozen=True)
class Groups:
    """The ZeRO-3 groups of a run, and the calls a step makes of them side by side."""

    policy: WorkerGroup
    reference: WorkerGroup | None = None
    critic: WorkerGroup | None = None

    def all(self) -> list[WorkerGroup]:
        return [g for g in (self.policy, self.reference, self.critic) if g is not None]

    @classmethod
    def of(cls, by_role: Mapping[str, WorkerGroup]) -> Groups:
        return cls(by_role["trainer"], by_role.get("reference"), by_role.get("critic"))

    def score(self, batch: Batch, with_reference: bool, with_old: bool = True) -> Scores:
        """Old log-probs (`with_old`), reference log-probs (`with_reference`: the reference
        role's, else the policy ranks hold the reference) and values, computed by the groups
        side by side."""
        batch_ref = ray.put(batch)
        old = self.policy.submit("logprobs", batch_ref) if with_old else []
        reference: list[Any] = []
        if self.reference is not None:
            reference = self.reference.submit("reference_logprobs", batch_ref)
        elif with_reference:
            reference = self.policy.submit("reference_logprobs", batch_ref)
        values = self.critic.submit("values", batch_ref) if self.critic is not None else []
        return Scores(
            old_logprobs=self.policy.unshard(old) if with_old else None,
            ref_logprobs=(self.reference or self.policy).unshard(reference) if reference else None,
            values=self.critic.unshard(values) if self.critic is not None else None,
        )

    def update(self, batch: Batch) -> tuple[dict[str, float], dict[str, float]]:
        """Policy and critic updates, concurrently; returns their group-wide metrics."""
        batch_ref = ray.put(batch)
        policy = self.policy.submit("train", batch_ref)
        critic = self.critic.submit("train", batch_ref) if self.critic is not None else []
        return WorkerGroup.wait(policy)[0], (WorkerGroup.wait(critic)[0] if critic else {})
