"""RLHF algorithm math: advantages, losses, KL estimators and masking helpers.

Everything here is a pure function of torch tensors, so the same formulas serve the GRPO and PPO
loops, run on CPU or GPU, and are tested against hand-computed numbers (design decision 9).

Shape conventions used throughout:

* ``B`` is the number of sequences in a batch, ``T`` the number of token positions, ``V`` the
  vocabulary size.
* Token-level tensors are ``[B, T]``. ``mask`` has the same shape, with 1 (or ``True``) for a
  response token that takes part in the loss and 0 for prompt or padding tokens.
* Log-probabilities are natural-log probabilities of the token that was actually sampled.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from rlhf_trainer.masked import masked_mean, masked_sum, masked_whiten, zero_masked_out
from rlhfjob.api.algorithm import LossAggregationName

KLEstimator = Literal["k1", "k3"]
LossAggregation = LossAggregationName | Literal["token_mean", "sequence_mean"]
"""The API's aggregation names; the two spellings from before them (``token_mean``,
``sequence_mean``: token-mean and sequence-mean-token-mean) are still accepted."""
_FORMER_NAMES: dict[str, LossAggregationName] = {
    "token_mean": "token-mean",
    "sequence_mean": "sequence-mean-token-mean",
}


# --------------------------------------------------------------------------------------------
# KL to the reference policy
# --------------------------------------------------------------------------------------------


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from log-probs of sampled tokens.

    With ``log_ratio = logprobs - ref_logprobs`` (tokens sampled from the policy):

    * ``k1 = log_ratio`` — unbiased, high variance, can be negative per token.
    * ``k3 = exp(-log_ratio) + log_ratio - 1`` — unbiased and always >= 0 (Schulman's estimator,
      as used by GRPO's KL loss).
    """
    log_ratio = logprobs.float() - ref_logprobs.float()
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1' or 'k3'")


@torch.no_grad()
def kl_shaped_token_rewards(
    sequence_rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float,
    estimator: KLEstimator = "k1",
) -> Tensor:
    """Token-level rewards for PPO: a per-token KL penalty plus the sequence reward at the end.

    ``reward[b, t] = -kl_coef * kl[b, t]`` on every masked-in token, and ``sequence_rewards[b]``
    is added on the last masked-in token of row ``b`` (where the sequence-level reward was
    earned). A row with no masked-in token gets all zeros. Returns ``[B, T]``, detached: rewards
    are targets, never differentiated.
    """
    weights = mask.to(torch.float32)
    kl = kl_estimate(logprobs, ref_logprobs, estimator)
    token_rewards = zero_masked_out(-kl_coef * kl, weights)

    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(weights)
    last_index = torch.where(weights > 0, positions, torch.full_like(positions, -1)).amax(dim=-1)
    has_tokens = last_index >= 0
    rows = torch.nonzero(has_tokens, as_tuple=True)[0]
    token_rewards[rows, last_index[rows]] += sequence_rewards[rows].to(torch.float32)
    return token_rewards


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


