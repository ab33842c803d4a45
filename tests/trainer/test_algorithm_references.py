"""The algorithms against the reference implementations they follow, on random inputs.

Each reference is re-stated here in a few lines from its source (file and function named in a
comment; read, not copied), independently of `rlhf_trainer.algo.formulas`, and compared on seeded
random tensors with tight tolerances. verl is volcengine/verl, TRL huggingface/trl, OpenRLHF
OpenRLHF/OpenRLHF.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlhf_trainer.algo import formulas as alg

GROUP = 4
SEQUENCES = 24
LENGTH = 9


def random_mask(generator: torch.Generator, offset: bool = True) -> torch.Tensor:
    """``[SEQUENCES, LENGTH]``: one contiguous run of response tokens per row (after a prompt
    of 0-2 positions when `offset`), some rows shorter than others."""
    mask = torch.zeros(SEQUENCES, LENGTH)
    for row in range(SEQUENCES):
        start = int(torch.randint(0, 3, (), generator=generator)) if offset else 0
        length = int(torch.randint(1, LENGTH - start + 1, (), generator=generator))
        mask[row, start : start + length] = 1.0
    return mask


def binary_rewards(generator: torch.Generator) -> torch.Tensor:
    """Rewards of 0 or 1 (so some groups are all equal), and a group of distinct values."""
    rewards = torch.randint(0, 2, (SEQUENCES,), generator=generator).float()
    rewards[:GROUP] = torch.rand(GROUP, generator=generator)
    rewards[GROUP : 2 * GROUP] = 1.0  # a group without signal
    return rewards


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


# ---------------------------------------------------------------------------------- advantages


def test_grpo_matches_verl(generator: torch.Generator) -> None:
    # verl trainer/ppo/core_algos.py, compute_grpo_outcome_advantage: per prompt, (score - mean)
    # / (std + epsilon) with torch.std (unbiased), epsilon 1e-6; without norm_adv_by_std_in_grpo
    # (Dr. GRPO) only the mean is subtracted. Groups of one get mean 0, std 1 (not used here).
    rewards = binary_rewards(generator)
    grouped = rewards.view(-1, GROUP)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)
    verl_scaled = ((grouped - mean) / (std + 1e-6)).view(-1)
    verl_centred = (grouped - mean).view(-1)
    torch.testing.assert_close(alg.grpo_advantages(rewards, GROUP), verl_scaled, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        alg.grpo_advantages(rewards, GROUP, scale_by_std=False), verl_centred, atol=1e-6, rtol=0
    )


def test_rloo_matches_verl_and_openrlhf(generator: torch.Generator) -> None:
    rewards = binary_rewards(generator)
    # verl trainer/ppo/core_algos.py, compute_rloo_outcome_advantage: with n responses,
    # score * n / (n - 1) - mean * n / (n - 1).
    grouped = rewards.view(-1, GROUP)
    n = GROUP
    verl = (grouped * n / (n - 1) - grouped.mean(dim=1, keepdim=True) * n / (n - 1)).view(-1)
    # OpenRLHF trainer/ppo_utils/experience_maker.py, compute_advantages_and_returns ("rloo"):
    # baseline = (group sum - own reward) / (n - 1); reward - baseline.
    openrlhf = (grouped - (grouped.sum(-1, keepdim=True) - grouped) / (n - 1)).view(-1)
    mine = alg.rloo_advantages(rewards, GROUP)
    torch.testing.assert_close(mine, verl, atol=1e-6, rtol=0)
    torch.testing.assert_close(mine, openrlhf, atol=1e-6, rtol=0)
    assert torch.all(mine[GROUP : 2 * GROUP] == 0)  # a group of equal rewards: exactly 0


def openrlhf_reinforce(
    rewards: torch.Tensor, kl: torch.Tensor, kl_coef: float, mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """OpenRLHF: models/utils.py compute_reward (reward on the last action token, -kl_coef * kl
    on every token), experience_maker.py get_cumulative_returns (G_t = r_t + gamma G_{t+1} over
    action-masked rewards) and the batch normalisation at the end of
    compute_advantages_and_returns (mean and population variance over action tokens,
    rsqrt(var.clamp(min=1e-8)))."""
    last = mask.size(1) - 1 - mask.long().fliplr().argmax(dim=1, keepdim=True)
    token_rewards = torch.zeros_like(kl).scatter_(1, last, rewards.unsqueeze(1)) - kl_coef * kl
    token_rewards = token_rewards * mask
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.size(0))
    for t in reversed(range(token_rewards.size(1))):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
    count = mask.sum()
    mean = (returns * mask).sum() / count
    var = ((returns - mean).pow(2) * mask).sum() / count
    return (returns - mean) * var.clamp(min=1e-8).rsqrt()


@pytest.mark.parametrize(("gamma", "kl_coef"), [(1.0, 0.0), (0.9, 0.05)])
def test_reinforce_plus_plus_matches_openrlhf(
    generator: torch.Generator, gamma: float, kl_coef: float
) -> None:
    # OpenRLHF's masks start at the first response token; ours may start after a prompt.
    mask = random_mask(generator, offset=False)
    rewards = torch.randn(SEQUENCES, generator=generator)
    logprobs = torch.randn(SEQUENCES, LENGTH, generator=generator) * 0.3
    ref_logprobs = torch.randn(SEQUENCES, LENGTH, generator=generator) * 0.3
    token_rewards = alg.kl_shaped_token_rewards(
        rewards, logprobs, ref_logprobs, mask, kl_coef, "k1"
    )
    mine, _ = alg.reinforce_plus_plus_advantages(token_rewards, mask, gamma)
    theirs = openrlhf_reinforce(rewards, logprobs - ref_logprobs, kl_coef, mask, gamma)
    keep = mask.bool()
    torch.testing.assert_close(mine[keep], theirs[keep], atol=1e-5, rtol=1e-5)
    assert torch.all(mine[~keep] == 0)


def test_reinforce_plus_plus_returns_match_verl_with_a_prompt_offset(
    generator: torch.Generator,
) -> None:
    # verl trainer/ppo/core_algos.py, compute_reinforce_plus_plus_outcome_advantage: returns
    # accumulate backwards, the running return reset after each masked-out position.
    mask = random_mask(generator)
    token_rewards = torch.randn(SEQUENCES, LENGTH, generator=generator) * mask
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(SEQUENCES)
    for t in reversed(range(LENGTH)):
        running = token_rewards[:, t] + 0.95 * running
        returns[:, t] = running
        running = running * mask[:, t]
    torch.testing.assert_close(
        alg.discounted_returns(token_rewards, mask, 0.95), returns * mask, atol=1e-6, rtol=0
    )


def test_reinforce_plus_plus_baseline_matches_openrlhf(generator: torch.Generator) -> None:
    # OpenRLHF ("reinforce_baseline"): rewards minus their group's mean, then as REINFORCE
    # (gamma forced to 1) with the batch normalisation.
    mask = random_mask(generator, offset=False)
    rewards = binary_rewards(generator)
    centred_theirs = rewards.view(-1, GROUP) - rewards.view(-1, GROUP).mean(-1, keepdim=True)
    theirs = openrlhf_reinforce(centred_theirs.view(-1), torch.zeros(mask.shape), 0.0, mask, 1.0)
    centred = alg.grpo_advantages(rewards, GROUP, scale_by_std=False)  # as the estimator does
    token_rewards = alg.kl_shaped_token_rewards(
        centred, torch.zeros_like(mask), torch.zeros_like(mask), mask, 0.0
    )
    mine, _ = alg.reinforce_plus_plus_advantages(token_rewards, mask, 1.0)
    keep = mask.bool()
    torch.testing.assert_close(mine[keep], theirs[keep], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- policy losses


def policy_inputs(generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Log-probs (with gradients), old log-probs within a modest ratio of them, token-level
    advantages of both signs, and a mask."""
    mask = random_mask(generator)
    old = -torch.rand(SEQUENCES, LENGTH, generator=generator) * 3
    logprobs = (old + torch.randn(SEQUENCES, LENGTH, generator=generator) * 0.25).clamp(max=0.0)
    advantages = torch.randn(SEQUENCES, LENGTH, generator=generator)
    return logprobs.requires_grad_(True), old, advantages, mask


