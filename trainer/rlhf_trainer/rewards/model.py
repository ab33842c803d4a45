"""The reward-model role (`reward.type: model`, or a `model` component of `combined`).

* `RewardModelScorer`: a Hugging Face sequence-classification checkpoint (`model.reward`) with
  its own tokenizer from the same directory; the score of a sample is the raw logit of label 0.
* `RewardModelActor`: one scorer in a Ray actor on the reward pool (one unit of the role's Ray
  resource, ``rlhf-role-reward``).
* `RewardModelFleet`: the driver's elastic view of the role (design decision 5), modelled on the
  rollout fleet (`rlhf_trainer.rollout.fleet`) but without weights to sync.

What the driver sends: texts or token ids
-----------------------------------------
The driver sends **texts** (`score`: prompt texts and response texts) whenever it can decode the
policy's token ids, which is always the case for a job with a tokenizer (text and chat
datasets). The scorer re-tokenizes ``prompt + response`` (plain concatenation of the two texts
as the policy saw and wrote them, special tokens as the reward tokenizer adds them by default)
with the reward model's own tokenizer, so a reward model whose tokenizer differs from the
policy's scores what the policy wrote. Only a job without a tokenizer (token-id tasks) sends
**token ids** (`score_ids`); those must then be in the reward model's vocabulary.

Scores
------
Samples are scored in right-padded batches of `batch_size` (``reward.batchSize``) with an
attention mask; the model pools the last non-pad token (Hugging Face's rule: the pad token is the
config's ``pad_token_id``, set from the tokenizer when the checkpoint lacks one). Sequences
longer than the model's ``max_position_embeddings`` keep their last tokens. Scoring is
deterministic: the fleet splits a call's samples into `desired` contiguous chunks whatever
number of actors lives (one actor call per chunk, round-robin), so the batches, and therefore the
scores, do not depend on how many actors are alive.

Losing actors
-------------
A scoring call that raises ``RayActorError`` (the actor's node went away with its pod) makes the
fleet kill that actor, log the loss and re-run its chunks on the survivors. Below the role's
minimum (``minReplicas`` x actors per replica; unset means every replica) it raises
`RewardCapacityError`, which the driver reports as a retryable failure, like
`rlhf_trainer.rollout.fleet.RolloutCapacityError`. `maintain`, at the start of each step, starts
replacements without waiting (they queue until a reward node has room) and admits those that
answer ``ping``; a replacement that cannot be placed never blocks a step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlhf_trainer.elastic import ElasticPool, Member, RoleWords, plan_chunks

if TYPE_CHECKING:
    from rlhfjob.api import ElasticRoleSpec, RLHFJobSpec

SCORE_TIMEOUT_S = 1800.0
"""Bound on one scoring call of the fleet (all its chunks), as seen by the driver."""
JOIN_TIMEOUT_S = 600.0
"""How long `score` waits for an actor to come up when none is live (a role of minimum 0)."""
READY_TIMEOUT_S = 600.0
"""How long `wait_ready` waits at startup for the actors to load their model."""
ADMIT_TIMEOUT_S = 0.5
"""How long `maintain` waits for starting actors to answer ``ping`` (short: never a step)."""
ACTOR_NAME_PREFIX = "reward-model-"
"""Detached reward-model actors are named ``reward-model-<id>`` in the job's Ray namespace."""


# --------------------------------------------------------------------------------------------
# The scorer


