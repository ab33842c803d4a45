"""Rollout engines behind `RolloutEngine` (design decision 8), and their Ray actors.

* `HFEngine`: Hugging Face transformers on CPU (tests, the local demo). Batched, KV-cached
  sampling written out here, so log-probs and seeding are exactly what this module documents.
* `VLLMEngine`: vLLM 0.24's offline `LLM` on GPUs, token ids in and out (no tokenizer). vLLM is
  imported lazily: CPU code never imports it.
* `RolloutEngineActor` / `EngineLauncher` / `create_rollout_engines`: one engine per Ray actor
  on the rollout pool.

Log-probs (both engines)
------------------------
``Completion.logprobs[t]`` is ``log_softmax(logits_t / temperature)[token_t]`` over the whole
vocabulary: the temperature-scaled distribution **before** top-p truncation, as
`rlhf_trainer.algo.formulas.logprobs_from_logits` recomputes it on the trainer. Temperature 0 means
greedy decoding, with log-probs of the unscaled logits. (vLLM runs with
``logprobs_mode="processed_logprobs"``; it matches this exactly when ``top_p == 1``, which is the
usual RLHF setting. With ``top_p < 1`` vLLM renormalises over the nucleus, the HF engine does not.)

Stopping: a completion ends after ``max_tokens`` tokens or right after a token in
``stop_token_ids``, which is included. The model's own EOS is not implied: pass it in
``stop_token_ids``.

Weights and versions
--------------------
A new engine reports ``policy_version() == 0``. vLLM built from a config starts from vLLM's
dummy weights, not the trainer's, so the driver always syncs once before the first rollout
(`rlhf_trainer.rollout.weight_sync` describes the wiring). Both engines receive syncs through the
same four calls, which the Ray actor forwards: ``weight_sync_ranks()`` (ranks this engine occupies
in the sync group: 1 for HF, ``tensor_parallel_size`` for vLLM), ``init_weight_sync(info,
first_rank)``, ``receive_weights(plan) -> SyncStats`` and ``close_weight_sync()``. An engine
whose sync failed part-way refuses to generate until a later load succeeds.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from rlhf_trainer.modeling.logprobs import logprobs_from_logits
from rlhf_trainer.rollout.base import Completion, SamplingParams, prompt_sample_seed
from rlhf_trainer.rollout.model_source import GREEDY_TEMPERATURE, ModelSource
from rlhf_trainer.rollout.sync_plan import SyncPlan, dtype_name
from rlhf_trainer.rollout.vllm_engine import VLLMEngine
from rlhf_trainer.rollout.weight_sync import (
    NamedTensors,
    SyncGroupInfo,
    SyncStats,
    WeightSyncReceiver,
)
from rlhf_trainer.seeds import derive_seed

if TYPE_CHECKING:
    from rlhf_trainer.rollout.base import RolloutEngine
    from rlhfjob.api import RolloutRoleSpec

# --------------------------------------------------------------------------------------------
# Hugging Face transformers engine (CPU, tests)
# --------------------------------------------------------------------------------------------


class HFEngine:
    """`RolloutEngine` on Hugging Face transformers, for CPU runs and tests.

    All ``len(prompts) * n`` samples are decoded together in batches of `max_batch_size`
    rows, left-padded with an attention mask and a KV cache. Sampling draws from one
    ``torch.Generator`` seeded by ``SamplingParams.seed``, so a call is reproducible given the
    seed, the weights and the prompts (``seed=None``: fresh randomness).
    """

    def __init__(
        self,
        model: ModelSource | Any,
        *,
        device: torch.device | str = "cpu",
        max_batch_size: int = 64,
        num_threads: int | None = None,
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        self.model = model.build(self.device) if isinstance(model, ModelSource) else model
        self.model.eval()
        self.max_batch_size = max_batch_size
        self._version = 0
        self._consistent = True  # False while (or after failing) loading a partial sync
        self._parameters = dict(self.model.named_parameters(remove_duplicate=False))
        self._receiver: WeightSyncReceiver | None = None
        # transformers renamed `past_key_values` to `cache` (5.2x); accept either.
        forward_parameters = inspect.signature(self.model.forward).parameters
        self._cache_keyword = "cache" if "cache" in forward_parameters else "past_key_values"

    # ---- RolloutEngine -----------------------------------------------------------------

    def policy_version(self) -> int:
        return self._version

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        if not self._consistent:
            raise RuntimeError("the last weight load failed part-way; load weights again first")
        if sampling.max_tokens < 1 or sampling.n < 1:
            raise ValueError("max_tokens and n must be at least 1")
        if any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("every prompt needs at least one token")
        generators = chosen = self._generators(len(prompts), sampling)
        rows = [prompt for prompt in prompts for _ in range(sampling.n)]
        sampled: list[tuple[list[int], list[float]]] = []
        for start in range(0, len(rows), self.max_batch_size):
            batch = rows[start : start + self.max_batch_size]
            if sampling.prompt_seeds:  # one generator per row
                chosen = generators[start : start + self.max_batch_size]
            sampled.extend(self._sample_batch(batch, sampling, chosen))
        return [
            [
                Completion(
                    token_ids=ids,
                    logprobs=logprobs if sampling.logprobs else [],
                    policy_version=self._version,
                )
                for ids, logprobs in sampled[i * sampling.n : (i + 1) * sampling.n]
            ]
            for i in range(len(prompts))
        ]

    def _generators(self, prompts: int, sampling: SamplingParams) -> list[torch.Generator]:
        """One generator for the call (`seed`), or one per row (`prompt_seeds`): a row's
        samples then depend on its prompt's seed alone, not on the rest of the batch."""

        def generator(seed: int) -> torch.Generator:
            return torch.Generator(device=self.device).manual_seed(seed)

        if sampling.prompt_seeds:
            if len(sampling.prompt_seeds) != prompts:
                raise ValueError(f"{len(sampling.prompt_seeds)} prompt seeds for {prompts} prompts")
            return [
                generator(prompt_sample_seed(seed, sample))
                for seed in sampling.prompt_seeds
                for sample in range(sampling.n)
            ]
        seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8)) >> 2
        return [generator(seed)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy tensors into the parameters of the same Hugging Face name, then adopt `version`.

        Names, shapes and dtypes must match exactly (a mismatch raises rather than casting);
        tied parameters answer to each of their names.
        """
        self._consistent = False
        self.copy_weights(list(weights))
        self.set_version(version)

    def set_version(self, version: int) -> None:
        """Adopt `version` once every tensor of it was copied (`copy_weights`)."""
        self._version = int(version)
        self._consistent = True

    # ---- weight sync (see rlhf_trainer.rollout.weight_sync) ------------------------------------

    def weight_sync_ranks(self) -> int:
        return 1

    def init_weight_sync(self, info: SyncGroupInfo | dict[str, Any], first_rank: int) -> None:
        """Join the sync group as `first_rank`; blocks until the whole group has joined."""
        info = SyncGroupInfo.from_dict(info)
        device = self.device if info.backend == "nccl" else torch.device("cpu")
        self.close_weight_sync()
        self._receiver = WeightSyncReceiver(info, first_rank, device=device)

    def receive_weights(self, plan: SyncPlan | dict[str, Any]) -> SyncStats:
        """Receive one sync (concurrently with the sender's ``send``) and adopt its version."""
        if self._receiver is None:
            raise RuntimeError("init_weight_sync() first")
        plan = SyncPlan.from_dict(plan)
        self._consistent = False
        stats = self._receiver.receive(plan, self.copy_weights)
        self._version = plan.version
        self._consistent = True
        return stats

    def close_weight_sync(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    def broadcast_bytes(self, nbytes: int, repeats: int = 5) -> list[float]:
        """Receiving side of a bare-broadcast measurement (`WeightSyncSender.broadcast_bytes`)."""
        if self._receiver is None:
            raise RuntimeError("init_weight_sync() first")
        return self._receiver.broadcast_bytes(nbytes, repeats)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Parameters by Hugging Face name (tied ones under each name); for checks and tests."""
        return dict(self._parameters)

    # ---- internals ---------------------------------------------------------------------

    @torch.no_grad()
    def copy_weights(self, weights: NamedTensors) -> None:
        """Copy tensors into the parameters of the same name; the engine refuses to generate
        until `set_version` says the load is complete."""
        self._consistent = False
        for name, tensor in weights:
            target = self._parameters.get(name)
            if target is None:
                raise KeyError(f"the model has no parameter named {name!r}")
            if target.shape != tensor.shape or target.dtype != tensor.dtype:
                raise ValueError(
                    f"{name}: got {tuple(tensor.shape)} {dtype_name(tensor.dtype)}, the model "
                    f"holds {tuple(target.shape)} {dtype_name(target.dtype)}"
                )
            target.copy_(tensor)

    def _sample_batch(
        self,
        prompts: Sequence[list[int]],
        sampling: SamplingParams,
        generators: list[torch.Generator],
    ) -> list[tuple[list[int], list[float]]]:
        """Decode one batch of rows, drawing from one generator or one per row; returns
        (token ids, log-probs) per row."""
        rows = len(prompts)
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        attention_mask = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):  # left padding: the last column is the newest
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        positions = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
        output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        greedy = sampling.temperature < GREEDY_TEMPERATURE
        temperature = 1.0 if greedy else sampling.temperature
        stop = torch.tensor(sorted(set(sampling.stop_token_ids)), dtype=torch.long)
        finished = torch.zeros(rows, dtype=torch.bool)
        lengths = torch.full((rows,), sampling.max_tokens, dtype=torch.long)
        tokens: list[torch.Tensor] = []
        logprobs: list[torch.Tensor] = []
        next_position = positions[:, -1]
        for step in range(sampling.max_tokens):
            logits = output.logits[:, -1, :].float()
            if greedy:
                token = logits.argmax(dim=-1)
            else:
                probs = _top_p_filter(torch.softmax(logits / temperature, dim=-1), sampling.top_p)
                token = _draw(probs, generators)
            tokens.append(token)
            logprobs.append(logprobs_from_logits(logits, token, temperature))
            newly_stopped = torch.isin(token.cpu(), stop) & ~finished
            lengths[newly_stopped] = step + 1
            finished |= newly_stopped
            if bool(finished.all()) or step + 1 == sampling.max_tokens:
                break
            # Finished rows keep decoding (their tokens are cut off below): simpler than
            # shrinking the batch and its cache, and cheap at CPU-test sizes.
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(rows, 1)], dim=1)
            next_position = next_position + 1
            output = self.model(
                input_ids=token.unsqueeze(-1),
                attention_mask=attention_mask,
                position_ids=next_position.unsqueeze(-1),
                use_cache=True,
                **{self._cache_keyword: getattr(output, self._cache_keyword)},
            )
        token_matrix = torch.stack(tokens, dim=1).cpu()
        logprob_matrix = torch.stack(logprobs, dim=1).cpu()
        return [
            (
                token_matrix[row, : lengths[row]].tolist(),
                logprob_matrix[row, : lengths[row]].tolist(),
            )
            for row in range(rows)
        ]


def _draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row: from one generator for the batch, or each row from its own."""
    if len(generators) == 1:
        return torch.multinomial(probs, 1, generator=generators[0]).squeeze(-1)
    return torch.cat(
        [
            torch.multinomial(row, 1, generator=generator)
            for row, generator in zip(probs, generators, strict=True)
        ]
    )


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the smallest set of tokens whose mass reaches `top_p`."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


# --------------------------------------------------------------------------------------------
# Ray actors on the rollout pool
# --------------------------------------------------------------------------------------------

EngineBackend = Literal["hf", "vllm"]


class RolloutEngineActor:
    """One engine inside a Ray actor; its methods are the engine's (see the module docstring).

    `create_rollout_engines` starts these; the driver calls ``generate``, ``policy_version``,
    ``load_weights`` and the four weight-sync methods with ``.remote(...)``. `tag` identifies
    the job spec that started it, so a later driver adopts only engines of its own spec
    (``ping``).
    """

    def __init__(
        self,
        backend: EngineBackend,
        model: ModelSource,
        options: dict[str, Any],
        tag: str = "",
    ) -> None:
        self.tag = tag
        self.engine: HFEngine | VLLMEngine
        if backend == "hf":
            self.engine = HFEngine(model, **options)
        elif backend == "vllm":
            self.engine = VLLMEngine(model, **options)
        else:
            raise ValueError(f"unknown rollout backend {backend!r}")

    def ping(self) -> str:
        """Cheap liveness check; returns the tag (a driver adopting engines compares it)."""
        return self.tag

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        return self.engine.generate(prompts, sampling)

    def policy_version(self) -> int:
        return self.engine.policy_version()

    def load_weights(self, weights: list[tuple[str, torch.Tensor]], version: int) -> None:
        self.engine.load_weights(weights, version)

    def weight_sync_ranks(self) -> int:
        return self.engine.weight_sync_ranks()

    def init_weight_sync(self, info: SyncGroupInfo | dict[str, Any], first_rank: int) -> None:
        self.engine.init_weight_sync(info, first_rank)

    def receive_weights(self, plan: SyncPlan | dict[str, Any]) -> SyncStats:
        return self.engine.receive_weights(plan)

    def close_weight_sync(self) -> None:
        self.engine.close_weight_sync()

    def broadcast_bytes(self, nbytes: int, repeats: int = 5) -> list[float]:
        return self.engine.broadcast_bytes(nbytes, repeats)

    def pid(self) -> int:
        """The actor's process id (fault-injection tests kill it)."""
        return os.getpid()


ENGINE_NAME_PREFIX = "rollout-engine-"
"""Named engines are ``rollout-engine-<id>`` in the job's Ray namespace."""


def engine_name(engine_id: int) -> str:
    return f"{ENGINE_NAME_PREFIX}{engine_id}"


def engine_id_from_name(name: str) -> int | None:
    """The id in an engine's actor name, or None for another actor's name."""
    suffix = name.removeprefix(ENGINE_NAME_PREFIX)
    return int(suffix) if suffix != name and suffix.isdigit() else None


class EngineLauncher:
    """Starts rollout engine actors on the rollout pool, each one the same way.

    Each actor requests one unit of the rollout role's Ray resource (``rlhf-role-rollout``,
    `rlhfjob.api.ray_resource`), so it lands on a rollout node, plus ``tensor_parallel_size``
    GPUs for vLLM. HF engines reserve no CPU by default (`num_cpus`): the role resource already
    bounds how many share a node. `num_gpus` overrides the GPU request (e.g. a fraction to share
    one GPU with the trainer). With `detached`, engines are named (`engine_name`) and outlive the
    driver, so a restarted driver can adopt them (the driver's Ray namespace keeps jobs apart).

    `start` is asynchronous: an engine that cannot be placed yet (no rollout node has a free
    slot) waits in Ray's queue until one joins. ``ray.get`` any method (e.g. ``ping``) to wait.
    """

    def __init__(
        self,
        spec: RolloutRoleSpec,
        model: ModelSource,
        *,
        seed: int = 0,
        enforce_eager: bool = False,
        max_model_len: int | None = None,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        engine_options: dict[str, Any] | None = None,
        detached: bool = False,
        tag: str = "",
    ) -> None:
        from rlhfjob import api

        self.spec = spec
        self.model = model
        self.seed = seed
        self.detached = detached
        self.tag = tag
        options: dict[str, Any] = dict(engine_options or {})
        resources = {api.ray_resource("rollout"): 1}
        if spec.backend == "vllm":
            options.setdefault("tensor_parallel_size", spec.tensor_parallel_size)
            options.setdefault("gpu_memory_utilization", spec.gpu_memory_utilization)
            options.setdefault("enforce_eager", enforce_eager)
            options.setdefault("max_model_len", max_model_len)
            self.actor_options: dict[str, Any] = {
                "num_gpus": spec.tensor_parallel_size if num_gpus is None else num_gpus,
                "num_cpus": 1 if num_cpus is None else num_cpus,
                "resources": resources,
            }
        else:
            self.actor_options = {
                "num_gpus": 0 if num_gpus is None else num_gpus,
                "num_cpus": 0 if num_cpus is None else num_cpus,
                "resources": resources,
            }
        self.actor_options["max_restarts"] = 0  # a lost engine is replaced by a new one
        self.options = options

    def start(self, engine_id: int) -> Any:
        """Start engine `engine_id` (its vLLM seed and, if detached, its name derive from it)."""
        import ray

        options = dict(self.options)
        if self.spec.backend == "vllm":
            options.setdefault("seed", derive_seed(self.seed, engine_id) % 2**31)
        actor_options = dict(self.actor_options)
        if self.detached:
            actor_options.update(name=engine_name(engine_id), lifetime="detached")
        actor_class = ray.remote(RolloutEngineActor)
        return actor_class.options(**actor_options).remote(
            self.spec.backend, self.model, options, self.tag
        )


def create_rollout_engines(
    spec: RolloutRoleSpec, model: ModelSource, count: int | None = None, **options: Any
) -> list[Any]:
    """Start `count` rollout engines as Ray actors on the rollout pool, each by an
    ``EngineLauncher(spec, model, **options)`` (its keyword options: seed, GPUs, ...).

    `count` defaults to every slot of the role (``replicas`` x engines per replica).
    Construction is asynchronous: ``ray.get`` any method (e.g. ``policy_version``) to wait
    until an engine is up.
    """
    from rlhf_trainer.topology import role_ranks

    launcher = EngineLauncher(spec, model, **options)
    return [launcher.start(index) for index in range(role_ranks(spec) if count is None else count)]


if TYPE_CHECKING:  # mypy: both engines implement the protocol
    _hf_engine: type[RolloutEngine] = HFEngine
    _vllm_engine: type[RolloutEngine] = VLLMEngine
