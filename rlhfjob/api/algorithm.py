"""The algorithm a job trains with: its hyper-parameters (`AlgorithmSpec`) and the names it
chooses between (advantage estimators, policy losses, loss aggregations).

Each name is declared here once, with what it does and the paper it follows. The API's enums,
the field descriptions (so `kubectl explain` and docs/api-reference.md), and the CEL rules that
depend on what an estimator needs all come from these tables; the trainer registers one
implementation per name (`rlhf_trainer.algo.experience`, `rlhf_trainer.algo.losses`) and a unit test
holds the registries equal to them. No torch here: the operator imports the API.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from pydantic import Field

from rlhfjob.api.base import ApiModel
from rlhfjob.cel import CelRule

AdvantageEstimatorName = Literal[
    "grpo", "ppo", "rloo", "reinforce-plus-plus", "reinforce-plus-plus-baseline"
]
PolicyLossName = Literal["ppo-clip", "gspo"]
LossAggregationName = Literal[
    "token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum", "constant-normaliser"
]


@dataclass(frozen=True)
class Choice:
    """One name a field may take: what it does, and the paper it follows."""

    summary: str
    paper: str


@dataclass(frozen=True)
class EstimatorChoice(Choice):
    """An advantage estimator, and what the job must provide for it."""

    samples_groups: bool = True
    """It samples `groupSize` responses per prompt (one otherwise)."""
    needs_group: bool = False
    """Its baseline is the rest of a prompt's group, so `groupSize` must be at least 2."""
    uses_critic: bool = False
    """It trains a critic (`roles.critic`)."""


DAPO = "Yu et al. 2025, DAPO, arXiv:2503.14476"
DR_GRPO = "Liu et al. 2025, Understanding R1-Zero-Like Training: Dr. GRPO, arXiv:2503.20783"
REINFORCE_PLUS_PLUS = "Hu 2025, REINFORCE++, arXiv:2501.03262"

ADVANTAGE_ESTIMATORS: Mapping[str, EstimatorChoice] = {
    "grpo": EstimatorChoice(
        "a response's reward minus its group's mean, divided by the group's standard deviation "
        "(scaleRewards; off, it is Dr. GRPO's advantage)",
        "Shao et al. 2024, DeepSeekMath, arXiv:2402.03300",
        needs_group=True,
    ),
    "ppo": EstimatorChoice(
        "GAE over a critic's values and KL-shaped token rewards",
        "Schulman et al. 2017, PPO, arXiv:1707.06347",
        samples_groups=False,
        uses_critic=True,
    ),
    "rloo": EstimatorChoice(
        "a response's reward minus the mean reward of the other responses to its prompt",
        "Ahmadian et al. 2024, Back to Basics: REINFORCE Leave-One-Out, arXiv:2402.14740",
        needs_group=True,
    ),
    "reinforce-plus-plus": EstimatorChoice(
        "the discounted return (gamma) of KL-shaped token rewards, whitened over the batch",
        REINFORCE_PLUS_PLUS,
    ),
    "reinforce-plus-plus-baseline": EstimatorChoice(
        "REINFORCE++ on rewards minus their group's mean",
        REINFORCE_PLUS_PLUS,
        needs_group=True,
    ),
}
POLICY_LOSSES: Mapping[str, Choice] = {
    "ppo-clip": Choice(
        "the clipped surrogate on each token's probability ratio (clipRangeLow and "
        "clipRangeHigh; DAPO's clip-higher sets the upper one higher)",
        f"Schulman et al. 2017, PPO, arXiv:1707.06347; clip-higher: {DAPO}",
    ),
    "gspo": Choice(
        "the clipped surrogate on a response's ratio, the geometric mean of its tokens' ratios",
        "Zheng et al. 2025, Group Sequence Policy Optimization, arXiv:2507.18071",
    ),
}
LOSS_AGGREGATIONS: Mapping[str, Choice] = {
    "token-mean": Choice("the mean over every response token of the step", DAPO),
    "sequence-mean-token-mean": Choice(
        "each response's token mean, averaged over responses",
        "Shao et al. 2024, GRPO, arXiv:2402.03300",
    ),
    "sequence-mean-token-sum": Choice(
        "each response's token sum, averaged over responses (no length normalisation)", DR_GRPO
    ),
    "constant-normaliser": Choice(
        "the sum over every response token divided by responses x maxResponseLength, a "
        "constant: no bias by response length",
        DR_GRPO,
    ),
}
DEFAULT_LOSS_AGGREGATION: Mapping[str, LossAggregationName] = {
    "ppo-clip": "token-mean",
    "gspo": "sequence-mean-token-mean",
}
"""The aggregation each policy loss uses unless lossAggregation names another."""


