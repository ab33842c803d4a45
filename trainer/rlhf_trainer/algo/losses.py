"""The policy's loss: the policy losses by name (`algorithm.policyLoss`), and the objective a
rank minimises, aggregated as `algorithm.lossAggregation` says (`algorithms.aggregate_loss`).

Each policy loss is one function registered with `@policy_loss(name)`; it returns a per-token
loss, and `PolicyObjective` adds the KL and entropy terms and aggregates them the way the spec
says, so a new loss touches neither the actors nor the driver. The names and papers are the
API's (`rlhfjob.api.algorithm`); a unit test holds the registry equal to them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf_trainer import masked
from rlhf_trainer.algo import formulas as alg
from rlhf_trainer.registry import Registry
from rlhfjob.api import AlgorithmSpec

PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, AlgorithmSpec], alg.SurrogateTerms]
"""``(logprobs, old_logprobs, advantages, mask, algorithm) -> per-token loss and diagnostics``."""

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("spec.algorithm.policyLoss")


def policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: the policy loss the API's `name` chooses."""
    return POLICY_LOSSES.register(name)


@policy_loss("ppo-clip")
def _ppo_clip(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, a: AlgorithmSpec
) -> alg.SurrogateTerms:
    low, high = a.clip_bounds
    return alg.clipped_surrogate(logprobs, old_logprobs, advantages, mask, low, high)


@policy_loss("gspo")
def _gspo(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, a: AlgorithmSpec
) -> alg.SurrogateTerms:
    low, high = a.clip_bounds
    return alg.gspo_surrogate(logprobs, old_logprobs, advantages, mask, low, high)


def old_logprobs_needed(algorithm: AlgorithmSpec) -> bool:
    """Whether a step computes the policy's log-probs before its update: a pass over the whole
    batch, about a sixth of a GPU step. It is redundant when the batch gets exactly one optimizer
    step (`updateEpochs` 1: every micro-batch accumulates into it) on samples of the current
    policy (no `maxStaleness`) and the advantages do not use it (no KL in the reward): the old
    policy is then the one being updated, so the update's own log-probs, detached, are the old
    ones (a ratio of exactly 1, the same gradient)."""
    kl_in_reward = algorithm.kl_mode == "reward" and algorithm.kl_coef > 0
    return algorithm.update_epochs > 1 or algorithm.max_staleness > 0 or kl_in_reward


BEHAVIOUR_WEIGHT_CAP = 5.0
"""Largest importance weight of a stale token (proximal over behaviour probability), as
AReaL caps it: a token the engine sampled far below the proximal policy's odds would
otherwise dominate the step."""


def behaviour_weights(old_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """The decoupled PPO objective's per-token importance weight (no gradient): the proximal
    policy's probability of the sampled token (the policy at the step's start, `old_logprobs`)
    over the behaviour policy's that sampled it (the engine's), capped."""
    with torch.no_grad():
        log_ratio = old_logprobs.float() - behaviour_logprobs.float()
        weights = torch.exp(log_ratio.clamp(max=math.log(BEHAVIOUR_WEIGHT_CAP)))
        return weights * mask.to(weights.dtype)


REFERENCE_KL = "reference_kl"
"""The term that carries the step's KL to the reference when the update made the old
log-probs itself (the driver reports it as the step's ``kl``)."""


@dataclass(frozen=True)
class MicroBatchLoss:
    """One micro-batch's loss (a mean over its `units`) and the terms to log."""

    loss: Tensor
    units: float
    """How many of the aggregation's units (tokens or sequences) the micro-batch holds."""
    terms: Mapping[str, Tensor]


class PolicyObjective:
    """The policy loss of a spec: its surrogate, the KL and entropy terms, one aggregation.

    A step's loss is the aggregation over the whole step: each micro-batch's loss, a mean over
    its own units, is weighted by its share of the step's units (`units` of the whole batch)
    before the backward pass, whichever ranks and micro-batches the rows fall into.
    """

    def __init__(self, algorithm: AlgorithmSpec) -> None:
        self.algorithm = algorithm
        self.surrogate = POLICY_LOSSES[algorithm.policy_loss]
        self.aggregation = algorithm.effective_loss_aggregation
        self.normaliser = float(algorithm.max_response_length)
        self.kl_in_loss = algorithm.kl_mode == "loss" and algorithm.kl_coef > 0

    def units(self, mask: Tensor) -> float:
        """The aggregation's units in `mask` (a micro-batch's, or the whole step's)."""
        return float(alg.loss_units(mask, self.aggregation))

    def _aggregate(self, per_token: Tensor, mask: Tensor) -> Tensor:
        return alg.aggregate_loss(per_token, mask, self.aggregation, self.normaliser)

    def __call__(
        self, logprobs: Tensor, entropies: Tensor, fields: Mapping[str, Tensor], mask: Tensor
    ) -> MicroBatchLoss:
        """The loss of one micro-batch from its log-probs and entropies (both with gradients)
        and the batch fields (``advantages``; ``old_logprobs`` unless `old_logprobs_needed`
        says they are these log-probs; ``ref_logprobs``)."""
        algorithm = self.algorithm
        terms: dict[str, Tensor] = {}
        old = fields.get("old_logprobs")
        if old is None:  # on-policy, one optimizer step: the old policy is this one
            old = logprobs.detach()
            if "ref_logprobs" in fields:  # the step's KL to the reference, as the pass gave it
                kl = alg.kl_estimate(old, fields["ref_logprobs"], "k3")
                terms[REFERENCE_KL] = masked.masked_mean(kl, mask)
        policy = self.surrogate(logprobs, old, fields["advantages"], mask, algorithm)
        per_token = policy.per_token
        if "behaviour_logprobs" in fields:  # stale samples (`algorithm.maxStaleness`)
            weights = behaviour_weights(old, fields["behaviour_logprobs"], mask)
            per_token = per_token * weights
            terms["behaviour_weight"] = masked.masked_mean(weights, mask)
            terms["behaviour_kl"] = masked.masked_mean(
                alg.kl_estimate(fields["behaviour_logprobs"], old, "k3"), mask
            )
        loss = self._aggregate(per_token, mask)
        terms |= {
            "policy_loss": loss,
            "clip_fraction": policy.clip_fraction,
            "approx_kl": policy.approx_kl,
        }
        if self.kl_in_loss:
            kl = alg.kl_loss(
                logprobs,
                fields["ref_logprobs"],
                mask,
                algorithm.kl_estimator,
                self.aggregation,
                self.normaliser,
            )
            loss = loss + algorithm.kl_coef * kl
            terms["kl_loss"] = kl
        entropy = self._aggregate(
            entropies if algorithm.entropy_coef > 0 else entropies.detach(), mask
        )
        if algorithm.entropy_coef > 0:
            loss = loss - algorithm.entropy_coef * entropy
        terms["entropy"] = entropy
        return MicroBatchLoss(loss, self.units(mask), terms)
