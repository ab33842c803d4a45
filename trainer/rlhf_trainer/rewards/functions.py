"""Rule rewards: a user function named by a ``module:function`` string (design decision 10).

A reward function scores a batch of generated responses. Its signature is::

    def my_reward(
        prompts: list[list[int]],      # prompt token ids, one list per sample
        responses: list[list[int]],    # generated token ids, one list per sample
        metadata: list[dict[str, Any]],  # per-sample fields from the dataset (answer, task, ...)
    ) -> list[float]:                  # one finite reward per sample

It works on token ids, so it runs with tiny test models that have no tokenizer. The lists have
the same length; a prompt sampled ``n`` times for GRPO appears ``n`` times.

**Text.** A function that names a parameter ``prompt_texts`` or ``response_texts`` is called by
keyword instead, with exactly the parameters it declares of ``prompts``, ``responses``,
``metadata``, ``prompt_texts`` and ``response_texts`` (the texts decoded with the job's tokenizer,
special tokens left out)::

    def exact_answer(response_texts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        ...

Such a function needs a tokenizer (``spec.model.tokenizer``); without one it is refused at start.

Problems with the function itself (it cannot be imported, is not callable, raises, returns the
wrong number of values or a non-finite value) raise :class:`RewardFunctionError`. Retrying does
not fix these, so the operator fails the job instead of restarting it.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

RewardFunction = Callable[..., Sequence[float]]
"""``fn(prompts, responses, metadata) -> rewards``, or by keyword; see the module docstring."""
Decode = Callable[[list[int]], str]
"""Token ids to text (the job's tokenizer, special tokens left out)."""

TEXT_PARAMETERS = ("prompt_texts", "response_texts")
KEYWORD_PARAMETERS = ("prompts", "responses", "metadata", *TEXT_PARAMETERS)
"""What a keyword-called reward function may ask for."""


class RewardFunctionError(Exception):
    """The configured reward function is unusable; retrying the job will not help."""

    def __init__(self, spec: str, problem: str) -> None:
        super().__init__(f"reward function {spec!r}: {problem}")
        self.spec = spec
        self.problem = problem


FORMER_MODULES = {
    "rlhf_trainer.tasks": "rlhf_trainer.data.tasks",
    "rlhf_trainer.text_rewards": "rlhf_trainer.rewards.text",
}
"""Modules job files named before the trainer was split into sub-packages: they still work."""


def load_reward_function(spec: str) -> RewardFunction:
    """Import the callable named by ``spec``, e.g. ``"my_pkg.rewards:exact_match"``.

    The part after the colon may be a dotted path (``"mod:Class.method"``). Raises
    :class:`RewardFunctionError` naming ``spec`` when the string is malformed, the module cannot
    be imported, the attribute is missing, or it is not callable.
    """
    module_name, separator, attribute_path = spec.partition(":")
    if not separator or not module_name or not attribute_path:
        raise RewardFunctionError(spec, "expected the form 'module:function'")
    module_name = FORMER_MODULES.get(module_name, module_name)

    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or module_name
        if module_name == missing or module_name.startswith(f"{missing}."):
            raise RewardFunctionError(spec, f"module {module_name!r} not found") from error
        raise RewardFunctionError(
            spec, f"importing module {module_name!r} failed: {error}"
        ) from error
    except Exception as error:
        raise RewardFunctionError(
            spec, f"importing module {module_name!r} failed: {type(error).__name__}: {error}"
        ) from error

    for name in attribute_path.split("."):
        try:
            target = getattr(target, name)
        except AttributeError as error:
            raise RewardFunctionError(
                spec, f"module {module_name!r} has no attribute {attribute_path!r}"
            ) from error
    if not callable(target):
        raise RewardFunctionError(spec, f"{attribute_path!r} is not callable")
    return target


def keyword_parameters(spec: str, function: RewardFunction) -> tuple[str, ...] | None:
    """The parameters a text reward function declares (called by keyword), or None for the
    positional ``(prompts, responses, metadata)`` form."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # builtins without a signature: the positional form
        return None
    if not any(name in parameters for name in TEXT_PARAMETERS):
        return None
    for name, parameter in parameters.items():
        is_required = parameter.default is inspect.Parameter.empty and parameter.kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        )
        if name not in KEYWORD_PARAMETERS and is_required:
            raise RewardFunctionError(
                spec,
                f"parameter {name!r} is not one the trainer passes "
                f"(it passes {', '.join(KEYWORD_PARAMETERS)})",
            )
    return tuple(name for name in KEYWORD_PARAMETERS if name in parameters)


def checked_batch(
    prompts: list[list[int]], responses: list[list[int]], metadata: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The batch's metadata (empty records when there is none); ValueError when the prompts,
    responses and metadata differ in length. Every reward source checks its input with it."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if metadata is None:
        return [{} for _ in responses]
    if len(metadata) != len(responses):
        raise ValueError(f"{len(metadata)} metadata entries but {len(responses)} responses")
    return metadata


@dataclass
class RuleReward:
    """A loaded reward function plus the checks that make its mistakes fail loudly.

    ``RuleReward.from_spec("pkg.mod:fn", decode)`` loads once; calling it scores a batch and
    returns a list of floats, raising :class:`RewardFunctionError` on a bad result.
    """

    spec: str
    function: RewardFunction = field(repr=False)
    keywords: tuple[str, ...] | None = None
    """The parameters of a keyword-called (text) function; None: positional."""
    decode: Decode | None = field(default=None, repr=False)

    @classmethod
    def from_spec(cls, spec: str, decode: Decode | None = None) -> RuleReward:
        function = load_reward_function(spec)
        keywords = keyword_parameters(spec, function)
        if keywords is not None and decode is None and set(keywords) & set(TEXT_PARAMETERS):
            raise RewardFunctionError(
                spec,
                "takes text, which needs a tokenizer: set spec.model.tokenizer, or use a "
                "policy directory with one",
            )
        return cls(spec=spec, function=function, keywords=keywords, decode=decode)

    def __call__(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        metadata: list[dict[str, Any]] | None = None,
    ) -> list[float]:
        metadata = checked_batch(prompts, responses, metadata)

        try:
            if self.keywords is None:
                raw = self.function(prompts, responses, metadata)
            else:
                raw = self.function(**self._arguments(prompts, responses, metadata))
        except Exception as error:
            raise RewardFunctionError(
                self.spec, f"raised {type(error).__name__}: {error}"
            ) from error
        return self._validated(raw, expected_count=len(responses))

    def _arguments(
        self, prompts: list[list[int]], responses: list[list[int]], metadata: list[dict[str, Any]]
    ) -> dict[str, Any]:
        assert self.keywords is not None
        available: dict[str, Callable[[], Any]] = {
            "prompts": lambda: prompts,
            "responses": lambda: responses,
            "metadata": lambda: metadata,
            "prompt_texts": lambda: self._texts(prompts),
            "response_texts": lambda: self._texts(responses),
        }
        return {name: available[name]() for name in self.keywords}

    def _texts(self, token_ids: list[list[int]]) -> list[str]:
        assert self.decode is not None
        return [self.decode(ids) for ids in token_ids]

    def _validated(self, raw: Any, expected_count: int) -> list[float]:
        if hasattr(raw, "tolist"):  # numpy arrays and torch tensors
            raw = raw.tolist()
        if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
            raise RewardFunctionError(
                self.spec, f"returned {type(raw).__name__}, expected a list of floats"
            )
        if len(raw) != expected_count:
            raise RewardFunctionError(
                self.spec, f"returned {len(raw)} rewards for {expected_count} responses"
            )
        rewards = []
        for index, value in enumerate(raw):
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise RewardFunctionError(
                    self.spec, f"reward {index} is {value!r}, expected a number"
                )
            if not math.isfinite(value):
                raise RewardFunctionError(self.spec, f"reward {index} is {value}, not finite")
            rewards.append(float(value))
        return rewards


# --------------------------------------------------------------------------------------------
# The job's reward: one source or a weighted sum of several


Score = Callable[[list[list[int]], list[list[int]], list[dict[str, Any]] | None], Sequence[float]]
"""What every reward source is called as: ``(prompts, responses, metadata) -> rewards``."""


class ModelReward:
    """The reward-model role as a reward source: decodes the texts and has the role's replicas
    score them (each re-tokenizes with its own tokenizer). The replicas start with the other
    actors, after the inputs load, so they are attached later (`attach`)."""

    def __init__(self, decode: Decode, batch_size: int) -> None:
        self.decode = decode
        self.batch_size = batch_size
        self.fleet: Any = None
        """A `reward_models.RewardModelFleet`, once the actors are up."""

    def attach(self, fleet: Any) -> None:
        self.fleet = fleet

    def __call__(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        metadata: list[dict[str, Any]] | None = None,
    ) -> list[float]:
        if self.fleet is None:
            raise RuntimeError("the reward-model replicas are not started (attach a fleet first)")
        checked_batch(prompts, responses, metadata)
        prompt_texts = [self.decode(ids) for ids in prompts]
        response_texts = [self.decode(ids) for ids in responses]
        return list(self.fleet.score(prompt_texts, response_texts, self.batch_size))


@dataclass(frozen=True)
class RewardPart:
    """One source of the reward, its label (metrics, step log) and its weight."""

    name: str
    weight: float
    score: Score = field(repr=False)


@dataclass
class CombinedReward:
    """The job's reward: ``sum(weight x score)`` over its parts, each part's scores optionally
    standardised over the batch first (`normalize`: weights then compare sources of different
    scales; a part whose scores are all equal contributes 0). One part of weight 1 without
    normalisation is that part's scores unchanged.

    Called like a rule reward; `last_breakdown` holds each part's mean raw score of the last
    call, for the metrics and the step log.
    """

    parts: list[RewardPart]
    normalize: bool = False
    last_breakdown: dict[str, float] = field(default_factory=dict)

    def __call__(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        metadata: list[dict[str, Any]] | None = None,
    ) -> list[float]:
        totals = [0.0] * len(responses)
        breakdown: dict[str, float] = {}
        for part in self.parts:
            scores = [float(value) for value in part.score(prompts, responses, metadata)]
            if len(scores) != len(responses) or not all(map(math.isfinite, scores)):
                raise RewardFunctionError(
                    part.name, f"gave {len(scores)} scores (or a non-finite one) for "
                    f"{len(responses)} responses"
                )  # fmt: skip
            breakdown[part.name] = sum(scores) / len(scores) if scores else 0.0
            if self.normalize:
                scores = standardised(scores)
            totals = [
                total + part.weight * score for total, score in zip(totals, scores, strict=True)
            ]
        self.last_breakdown = breakdown
        return totals

    def model_parts(self) -> list[ModelReward]:
        """The parts the reward-model role scores (to attach its fleet to)."""
        return [part.score for part in self.parts if isinstance(part.score, ModelReward)]


def standardised(values: list[float], epsilon: float = 1e-6) -> list[float]:
    """``(v - mean) / std`` over the batch; all zeros when the values are (nearly) all equal."""
    if not values:
        return []
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    if std <= epsilon * max(1.0, abs(mean)):
        return [0.0] * len(values)
    return [(v - mean) / std for v in values]