def _check_declared(literal: object, table: Mapping[str, object]) -> tuple[str, ...]:
    """The enum's names, which must be the table's (one place to add a name, not two)."""
    names: tuple[str, ...] = get_args(literal)
    if set(names) != set(table):
        raise AssertionError(f"enum {names} and table {sorted(table)} disagree")
    return names


ESTIMATOR_NAMES = _check_declared(AdvantageEstimatorName, ADVANTAGE_ESTIMATORS)
POLICY_LOSS_NAMES = _check_declared(PolicyLossName, POLICY_LOSSES)
LOSS_AGGREGATION_NAMES = _check_declared(LossAggregationName, LOSS_AGGREGATIONS)
_check_declared(PolicyLossName, DEFAULT_LOSS_AGGREGATION)


def grouped_estimators() -> tuple[str, ...]:
    """Estimators that sample `groupSize` responses per prompt."""
    return tuple(name for name, c in ADVANTAGE_ESTIMATORS.items() if c.samples_groups)


def ungrouped_estimators() -> tuple[str, ...]:
    """Estimators that sample one response per prompt."""
    return tuple(name for name, c in ADVANTAGE_ESTIMATORS.items() if not c.samples_groups)


def group_relative_estimators() -> tuple[str, ...]:
    """Estimators whose baseline is the rest of a group (`groupSize` >= 2)."""
    return tuple(name for name, c in ADVANTAGE_ESTIMATORS.items() if c.needs_group)


def critic_estimators() -> tuple[str, ...]:
    """Estimators that train a critic."""
    return tuple(name for name, c in ADVANTAGE_ESTIMATORS.items() if c.uses_critic)


def cel_in(field: str, names: tuple[str, ...]) -> str:
    """A CEL test that `field` is one of `names`."""
    return f"{field} in [{', '.join(repr(name) for name in names)}]"