class RewardModelScorer:
    """A sequence-classification reward model and its own tokenizer, from one directory.

    On the CPU it runs in float32; on a GPU (when one is visible, or `device` says so) in
    `dtype`, by default the checkpoint's own dtype. Eval mode, no gradients.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        device: torch.device | str | None = None,
        dtype: str | None = None,
        num_threads: int | None = None,
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cpu":
            torch_dtype: Any = torch.float32
        else:
            torch_dtype = "auto" if dtype is None else getattr(torch, dtype)
        self.path = str(path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=torch_dtype)
        self.model = model.to(self.device).eval()
        config = self.model.config
        if config.pad_token_id is None:
            pad = self.tokenizer.pad_token_id
            if pad is None:
                pad = self.tokenizer.eos_token_id
            if pad is None:
                raise ValueError(
                    f"{self.path}: neither the model nor its tokenizer has a pad token"
                )
            config.pad_token_id = int(pad)
        self.pad_token_id = int(config.pad_token_id)
        self.max_length: int | None = getattr(config, "max_position_embeddings", None)

    def tokenize(
        self, prompt_texts: Sequence[str], response_texts: Sequence[str]
    ) -> list[list[int]]:
        """``prompt + response`` of each sample in the reward model's own vocabulary."""
        if len(prompt_texts) != len(response_texts):
            raise ValueError(
                f"{len(prompt_texts)} prompts but {len(response_texts)} responses to score"
            )
        texts = [
            prompt + response for prompt, response in zip(prompt_texts, response_texts, strict=True)
        ]
        return self.tokenize_texts(texts)

    def tokenize_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text in the reward model's own vocabulary (with its default special tokens)."""
        # A sample whose text is empty (an empty prompt and a response of special tokens only,
        # which decode to nothing) is scored as the end-of-sequence token alone: every sample
        # gets a score, none fails the step.
        empty = [self.tokenizer.eos_token_id or self.pad_token_id]
        return [list(ids) or empty for ids in self.tokenizer(texts)["input_ids"]]

    def score(
        self, prompt_texts: Sequence[str], response_texts: Sequence[str], batch_size: int = 32
    ) -> list[float]:
        """The reward of each (prompt, response), re-tokenized with the reward tokenizer."""
        return self.score_ids(self.tokenize(prompt_texts, response_texts), batch_size)

    def score_ids(self, sequences: Sequence[Sequence[int]], batch_size: int = 32) -> list[float]:
        """The reward of each token sequence (ids in the reward model's vocabulary): the logit
        of label 0."""
        return [row[0] for row in self.logits(sequences, batch_size)]

    @torch.no_grad()
    def logits(self, sequences: Sequence[Sequence[int]], batch_size: int = 32) -> list[list[float]]:
        """Every label's logit for each token sequence, in right-padded batches."""
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        rows = [list(sequence) for sequence in sequences]
        if any(not row for row in rows):
            raise ValueError("every sequence to score needs at least one token")
        if self.max_length is not None:
            rows = [row[-self.max_length :] for row in rows]
        logits: list[list[float]] = []
        for start in range(0, len(rows), batch_size):
            logits.extend(self._logits_batch(rows[start : start + batch_size]))
        return logits

    def _logits_batch(self, rows: list[list[int]]) -> list[list[float]]:
        width = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
        for index, row in enumerate(rows):  # right padding
            input_ids[index, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention_mask[index, : len(row)] = 1
        output = self.model(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)
        )
        return [[float(v) for v in row] for row in output.logits.float().cpu().tolist()]


# --------------------------------------------------------------------------------------------
# The Ray actor and how to start it


class RewardModelActor:
    """One `RewardModelScorer` inside a Ray actor on the reward pool. `tag` identifies the job
    spec that started it (``ping`` returns it)."""

    def __init__(self, path: str, options: dict[str, Any], tag: str = "") -> None:
        self.tag = tag
        self.scorer = RewardModelScorer(path, **options)

    def ping(self) -> str:
        """Cheap liveness check; answers once the model is loaded."""
        return self.tag

    def score(
        self, prompt_texts: list[str], response_texts: list[str], batch_size: int
    ) -> list[float]:
        return self.scorer.score(prompt_texts, response_texts, batch_size)

    def score_ids(self, sequences: list[list[int]], batch_size: int) -> list[float]:
        return self.scorer.score_ids(sequences, batch_size)

    def pid(self) -> int:
        """The actor's process id (fault-injection tests kill it)."""
        return os.getpid()