def grpo_advantages(
    rewards: Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO group-normalised advantages, one per sequence.

    ``rewards`` is ``[B]`` with the ``group_size`` samples of each prompt stored contiguously
    (``[p0s0, p0s1, ..., p1s0, ...]``). Each sample's advantage is its reward minus its group's
    mean, divided by the group's (unbiased) standard deviation plus ``eps`` when
    ``scale_by_std`` is set (Dr. GRPO drops the division). A group whose rewards are all equal
    carries no learning signal and gets advantage 0.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}, "
            f"got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.float().view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    # Equal rewards compared exactly: float32 rounding in the mean leaves a residue of about
    # one ulp, which divided by a std of the same size would be a large, signal-free advantage.
    no_signal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.masked_fill(no_signal, 0.0).view(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO's leave-one-out advantages, one per sequence: a sample's reward minus the mean of
    the other ``group_size - 1`` rewards of its group, ``n / (n - 1) * (r - mean)``.

    Layout as `grpo_advantages`; a group of equal rewards gets exactly 0.
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2 (a baseline of the others), got {group_size}")
    centred = grpo_advantages(rewards, group_size, scale_by_std=False)
    return centred * (group_size / (group_size - 1))


@torch.no_grad()
def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` over each row's masked-in tokens (0 elsewhere).

    Like `gae_advantages`, the mask marks one contiguous run of response tokens per row; a
    masked-out position neither earns nor passes on a return.
    """
    weights = mask.to(torch.float32)
    rewards = zero_masked_out(token_rewards.float(), weights)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[..., 0])
    for t in reversed(range(rewards.shape[-1])):
        running = (rewards[..., t] + gamma * running) * weights[..., t]
        returns[..., t] = running
    return returns


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_rewards: Tensor, mask: Tensor, gamma: float
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: ``(advantages, returns)``, the discounted returns of the token rewards,
    whitened over every masked-in token of the batch (the global normalisation that replaces
    a critic's baseline). Both ``[B, T]``, 0 where masked out."""
    returns = discounted_returns(token_rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


def groups_with_signal(rewards: Tensor, group_size: int) -> Tensor:
    """``[B / group_size]`` booleans: whether a group's rewards differ (DAPO's dynamic sampling
    keeps these; a group of equal rewards has no advantage to learn from)."""
    grouped = rewards.view(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)


def overlong_penalty(
    response_lengths: Tensor, max_length: int, buffer_length: int, penalty: float = 1.0
) -> Tensor:
    """DAPO's soft overlong punishment, per response (0 or negative, added to the reward).

    A response longer than ``max_length - buffer_length`` loses ``penalty`` times the share of
    the buffer it runs into: ``-penalty * min(L - (max_length - buffer_length), buffer_length)
    / buffer_length``, so ``-penalty`` at ``max_length`` and beyond.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"buffer_length must be in 1..{max_length}, got {buffer_length}")
    start = max_length - buffer_length
    excess = (response_lengths.float() - start).clamp(min=0.0, max=float(buffer_length))
    return -penalty * excess / buffer_length


@torch.no_grad()
def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over token-level rewards and critic values.

    For each masked-in token ``t`` with next masked-in token ``t+1``:
    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``.
    The last masked-in token of a row is terminal (``V_{t+1} = 0``, ``A_{t+1} = 0``). The mask
    must mark one contiguous run of response tokens per row (leading prompt tokens and trailing
    padding are 0). Returns ``(advantages, returns)``, both ``[B, T]`` and 0 where masked out;
    ``returns = advantages + values`` is the critic's regression target. Both are detached.
    """
    weights = mask.to(torch.float32)
    rewards = zero_masked_out(token_rewards.float(), weights)
    values = zero_masked_out(values.float(), weights)
    num_positions = rewards.shape[-1]

    advantages_reversed: list[Tensor] = []
    next_advantage = torch.zeros_like(rewards[..., 0])
    for t in reversed(range(num_positions)):
        if t + 1 < num_positions:
            next_value = values[..., t + 1]
            next_is_valid = weights[..., t + 1]
        else:
            next_value = torch.zeros_like(next_advantage)
            next_is_valid = torch.zeros_like(next_advantage)
        delta = rewards[..., t] + gamma * next_value * next_is_valid - values[..., t]
        next_advantage = (delta + gamma * lam * next_is_valid * next_advantage) * weights[..., t]
        advantages_reversed.append(next_advantage)

    advantages = torch.stack(advantages_reversed[::-1], dim=-1)
    returns = zero_masked_out(advantages + values, weights)
    return advantages, returns


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


def loss_units(mask: Tensor, aggregation: LossAggregation) -> Tensor:
    """What `aggregate_loss` averages over in ``mask``: tokens for ``token-mean``, sequences
    with a token otherwise. A step's loss is a sum of micro-batch losses each weighted by its
    share of the step's units, which is the aggregation over the whole step."""
    weights = mask.to(torch.float32)
    if _FORMER_NAMES.get(aggregation, aggregation) == "token-mean":
        return weights.sum()
    return (weights.sum(dim=-1) > 0).to(torch.float32).sum()


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    aggregation: LossAggregation,
    normaliser: float | None = None,
) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar, a mean over `loss_units`.

    * ``token-mean``: every token weighs the same (long responses count more).
    * ``sequence-mean-token-mean``: the mean within each sequence, then across sequences.
    * ``sequence-mean-token-sum``: the sum within each sequence, then the mean across them.
    * ``constant-normaliser``: the sum over all tokens / (sequences x `normaliser`), the
      maximum response length (Dr. GRPO): no sequence's length changes its tokens' weight.

    Sequences without a masked-in token count for nothing (they are padding).
    """
    aggregation = _FORMER_NAMES.get(aggregation, aggregation)
    weights = mask.to(per_token.dtype)
    if aggregation == "token-mean":
        return masked_mean(per_token, weights)
    has_tokens = (weights.sum(dim=-1) > 0).to(per_token.dtype)
    if aggregation == "sequence-mean-token-mean":
        return masked_mean(masked_mean(per_token, weights, dim=-1), has_tokens)
    if aggregation == "sequence-mean-token-sum":
        return masked_mean(masked_sum(per_token, weights, dim=-1), has_tokens)
    if aggregation == "constant-normaliser":
        if normaliser is None or normaliser <= 0:
            raise ValueError("constant-normaliser needs a positive normaliser (the max length)")
        return masked_sum(per_token, weights) / (has_tokens.sum().clamp(min=1.0) * normaliser)
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


class SurrogateTerms(NamedTuple):
    """A policy loss per token, with the diagnostics worth logging each step."""

    per_token: Tensor
    """``[B, T]`` loss to aggregate (only masked-in positions count)."""
    clip_fraction: Tensor
    """Share of masked-in tokens where the clipped term was the active one."""
    approx_kl: Tensor
    """Mean k3 estimate of KL(old || new) over masked-in tokens: how far this update moved."""


def _per_token_advantages(advantages: Tensor, logprobs: Tensor) -> Tensor:
    """``[B, T]`` advantages: per-sequence ``[B]`` ones broadcast over the tokens."""
    return advantages.unsqueeze(-1) if advantages.dim() == logprobs.dim() - 1 else advantages


def _clip_surrogate(
    ratio: Tensor, log_ratio: Tensor, advantages: Tensor, mask: Tensor, low: float, high: float
) -> SurrogateTerms:
    """``max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))`` per token, and diagnostics."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    weights = mask.to(per_token.dtype)
    with torch.no_grad():
        clip_fraction = masked_mean((clipped > unclipped).to(per_token.dtype), weights)
        approx_kl = masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, weights)
    return SurrogateTerms(per_token, clip_fraction, approx_kl)


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_range_low: float = 0.2,
    clip_range_high: float = 0.2,
) -> SurrogateTerms:
    """PPO's clipped surrogate per token, on each token's ratio ``exp(logprobs - old)``; an
    update never profits from moving the ratio outside ``[1 - low, 1 + high]``. A higher
    upper side is DAPO's clip-higher. ``advantages`` is ``[B, T]`` or ``[B]`` (broadcast)."""
    log_ratio = logprobs.float() - old_logprobs.float()
    advantages = _per_token_advantages(advantages, logprobs)
    return _clip_surrogate(
        torch.exp(log_ratio), log_ratio, advantages, mask, clip_range_low, clip_range_high
    )


def gspo_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_range_low: float = 0.2,
    clip_range_high: float = 0.2,
) -> SurrogateTerms:
    """GSPO's clipped surrogate on the sequence-level ratio.

    A sequence's ratio is the geometric mean of its tokens' ratios, ``s = exp(mean_t log_ratio)``,
    clipped as a whole (so one token cannot leave the trust region alone). Per token the value
    is ``s`` and the gradient is ``s * d log p_t`` (``s_t = sg[s] * p_t / sg[p_t]``), so with
    ``sequence-mean-token-mean`` the loss is the paper's per-sequence objective.
    """
    log_ratio = logprobs.float() - old_logprobs.float()
    weights = mask.to(log_ratio.dtype)
    sequence_log_ratio = masked_mean(log_ratio, weights, dim=-1).detach().unsqueeze(-1)
    token_logprobs = logprobs.float()
    ratio = torch.exp(sequence_log_ratio + token_logprobs - token_logprobs.detach())
    advantages = _per_token_advantages(advantages, logprobs)
    return _clip_surrogate(ratio, log_ratio, advantages, mask, clip_range_low, clip_range_high)


class PolicyLossResult(NamedTuple):
    """Clipped-surrogate loss plus the diagnostics worth logging each step."""

    loss: Tensor
    """Scalar loss to minimise."""
    clip_fraction: Tensor
    """Share of masked-in tokens where the clipped term was the active one."""
    approx_kl: Tensor
    """Mean k3 estimate of KL(old || new) over masked-in tokens: how far this update moved."""


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_range: float = 0.2,
    clip_range_high: float | None = None,
    aggregation: LossAggregation = "token-mean",
) -> PolicyLossResult:
    """PPO clipped surrogate loss (`clipped_surrogate`), aggregated: ``clip_range`` on both
    sides unless ``clip_range_high`` sets the upper one."""
    upper = clip_range if clip_range_high is None else clip_range_high
    terms = clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_range, upper)
    loss = aggregate_loss(terms.per_token, mask, aggregation)
    return PolicyLossResult(loss, terms.clip_fraction, terms.approx_kl)


class ValueLossResult(NamedTuple):
    """Critic loss plus how often value clipping was active."""

    loss: Tensor
    clip_fraction: Tensor


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float | None = None,
    aggregation: LossAggregation = "token-mean",
) -> ValueLossResult:
    """Critic regression loss ``0.5 * (V - R)^2`` with optional PPO-style value clipping.

    With ``clip_range`` set, the prediction may move at most ``clip_range`` from ``old_values``
    before the loss stops rewarding it: per token the loss is
    ``0.5 * max((V - R)^2, (old_V + clip(V - old_V, -c, c) - R)^2)``.
    """
    values = values.float()
    returns = returns.float()
    unclipped = (values - returns) ** 2
    weights = mask.to(unclipped.dtype)
    if clip_range is None:
        per_token = unclipped
        clip_fraction = torch.zeros((), dtype=unclipped.dtype, device=unclipped.device)
    else:
        old_values = old_values.float()
        clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        clipped = (clipped_values - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        with torch.no_grad():
            clip_fraction = masked_mean((clipped > unclipped).to(unclipped.dtype), weights)
    loss = 0.5 * aggregate_loss(per_token, weights, aggregation)
    return ValueLossResult(loss=loss, clip_fraction=clip_fraction)


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    estimator: KLEstimator = "k3",
    aggregation: LossAggregation = "token-mean",
    normaliser: float | None = None,
) -> Tensor:
    """KL(policy || reference) as a loss term (GRPO adds ``beta * kl_loss`` to the policy loss).

    Gradients flow through ``logprobs`` only; ``ref_logprobs`` come from the frozen reference.
    """
    per_token = kl_estimate(logprobs, ref_logprobs.detach(), estimator)
    return aggregate_loss(per_token, mask.to(per_token.dtype), aggregation, normaliser)