def _listing(names: tuple[str, ...]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def describe(lead: str, table: Mapping[str, Choice]) -> str:
    """A field's description: `lead`, then each name with what it does and its paper."""
    items = "; ".join(f"`{name}` ({c.paper}): {c.summary}" for name, c in table.items())
    return f"{lead} {items}."


class DynamicSamplingSpec(ApiModel):
    """DAPO's dynamic sampling: a group whose rewards are all equal has no advantage to learn
    from, so it is dropped and further prompts are sampled until promptsPerStep groups have
    one (the step record's `dropped_groups` counts the drops)."""

    max_generation_batches: int = Field(default=3, ge=1, le=64)
    """Rollouts of promptsPerStep prompts a step generates at most, the first included. Groups
    still missing after the last are filled with dropped ones (advantage 0), so a step's batch
    keeps its size."""


class OverlongShapingSpec(ApiModel):
    """DAPO's soft overlong punishment: a response that runs into the last bufferLength tokens
    before maxResponseLength loses reward in proportion, `penalty` at the maximum length."""

    buffer_length: int = Field(ge=1, le=1048576)
    """Tokens before maxResponseLength over which the penalty grows from 0 to `penalty`."""
    penalty: float = Field(default=1.0, gt=0, le=1000)
    """Reward a response of maxResponseLength tokens loses."""


class AlgorithmSpec(ApiModel):
    """The advantage estimator, the policy loss and their hyper-parameters."""

    name: AdvantageEstimatorName = Field(
        default="grpo", description=describe("The advantage estimator:", ADVANTAGE_ESTIMATORS)
    )
    group_size: int = Field(default=8, ge=1, le=1024)
    """Responses sampled per prompt (every estimator but ppo; grpo normalises rewards within
    each group)."""
    prompts_per_step: int = Field(default=32, ge=1, le=65536)
    """Prompts per training step (rollout batch = promptsPerStep x groupSize)."""
    micro_batch_size: int = Field(default=4, ge=1, le=4096)
    """Sequences per forward/backward per trainer rank (gradient accumulation covers the rest)."""
    update_epochs: int = Field(default=1, ge=1, le=64)
    """Passes over each rollout batch."""
    total_steps: int | None = Field(default=None, ge=1, le=1_000_000_000)
    """Training steps (a rollout batch and its update each); set this or epochs."""
    epochs: int | None = Field(default=None, ge=1, le=1_000_000)
    """Passes over the prompt dataset; set this or totalSteps."""
    max_prompt_length: int = Field(default=512, ge=1, le=1048576)
    """Prompt tokens at most (after the chat template); see dataset.overlongPrompts."""
    max_response_length: int = Field(default=512, ge=1, le=1048576)
    """Generated tokens at most per response."""
    stop_at_eos: bool = True
    """End a response at the tokenizer's end-of-sequence token (kept as its last token; when the
    job has a tokenizer). Off: responses run to maxResponseLength unless stopTokenIds stop them."""
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=64)
    """More token ids that end a response (kept as its last token)."""
    stop_strings: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=16
    )
    """Text that ends a response: it ends with the token that completes the first occurrence
    (needs a tokenizer)."""
    temperature: float = Field(default=1.0, gt=0, le=10)
    """Sampling temperature of the rollout; the log-probs and entropy are of the tempered
    distribution."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling: sample from the smallest set of tokens holding this probability."""
    policy_loss: PolicyLossName = Field(
        default="ppo-clip", description=describe("The policy loss:", POLICY_LOSSES)
    )
    clip_range: float = Field(default=0.2, gt=0, le=10)
    """PPO ratio clipping epsilon: the new-to-old policy ratio is clipped to
    [1 - clipRange, 1 + clipRange]; clipRangeLow and clipRangeHigh override either side."""
    clip_range_low: float | None = Field(default=None, gt=0, le=1)
    """The ratio is clipped below at 1 - clipRangeLow; unset: clipRange."""
    clip_range_high: float | None = Field(default=None, gt=0, le=10)
    """The ratio is clipped above at 1 + clipRangeHigh; unset: clipRange. DAPO's clip-higher
    sets it above the lower side (0.28 against 0.2) so unlikely tokens can still grow."""
    loss_aggregation: LossAggregationName | None = Field(
        default=None,
        description=describe(
            "How per-token losses (policy, KL and entropy) become the step's loss; unset: the "
            "policy loss's own (token-mean for ppo-clip, sequence-mean-token-mean for gspo).",
            LOSS_AGGREGATIONS,
        ),
    )
    max_staleness: int = Field(default=0, ge=0, le=16)
    """Policy updates a trained sample may lag behind the policy it updates. 0 trains
    on-policy: the engines wait while the ranks update, the ranks while the engines generate.
    N >= 1 generates the next step's batch while this step trains (with the weights of the
    update before) and corrects for the lag with the decoupled PPO objective: the ratio is
    taken to the policy at the start of the step, and each token is weighted by its
    probability there over the engine's (capped). A sample older than N updates is never
    trained on. Needs engines of their own (roles.rollout.placement disaggregated)."""
    partial_rollout_tokens: int = Field(default=0, ge=0, le=1048576)
    """Partial rollouts, with maxStaleness: the batch generated ahead is decoded in segments of
    this many tokens until the step's update is done; its weights then reach the engines at the
    next segment boundary and the unfinished responses resume under them (each token keeps the
    log-prob of the weights that sampled it; a response counts as old as its first token). A
    sync then waits for one segment, not the rest of the batch, and more of the batch comes
    from the newer policy; each boundary costs a prefill of the responses so far, and when the
    update lands depends on timing, so runs are no longer bitwise repeatable (a resumed run
    still trains on the checkpointed batch). 0: the batch ahead finishes under the weights it
    started with."""
    dynamic_sampling: DynamicSamplingSpec | None = None
    """Drop groups whose rewards are all equal and sample more prompts instead (DAPO); unset:
    every group trains."""
    overlong_shaping: OverlongShapingSpec | None = None
    """Lower the reward of responses that near maxResponseLength (DAPO); unset: none."""
    value_clip_range: float | None = Field(default=0.2, gt=0)
    """Critic value clipping (PPO): new values stay within this distance of the old ones;
    unset disables it."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL to the reference policy."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """How the KL is estimated per token: k1 (log-ratio) or k3 (the unbiased, positive one)."""
    kl_mode: Literal["reward", "loss"] = "loss"
    """Apply KL as a per-token reward penalty or as a loss term."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus in the policy loss."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount of future token rewards (ppo's GAE, reinforce-plus-plus's returns)."""
    gae_lambda: float = Field(default=0.95, ge=0, le=1)
    """GAE lambda (PPO)."""
    scale_rewards: bool = True
    """GRPO: divide group-centred rewards by the group's standard deviation."""
    policy_learning_rate: float = Field(default=1e-6, gt=0, le=1)
    """Peak learning rate of the policy's optimizer (AdamW)."""
    critic_learning_rate: float = Field(default=5e-6, gt=0, le=1)
    """Peak learning rate of the critic's optimizer (PPO)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after the warm-up, over the run's optimizer steps."""
    warmup_steps: int = Field(default=0, ge=0, le=1_000_000_000)
    """Optimizer steps of linear warm-up from 0 to the peak learning rate."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradients are clipped to this global norm."""
    seed: int = Field(default=0, ge=0)
    """Seeds initialisation, the data order and sampling, so a resumed run repeats the
    uninterrupted one."""

    cel_rules = (
        CelRule(
            "has(self.totalSteps) != has(self.epochs)",
            "set exactly one of totalSteps and epochs",
            ".totalSteps",
        ),
        CelRule(
            f"!({cel_in('self.name', group_relative_estimators())}) || self.groupSize >= 2",
            f"{_listing(group_relative_estimators())} need groupSize >= 2 (their baseline is "
            "the rest of a prompt's group)",
            ".groupSize",
        ),
        CelRule(
            "self.microBatchSize <= self.promptsPerStep"
            f" * ({cel_in('self.name', grouped_estimators())} ? self.groupSize : 1)",
            "microBatchSize must not exceed the sequences of a step (promptsPerStep x "
            f"groupSize; {_listing(ungrouped_estimators())}:"
            " promptsPerStep)",
            ".microBatchSize",
        ),
        CelRule(
            "!has(self.totalSteps) || self.warmupSteps < self.totalSteps * self.updateEpochs",
            "warmupSteps must be fewer than the run's optimizer steps (totalSteps x updateEpochs)",
            ".warmupSteps",
        ),
        CelRule(
            f"!has(self.dynamicSampling) || ({cel_in('self.name', grouped_estimators())}"
            " && self.groupSize >= 2)",
            "dynamicSampling drops groups of equal rewards: it needs an estimator that samples "
            "groups and groupSize >= 2",
            ".dynamicSampling",
        ),
        CelRule(
            "!has(self.overlongShaping)"
            " || self.overlongShaping.bufferLength <= self.maxResponseLength",
            "overlongShaping.bufferLength must not exceed maxResponseLength",
            ".overlongShaping.bufferLength",
        ),
        CelRule(
            "self.partialRolloutTokens == 0 || self.maxStaleness >= 1",
            "partialRolloutTokens interrupts the batch generated ahead: it needs maxStaleness >= 1",
            ".partialRolloutTokens",
        ),
        CelRule(
            "self.partialRolloutTokens < self.maxResponseLength",
            "partialRolloutTokens must be fewer than maxResponseLength (a segment that long is "
            "the whole response)",
            ".partialRolloutTokens",
        ),
    )

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """``(low, high)`` clipping epsilons: clipRangeLow / clipRangeHigh, else clipRange."""
        low = self.clip_range if self.clip_range_low is None else self.clip_range_low
        high = self.clip_range if self.clip_range_high is None else self.clip_range_high
        return low, high

    @property
    def samples_per_prompt(self) -> int:
        """Responses sampled per prompt: `groupSize` for a grouped estimator, else one."""
        return self.group_size if ADVANTAGE_ESTIMATORS[self.name].samples_groups else 1

    @property
    def effective_loss_aggregation(self) -> LossAggregationName:
        """lossAggregation, or the policy loss's own."""
        if self.loss_aggregation is not None:
            return self.loss_aggregation
        return DEFAULT_LOSS_AGGREGATION[self.policy_loss]