def actor_name(actor_id: int) -> str:
    return f"{ACTOR_NAME_PREFIX}{actor_id}"


class RewardModelLauncher:
    """Starts reward-model actors on the reward pool, each one the same way.

    Each actor requests one unit of the reward role's Ray resource (``rlhf-role-reward``,
    `rlhfjob.api.ray_resource`), so it lands on a reward node, and one GPU when the role has
    GPUs. On the CPU it reserves no CPU by default (`num_cpus`): the role resource already bounds
    how many share a node. With `detached`, actors are named (`actor_name`) and outlive the
    driver. `start` is asynchronous (``ray.get`` of ``ping`` waits until the model is loaded).
    """

    def __init__(
        self,
        path: str,
        *,
        gpus: int = 0,
        dtype: str | None = None,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        scorer_options: dict[str, Any] | None = None,
        resource_units: float = 1,
        detached: bool = False,
        tag: str = "",
    ) -> None:
        from rlhfjob import api

        on_gpu = gpus > 0 if num_gpus is None else num_gpus > 0
        self.path = path
        self.detached = detached
        self.tag = tag
        self.options: dict[str, Any] = dict(scorer_options or {})
        if on_gpu:
            if dtype is not None:
                self.options.setdefault("dtype", dtype)
        else:
            self.options.setdefault("device", "cpu")
        self.actor_options: dict[str, Any] = {
            "num_gpus": (1 if on_gpu else 0) if num_gpus is None else num_gpus,
            "num_cpus": (1 if on_gpu else 0) if num_cpus is None else num_cpus,
            "resources": {api.ray_resource("reward"): resource_units},
            "max_restarts": 0,  # a lost actor is replaced by a new one
        }

    @classmethod
    def from_spec(cls, spec: RLHFJobSpec, **options: Any) -> RewardModelLauncher:
        """The launcher of a job's reward role (``roles.reward``, ``model.reward``); on GPUs the
        model runs in the checkpoint's own dtype unless `dtype` says otherwise."""
        role = _reward_role(spec)
        if spec.model.reward is None:
            raise ValueError("the reward-model role needs model.reward")
        options.setdefault("gpus", role.gpus)
        return cls(spec.model.reward, **options)

    def start(self, actor_id: int) -> Any:
        import ray

        actor_options = dict(self.actor_options)
        if self.detached:
            actor_options.update(name=actor_name(actor_id), lifetime="detached")
        actor_class = ray.remote(RewardModelActor)
        return actor_class.options(**actor_options).remote(self.path, self.options, self.tag)


def _reward_role(spec: RLHFJobSpec) -> ElasticRoleSpec:
    if spec.roles.reward is None:
        raise ValueError("the reward-model role needs roles.reward")
    return spec.roles.reward


def desired_reward_actors(spec: RLHFJobSpec) -> int:
    """Reward-model actors (and scoring chunks) of a job: replicas x actors per replica."""
    from rlhf_trainer.topology import role_ranks

    return role_ranks(_reward_role(spec))


def minimum_reward_actors(spec: RLHFJobSpec) -> int:
    """Fewest live reward-model actors training goes on with: `minReplicas` (default: every
    replica) x actors per replica."""
    from rlhfjob.api import actor_slots

    role = _reward_role(spec)
    return role.effective_min_replicas * actor_slots(role)


# --------------------------------------------------------------------------------------------
# The fleet


class RewardCapacityError(RuntimeError):
    """Fewer live reward-model actors than the role's minimum: the step cannot go on (retryable:
    the operator restarts from the last checkpoint once the pool has recovered)."""


REWARD_MODELS = RoleWords(
    "reward model", "reward-model actors", "reward models", "reward", RewardCapacityError
)