def verl_vanilla(
    logprobs: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """verl trainer/ppo/core_algos.py, compute_policy_loss_vanilla, per token: ratio from the
    log-ratio clamped to +-20; max(-A ratio, -A clip(ratio, 1 - low, 1 + high)); for A < 0
    the dual clip min(that, -A * 3). Our ratios stay below 3, where the dual clip is idle."""
    ratio = torch.exp(torch.clamp(logprobs - old, min=-20.0, max=20.0))
    clipped = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - low, 1 + high))
    dual = torch.minimum(-advantages * 3.0, clipped)
    return torch.where(advantages < 0, dual, clipped)


def verl_agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """verl trainer/ppo/core_algos.py, agg_loss, on one batch (dp size 1, no global sizes)."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    sequence_mask = (mask.sum(-1) > 0).float()
    if mode == "seq-mean-token-sum":
        sequence_losses = (loss_mat * mask).sum(-1)
    else:  # seq-mean-token-mean
        sequence_losses = (loss_mat * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    return (sequence_losses * sequence_mask).sum() / sequence_mask.sum()


def trl_dr_grpo(per_token_loss: torch.Tensor, mask: torch.Tensor, max_length: int) -> torch.Tensor:
    """TRL trainer/grpo_trainer.py, _compute_loss with loss_type="dr_grpo": the masked sum over
    (rows x max_completion_length)."""
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_length)


@pytest.mark.parametrize(
    ("ours", "verl"),
    [
        ("token-mean", "token-mean"),
        ("sequence-mean-token-mean", "seq-mean-token-mean"),
        ("sequence-mean-token-sum", "seq-mean-token-sum"),
    ],
)
def test_clip_higher_loss_and_aggregations_match_verl(
    generator: torch.Generator, ours: alg.LossAggregation, verl: str
) -> None:
    logprobs, old, advantages, mask = policy_inputs(generator)
    terms = alg.clipped_surrogate(logprobs, old, advantages, mask, 0.2, 0.28)
    mine = alg.aggregate_loss(terms.per_token, mask, ours)
    theirs = verl_agg_loss(verl_vanilla(logprobs, old, advantages, 0.2, 0.28), mask, verl)
    torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)
    (my_grad,) = torch.autograd.grad(mine, logprobs)
    (their_grad,) = torch.autograd.grad(theirs, logprobs)
    torch.testing.assert_close(my_grad, their_grad, atol=1e-7, rtol=1e-5)
    # verl's clip fraction: the share of tokens where the clipped term is larger.
    unclipped = -advantages * torch.exp(logprobs - old)
    clipped = -advantages * torch.exp(logprobs - old).clamp(0.8, 1.28)
    fraction = ((clipped > unclipped).float() * mask).sum() / mask.sum()
    torch.testing.assert_close(terms.clip_fraction, fraction)


def test_constant_normaliser_matches_trl_dr_grpo(generator: torch.Generator) -> None:
    logprobs, old, advantages, mask = policy_inputs(generator)
    sequence_advantages = advantages[:, 0]  # Dr. GRPO's are per sequence, broadcast
    terms = alg.clipped_surrogate(logprobs, old, sequence_advantages, mask, 0.2, 0.2)
    mine = alg.aggregate_loss(terms.per_token, mask, "constant-normaliser", normaliser=LENGTH)
    # TRL: per_token_loss = -min(coef_1 A, clamp(coef_1, 1 - eps_low, 1 + eps_high) A).
    coef_1 = torch.exp(logprobs - old)
    a = sequence_advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_1.clamp(0.8, 1.2) * a)
    theirs = trl_dr_grpo(per_token, mask, LENGTH)
    torch.testing.assert_close(mine, theirs, atol=1e-7, rtol=1e-6)
    (my_grad,) = torch.autograd.grad(mine, logprobs)
    (their_grad,) = torch.autograd.grad(theirs, logprobs)
    torch.testing.assert_close(my_grad, their_grad, atol=1e-8, rtol=1e-5)


def test_gspo_matches_verl_and_trl_in_value_and_gradient(generator: torch.Generator) -> None:
    logprobs, old, advantages, mask = policy_inputs(generator)
    sequence_advantages = advantages[:, 0]
    low, high = 3e-4, 4e-4  # the paper's ranges
    terms = alg.gspo_surrogate(logprobs, old, sequence_advantages, mask, low, high)
    mine = alg.aggregate_loss(terms.per_token, mask, "sequence-mean-token-mean")

    # verl trainer/ppo/core_algos.py, compute_policy_loss_gspo: the sequence's mean log-ratio,
    # detached, plus log_prob - sg(log_prob) per token (clamped at 10), exponentiated, clipped
    # as in PPO and aggregated seq-mean-token-mean.
    log_ratio = logprobs - old
    lengths = mask.sum(-1).clamp(min=1)
    sequence_log_ratio = (log_ratio * mask).sum(-1) / lengths
    a = sequence_advantages.unsqueeze(-1)
    token_log = logprobs - logprobs.detach() + sequence_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(token_log.clamp(max=10.0))
    verl_tokens = torch.maximum(-a * ratio, -a * ratio.clamp(1 - low, 1 + high))
    verl = verl_agg_loss(verl_tokens, mask, "seq-mean-token-mean")

    # TRL trainer/grpo_trainer.py, _compute_loss with importance_sampling_level="sequence" and
    # loss_type="grpo": one differentiable ratio per sequence, exp(mean masked log-ratio).
    coef_1 = torch.exp(sequence_log_ratio).unsqueeze(-1)
    trl_tokens = -torch.min(coef_1 * a, coef_1.clamp(1 - low, 1 + high) * a).expand_as(mask)
    trl = ((trl_tokens * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()

    for theirs in (verl, trl):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)
        (my_grad,) = torch.autograd.grad(mine, logprobs, retain_graph=True)
        (their_grad,) = torch.autograd.grad(theirs, logprobs, retain_graph=True)
        torch.testing.assert_close(my_grad, their_grad, atol=1e-7, rtol=1e-5)


# ------------------------------------------------------------------------------------ DAPO


def test_dynamic_sampling_keeps_the_groups_verl_keeps(generator: torch.Generator) -> None:
    # verl recipe/dapo/dapo_ray_trainer.py, fit(): with filter_groups, a prompt is kept when
    # the standard deviation of its responses' metric is above 0 (or it has one response).
    rewards = binary_rewards(generator)
    kept = [float(np.std(group)) > 0 for group in rewards.view(-1, GROUP).numpy()]
    assert alg.groups_with_signal(rewards, GROUP).tolist() == kept
    assert not all(kept) and any(kept)


def test_overlong_penalty_matches_openrlhf_and_the_dapo_paper() -> None:
    max_length, buffer, factor = 20, 6, 0.5
    lengths = torch.arange(0, 26)
    # OpenRLHF trainer/ppo_utils/length_penalty.py, apply_overlong_penalty: exceed =
    # min(length - (max - buffer), buffer); if exceed > 0, reward += -exceed / buffer * factor.
    openrlhf = []
    for length in lengths.tolist():
        exceed = min(length - (max_length - buffer), buffer)
        openrlhf.append(-exceed / buffer * factor if exceed > 0 else 0.0)
    # DAPO (arXiv:2503.14476) eq. 13: 0 up to max - buffer, then ((max - buffer) - L) / buffer,
    # -1 beyond the maximum.
    paper = [
        0.0 if n <= max_length - buffer
        else ((max_length - buffer) - n) / buffer if n <= max_length else -1.0
        for n in lengths.tolist()
    ]  # fmt: skip
    mine = alg.overlong_penalty(lengths, max_length, buffer, factor)
    torch.testing.assert_close(mine, torch.tensor(openrlhf), atol=1e-7, rtol=0)
    torch.testing.assert_close(mine, torch.tensor(paper) * factor, atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match="buffer_length"):
        alg.overlong_penalty(lengths, 4, 5)