class RewardModelFleet(ElasticPool[Member]):
    """The reward-model actors of a run, used as one scorer that survives losing some of them.

    `start_actor(id)` starts one actor (`RewardModelLauncher.start`); an actor is up once it
    answers ``ping`` (its model is loaded). The rest as `ElasticPool`.
    """

    def __init__(
        self,
        start_actor: Callable[[int], Any],
        *,
        desired: int,
        minimum: int,
        log: Callable[[str], None] = print,
        on_change: Callable[[int, int], None] | None = None,
        score_timeout_s: float = SCORE_TIMEOUT_S,
        join_timeout_s: float = JOIN_TIMEOUT_S,
        admit_timeout_s: float = ADMIT_TIMEOUT_S,
    ) -> None:
        super().__init__(
            REWARD_MODELS,
            start_actor,
            lambda actor_id, actor: Member(actor_id, actor, actor.ping.remote()),
            desired=desired,
            minimum=minimum,
            log=log,
            on_change=on_change,
            join_timeout_s=join_timeout_s,
            admit_timeout_s=admit_timeout_s,
        )
        self.score_timeout_s = score_timeout_s

    @classmethod
    def from_spec(
        cls,
        spec: RLHFJobSpec,
        log: Callable[[str], None] = print,
        *,
        start: bool = True,
        on_change: Callable[[int, int], None] | None = None,
        **launcher_options: Any,
    ) -> RewardModelFleet:
        """The fleet of a job's reward role; with `start`, its actors are started (not waited
        for: call `wait_ready`). `launcher_options` go to `RewardModelLauncher.from_spec`."""
        launcher = RewardModelLauncher.from_spec(spec, **launcher_options)
        fleet = cls(
            launcher.start,
            desired=desired_reward_actors(spec),
            minimum=minimum_reward_actors(spec),
            log=log,
            on_change=on_change,
        )
        if start:
            fleet.start(fleet.desired)
        return fleet

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S, grace_s: float = 30.0) -> None:
        """`ElasticPool.wait_ready`, with the reward role's default timeout."""
        super().wait_ready(timeout_s, grace_s)

    def score(
        self, prompt_texts: Sequence[str], response_texts: Sequence[str], batch_size: int
    ) -> list[float]:
        """The reward of each (prompt, response) from the live actors, in sample order (the
        texts are re-tokenized with the reward model's tokenizer; see the module docstring)."""
        if len(prompt_texts) != len(response_texts):
            raise ValueError(
                f"{len(prompt_texts)} prompts but {len(response_texts)} responses to score"
            )
        prompts, responses = list(prompt_texts), list(response_texts)
        return self._run(
            len(prompts),
            lambda actor, start, stop: actor.score.remote(
                prompts[start:stop], responses[start:stop], batch_size
            ),
        )

    def score_ids(self, sequences: Sequence[Sequence[int]], batch_size: int) -> list[float]:
        """The reward of each token sequence (ids in the reward model's vocabulary: only for
        jobs without a tokenizer to decode with)."""
        rows = [list(sequence) for sequence in sequences]
        return self._run(
            len(rows),
            lambda actor, start, stop: actor.score_ids.remote(rows[start:stop], batch_size),
        )

    def _run(self, count: int, call: Callable[[Any, int, int], Any]) -> list[float]:
        """Split `count` samples into `desired` chunks, one call each, round-robin over the
        live actors; re-run the chunks of lost actors on the survivors."""
        if self.live and len(self.live) < self.minimum:
            raise RewardCapacityError(
                f"{len(self.live)}/{self.desired} reward-model actors live, fewer than the "
                f"minimum {self.minimum}"
            )
        chunks = plan_chunks(count, self.desired)
        results = self.fan_out(
            chunks,
            lambda member, chunk: call(member.actor, chunk.start, chunk.stop),
            timeout_s=self.score_timeout_s,
            during="scoring",
        )
        return [score for chunk in chunks for score in results[chunk.index]]
