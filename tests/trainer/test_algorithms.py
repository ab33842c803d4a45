"""Every formula in rlhf_trainer.algo.formulas against numbers worked out by hand.

Each test writes its arithmetic in comments so a reader can check the expected values without
running anything. Tolerances only absorb float32 rounding and the tiny eps terms.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_trainer import masked
from rlhf_trainer.algo import formulas as alg
from rlhf_trainer.modeling import logprobs as lp


def close(actual: torch.Tensor, expected: list[float] | float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0.0
    )


# ------------------------------------------------------------------------------ masking helpers


def test_masked_sum_and_mean_over_everything_and_per_row() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    # kept: 1 + 2 + 5 + 6 = 14 over 4 elements
    close(masked.masked_sum(values, mask), 14.0)
    close(masked.masked_mean(values, mask), 3.5)
    # per row: (1 + 2) / 2 = 1.5 and (5 + 6) / 2 = 5.5
    close(masked.masked_sum(values, mask, dim=-1), [3.0, 11.0])
    close(masked.masked_mean(values, mask, dim=-1), [1.5, 5.5])


def test_masked_mean_of_an_all_masked_row_is_zero_not_nan() -> None:
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[0, 0], [1, 0]])
    close(masked.masked_mean(values, mask, dim=-1), [0.0, 3.0])
    close(masked.masked_mean(values, torch.zeros_like(mask)), 0.0)


def test_junk_in_masked_out_positions_does_not_leak() -> None:
    # padding log-probs can be -inf or NaN; they must be selected away, not multiplied by 0
    values = torch.tensor([[1.0, float("-inf")], [3.0, float("nan")]])
    mask = torch.tensor([[1, 0], [1, 0]])
    close(masked.masked_mean(values, mask), 2.0)
    close(masked.masked_sum(values, mask, dim=-1), [1.0, 3.0])
    close(masked.masked_whiten(values, mask, eps=0.0), [[-1.0, 0.0], [1.0, 0.0]])


def test_masked_mean_accepts_boolean_masks() -> None:
    values = torch.tensor([2.0, 4.0, 100.0])
    close(masked.masked_mean(values, torch.tensor([True, True, False])), 3.0)


def test_masked_var_population_and_unbiased() -> None:
    values = torch.tensor([1.0, 2.0, 3.0, 10.0])
    mask = torch.tensor([1, 1, 1, 0])
    # mean of kept = 2; squared errors 1, 0, 1 -> sum 2; population 2/3, unbiased 2/2
    close(masked.masked_var(values, mask), 2.0 / 3.0)
    close(masked.masked_var(values, mask, unbiased=True), 1.0)


def test_masked_whiten_uses_only_masked_in_statistics() -> None:
    values = torch.tensor([1.0, 2.0, 3.0, 10.0])
    mask = torch.tensor([1, 1, 1, 0])
    # mean 2, var 2/3, std sqrt(2/3) = 0.816497 -> (1-2)/0.816497 = -1.224745; padding -> 0
    close(masked.masked_whiten(values, mask, eps=0.0), [-1.224745, 0.0, 1.224745, 0.0])
    # shift_mean=False adds the mean (2) back: only the scale changes
    close(
        masked.masked_whiten(values, mask, shift_mean=False, eps=0.0),
        [0.775255, 2.0, 3.224745, 0.0],
    )


def test_masked_whiten_of_constant_values_is_zero() -> None:
    # var 0 -> (x - mean) = 0 everywhere; eps keeps the division finite
    close(masked.masked_whiten(torch.tensor([5.0, 5.0]), torch.tensor([1, 1])), [0.0, 0.0])


# ---------------------------------------------------------------------- log-probs and entropy


def test_logprobs_from_logits_gathers_the_chosen_token() -> None:
    # logits = log([1, 2, 3]) -> probabilities [1/6, 2/6, 3/6]
    logits = torch.log(torch.tensor([[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]]))
    token_ids = torch.tensor([[2, 0]])
    close(lp.logprobs_from_logits(logits, token_ids), [[math.log(0.5), math.log(1 / 6)]])


def test_logprobs_from_logits_with_temperature() -> None:
    # logits / 2 = log(sqrt([1, 2, 3])) -> weights [1, 1.414214, 1.732051], total 4.146264;
    # token 2: log(1.732051 / 4.146264) = log(0.417738) = -0.872902
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0]]))
    close(lp.logprobs_from_logits(logits, torch.tensor([2]), temperature=2.0), [-0.872902])


def test_logprobs_from_logits_matches_log_softmax_for_low_precision_input() -> None:
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids = torch.tensor([[0, 3, 6], [1, 1, 5]])
    reference = torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp.logprobs_from_logits(logits, ids), reference)


def test_token_entropy() -> None:
    # uniform over 4 tokens: ln 4 = 1.386294
    # probabilities [1/4, 3/4]: 0.25 ln 4 + 0.75 ln(4/3) = 0.346574 + 0.215762 = 0.562335
    uniform = torch.zeros(4)
    skewed = torch.log(torch.tensor([1.0, 3.0, 0.0, 0.0]).clamp(min=1e-30))
    logits = torch.stack([uniform, skewed]).unsqueeze(0)  # [1, 2, 4]
    close(lp.token_entropy(logits), [[1.386294, 0.562335]])


def test_entropy_uses_the_sampling_temperature() -> None:
    # logits [0, 1, 2] at T = 0.5 are softmax([0, 2, 4]) = [0.015876, 0.117310, 0.866813]:
    # entropy 0.065773 + 0.251387 + 0.123895 = 0.441055 (-ln p = 4.142931, 2.142931, 0.142931)
    # (the raw logits' entropy, 0.832405, describes another distribution)
    logits = torch.tensor([[[0.0, 1.0, 2.0]]])
    close(lp.token_entropy(logits, temperature=0.5), [[0.441055]])
    close(lp.masked_entropy(logits, torch.tensor([[1]]), temperature=0.5), 0.441055)
    close(lp.token_entropy(logits), [[0.832405]])


def test_masked_entropy_averages_masked_in_positions_only() -> None:
    logits = torch.stack([torch.zeros(4), torch.tensor([1.0, 3.0, 0.0, 0.0]).log()]).unsqueeze(0)
    # only the uniform position is kept -> ln 4
    close(lp.masked_entropy(logits, torch.tensor([[1, 0]])), 1.386294)
    # both kept: (1.386294 + 0.562335) / 2 = 0.974315
    close(lp.masked_entropy(logits, torch.tensor([[1, 1]])), 0.974315)
    close(lp.masked_entropy(logits, torch.tensor([[0, 0]])), 0.0)


def test_fused_next_token_logprobs_and_entropy_by_hand() -> None:
    # Position 0 scores token 2 under softmax([0, 1, 2] / 0.5) = [0.015876, 0.117310, 0.866813]:
    # log-prob -0.142931, entropy 0.441055 (as above). Position 1 is uniform over 3 tokens:
    # log-prob ln(1/3) = -1.098612, entropy ln 3 = 1.098612. The last position scores nothing.
    logits = torch.tensor([[[0.0, 1.0, 2.0], [5.0, 5.0, 5.0], [9.0, 0.0, 0.0]]])
    ids = torch.tensor([[7, 2, 0]])
    logprobs, entropy = lp.next_token_logprobs_and_entropy(logits, ids, temperature=0.5)
    close(logprobs, [[-0.142931, -1.098612]])
    close(entropy, [[0.441055, 1.098612]])


def test_fused_next_token_logprobs_and_entropy_of_an_impossible_token() -> None:
    # A -inf logit has probability 0: it adds nothing to the entropy (0 log 0 = 0), and its
    # gradient is finite; an unfused log-softmax times its exp would give NaN.
    logits = torch.tensor([[[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0]]], requires_grad=True)
    logprobs, entropy = lp.next_token_logprobs_and_entropy(logits, torch.tensor([[0, 1]]))
    close(entropy, [[math.log(2)]])
    close(logprobs, [[math.log(0.5)]])
    (grad,) = torch.autograd.grad(logprobs.sum() + entropy.sum(), logits)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("entropy_weight", [1.5, -3.0, 1e6])
def test_fused_backward_at_an_impossible_token_is_finite_for_any_entropy_gradient(
    entropy_weight: float,
) -> None:
    # log p of a -inf logit is clamped to float32's minimum (-3.4e38); scaled by an incoming
    # entropy gradient above 1 before being multiplied by p = 0, it overflowed to -inf and
    # 0 * inf made the whole row's gradient NaN. p log p is 0 there: multiply by p first.
    logits = torch.tensor([[[0.0, 1.0, float("-inf")], [0.0, 0.0, 0.0]]], requires_grad=True)
    logprobs, entropy = lp.next_token_logprobs_and_entropy(logits, torch.tensor([[0, 1]]))
    (grad,) = torch.autograd.grad(logprobs.sum() + entropy_weight * entropy.sum(), logits)
    assert torch.isfinite(grad).all(), grad
    assert grad[0, 0, 2] == 0  # an impossible token gets no gradient
    # The finite entries equal the unfused form's on the two possible tokens.
    finite = logits.detach()[:, :1, :2].clone().requires_grad_(True)
    log_p = torch.log_softmax(finite, dim=-1)
    objective = log_p[0, 0, 1] - entropy_weight * (log_p.exp() * log_p).sum()
    (expected,) = torch.autograd.grad(objective, finite)
    torch.testing.assert_close(grad[:, :1, :2], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elements", [1 << 28, 40])  # one chunk; one row per chunk
def test_fused_next_token_logprobs_and_entropy_equal_the_unfused_forms_and_gradients(
    temperature: float, chunk_elements: int
) -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 6, 11, dtype=torch.float64, generator=generator, requires_grad=True)
    ids = torch.randint(0, 11, (3, 6), generator=generator)
    weights = torch.randn(2, 3, 5, dtype=torch.float64, generator=generator)

    def objective(logprobs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        return (logprobs * weights[0]).sum() + (entropy * weights[1]).sum()

    fused = lp.next_token_logprobs_and_entropy(logits, ids, temperature, chunk_elements)
    (fused_grad,) = torch.autograd.grad(objective(*fused), logits)
    scores = logits[:, :-1].double() / temperature
    log_p = torch.log_softmax(scores, dim=-1)
    unfused = (
        log_p.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1),
        -(log_p.exp() * log_p).sum(-1),
    )
    (unfused_grad,) = torch.autograd.grad(objective(*unfused), logits)
    for mine, theirs in zip((*fused, fused_grad), (*unfused, unfused_grad), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)
    assert torch.all(fused_grad[:, -1] == 0)  # the last position scores nothing


def test_fused_next_token_logprobs_and_entropy_of_bfloat16_logits() -> None:
    # bf16 logits (a GPU model's output) are scored in float32, and the gradient is bf16.
    logits = torch.randn(2, 4, 9, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits.requires_grad_(True)
    ids = torch.tensor([[0, 3, 6, 8], [1, 1, 5, 2]])
    logprobs, entropy = lp.next_token_logprobs_and_entropy(logits, ids)
    assert logprobs.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logprobs, lp.logprobs_from_logits(logits[:, :-1], ids[:, 1:]))
    torch.testing.assert_close(entropy, lp.token_entropy(logits[:, :-1]))
    (grad,) = torch.autograd.grad(logprobs.sum(), logits)
    assert grad.dtype == torch.bfloat16


def test_fused_next_token_logprobs_and_entropy_names_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"logits must be \[B, L, V\]"):
        lp.next_token_logprobs_and_entropy(torch.zeros(4, 9), torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elements", [1 << 28, 33, 1])  # one chunk; 3 tokens; 1 token
def test_the_head_fused_form_equals_the_model_heads_logits_scored_and_their_gradients(
    temperature: float, chunk_elements: int
) -> None:
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 6, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    head = torch.randn(11, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    ids = torch.randint(0, 11, (3, 6), generator=generator)
    weights = torch.randn(2, 3, 5, dtype=torch.float64, generator=generator)

    def objective(logprobs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        return (logprobs * weights[0]).sum() + (entropy * weights[1]).sum()

    fused = lp.linear_next_token_logprobs_and_entropy(
        hidden, head, ids, temperature, chunk_elements
    )
    fused_grads = torch.autograd.grad(objective(*fused), (hidden, head))
    unfused = lp.next_token_logprobs_and_entropy(hidden @ head.t(), ids, temperature)
    unfused_grads = torch.autograd.grad(objective(*unfused), (hidden, head))
    for mine, theirs in zip((*fused, *fused_grads), (*unfused, *unfused_grads), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)
    assert torch.all(fused_grads[0][:, -1] == 0)  # the last position scores nothing


def test_the_head_fused_form_passes_gradcheck() -> None:
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 4, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    head = torch.randn(5, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    ids = torch.randint(0, 5, (2, 4), generator=generator)
    assert torch.autograd.gradcheck(
        lambda h, w: lp.linear_next_token_logprobs_and_entropy(h, w, ids, 0.8, 10),
        (hidden, head),
    )


def test_the_head_fused_form_in_bfloat16_is_the_bfloat16_heads_within_rounding() -> None:
    # A GPU model's dtype: each chunk's logits come from a bf16 matmul, as the model's own head
    # gives them, then float32 math; the gradients are bf16 like the parameters'.
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 7, 16, generator=generator).to(torch.bfloat16).requires_grad_(True)
    head = torch.randn(50, 16, generator=generator).to(torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, 50, (2, 7), generator=generator)
    fused = lp.linear_next_token_logprobs_and_entropy(hidden, head, ids, chunk_elements=100)
    unfused = lp.next_token_logprobs_and_entropy(hidden @ head.t(), ids)
    assert fused[0].dtype == torch.float32
    for mine, theirs in zip(fused, unfused, strict=True):
        torch.testing.assert_close(mine, theirs)  # the same bf16 logits: equal values
    fused_grads = torch.autograd.grad(fused[0].sum() + fused[1].sum(), (hidden, head))
    unfused_grads = torch.autograd.grad(unfused[0].sum() + unfused[1].sum(), (hidden, head))
    for mine, theirs in zip(fused_grads, unfused_grads, strict=True):
        assert mine.dtype == torch.bfloat16
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="Triton's kernels: on the GPU machine"))],
)  # fmt: skip
def test_compiled_chunk_math_gives_the_eager_values_and_gradients(device: str) -> None:
    """`model.compiledLogprobs`: Inductor's kernels (C++ on the CPU, Triton on a GPU) for
    both forms, chunked, at a temperature, from bf16 logits as a GPU model gives them, with
    the gradients of both results and of the log-probs alone (an update without an entropy
    bonus; each pattern of gradients is a compile of its own)."""
    generator = torch.Generator().manual_seed(6)
    bf16 = {"dtype": torch.bfloat16, "device": device}
    hidden = torch.randn(3, 7, 16, generator=generator).to(**bf16).requires_grad_(True)
    head = torch.randn(40, 16, generator=generator).to(**bf16).requires_grad_(True)
    ids = torch.randint(0, 40, (3, 7), generator=generator).to(device)

    def run(compiled: bool, which: slice) -> list[torch.Tensor]:
        logits = (hidden @ head.t()).detach().requires_grad_(True)
        plain = lp.next_token_logprobs_and_entropy(logits, ids, 0.7, 100, compiled=compiled)
        fused = lp.linear_next_token_logprobs_and_entropy(
            hidden, head, ids, 0.7, 100, compiled=compiled
        )
        loss = sum(t.sum() for t in (*plain[which], *fused[which]))
        return [*plain, *fused, *torch.autograd.grad(loss, (logits, hidden, head))]

    for which in (slice(0, 2), slice(0, 1)):
        for mine, theirs in zip(run(True, which), run(False, which), strict=True):
            torch.testing.assert_close(mine, theirs)  # float32 or bf16 rounding
    assert lp.chunk_math(True) is lp.chunk_math(True)  # compiled once per process


def test_the_head_fused_form_names_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"hidden must be \[B, L, H\]"):
        lp.linear_next_token_logprobs_and_entropy(
            torch.zeros(4, 9), torch.zeros(5, 9), torch.zeros(4, dtype=torch.long)
        )
    with pytest.raises(ValueError, match=r"head must be \[V, 9\]"):
        lp.linear_next_token_logprobs_and_entropy(
            torch.zeros(1, 4, 9), torch.zeros(5, 8), torch.zeros(1, 4, dtype=torch.long)
        )


# -------------------------------------------------------------------------------------- KL


def test_kl_estimators_k1_and_k3() -> None:
    logprobs = torch.tensor([-1.0, -2.0, -0.5])
    ref_logprobs = torch.tensor([-2.0, -1.0, -0.5])
    # log_ratio = logp - ref = [1, -1, 0]
    close(alg.kl_estimate(logprobs, ref_logprobs, "k1"), [1.0, -1.0, 0.0])
    # k3 = exp(-lr) + lr - 1: exp(-1) + 1 - 1 = 0.367879; exp(1) - 1 - 1 = 0.718282; 0
    close(alg.kl_estimate(logprobs, ref_logprobs, "k3"), [0.367879, 0.718282, 0.0])


def test_kl_estimate_rejects_unknown_estimator() -> None:
    with pytest.raises(ValueError, match="k2"):
        alg.kl_estimate(torch.zeros(1), torch.zeros(1), "k2")  # type: ignore[arg-type]


def test_kl_shaped_token_rewards_put_the_sequence_reward_on_the_last_token() -> None:
    logprobs = torch.full((3, 3), -1.0)
    ref_logprobs = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -1.2, -1.0], [-1.0, -2.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    sequence_rewards = torch.tensor([1.0, 2.0, 5.0])
    # k1 = logp - ref:   row 0 -> [0.5, 0, 0.5(masked)]; row 1 -> [0(masked), 0.2, 0]
    # penalty -0.1 * k1: row 0 -> [-0.05, 0, 0];         row 1 -> [0, -0.02, 0]
    # reward on last kept token: row 0 at t=1 (+1), row 1 at t=2 (+2); row 2 has no token
    shaped = alg.kl_shaped_token_rewards(
        sequence_rewards, logprobs, ref_logprobs, mask, kl_coef=0.1, estimator="k1"
    )
    close(shaped, [[-0.05, 1.0, 0.0], [0.0, -0.02, 2.0], [0.0, 0.0, 0.0]])


def test_kl_shaped_token_rewards_with_k3_and_no_penalty() -> None:
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref_logprobs = torch.tensor([[-2.0, -1.0]])
    mask = torch.tensor([[1, 1]])
    # k3 = [0.367879, 0.718282]; * -0.5 -> [-0.183940, -0.359141]; + 3 on the last token
    shaped = alg.kl_shaped_token_rewards(
        torch.tensor([3.0]), logprobs, ref_logprobs, mask, kl_coef=0.5, estimator="k3"
    )
    close(shaped, [[-0.183940, 2.640859]])
    close(
        alg.kl_shaped_token_rewards(torch.tensor([3.0]), logprobs, ref_logprobs, mask, 0.0),
        [[0.0, 3.0]],
    )


def test_kl_loss_is_the_masked_mean_estimate_and_differentiates_the_policy_only() -> None:
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref_logprobs = torch.tensor([[-2.0, -1.0]], requires_grad=True)
    # k3 mean = (0.367879 + 0.718282) / 2 = 0.543081
    loss = alg.kl_loss(logprobs, ref_logprobs, torch.tensor([[1, 1]]), "k3")
    close(loss, 0.543081)
    loss.backward()
    # d k3 / d logp = 1 - exp(-lr): 1 - e^-1 = 0.632121 and 1 - e = -1.718282, halved by the mean
    close(logprobs.grad, [[0.316060, -0.859141]])  # type: ignore[arg-type]
    assert ref_logprobs.grad is None
    # k1 with the second token masked out: only lr = 1 remains
    close(alg.kl_loss(logprobs, ref_logprobs, torch.tensor([[1, 0]]), "k1"), 1.0)


# ------------------------------------------------------------------------------- advantages


def test_grpo_advantages_with_std_scaling() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 0.0, 0.0, 0.0])
    # group 0 [1, 0, 0, 1]: mean 0.5, centred +-0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.577350
    #   -> +-0.5 / 0.577350 = +-0.866025
    # group 1 [3, 0, 0, 0]: mean 0.75, centred [2.25, -0.75, -0.75, -0.75],
    #   unbiased std sqrt((5.0625 + 3 * 0.5625) / 3) = sqrt(2.25) = 1.5 -> [1.5, -0.5, -0.5, -0.5]
    close(
        alg.grpo_advantages(rewards, group_size=4),
        [0.866025, -0.866025, -0.866025, 0.866025, 1.5, -0.5, -0.5, -0.5],
    )


def test_grpo_advantages_without_std_scaling_only_centre() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 0.0, 0.0, 0.0])
    close(
        alg.grpo_advantages(rewards, group_size=4, scale_by_std=False),
        [0.5, -0.5, -0.5, 0.5, 2.25, -0.75, -0.75, -0.75],
    )


def test_grpo_group_with_zero_std_has_zero_advantage() -> None:
    # group 0 all 0.5: centred 0 -> 0 / (0 + eps) = 0; group 1 [3, 0, 0]: mean 1,
    # centred [2, -1, -1], unbiased std sqrt(6 / 2) = 1.732051 -> [1.154701, -0.577350, -0.577350]
    rewards = torch.tensor([0.5, 0.5, 0.5, 3.0, 0.0, 0.0])
    advantages = alg.grpo_advantages(rewards, group_size=3)
    close(advantages, [0.0, 0.0, 0.0, 1.154701, -0.577350, -0.577350])
    assert torch.isfinite(advantages).all()


@pytest.mark.parametrize("value", [0.7, 0.1, 1e-3, 123.456])
@pytest.mark.parametrize("group_size", [3, 7, 16])
def test_grpo_group_of_equal_rewards_is_exactly_zero(value: float, group_size: int) -> None:
    # float32 rounding leaves a mean one ulp off the rewards; the division by a std of the same
    # size must not turn that residue into an advantage (it gave +0.056 for 0.7 x 7).
    rewards = torch.full((2 * group_size,), value)
    rewards[group_size:] = torch.arange(group_size, dtype=torch.float32)  # one group with signal
    advantages = alg.grpo_advantages(rewards, group_size=group_size)
    assert torch.equal(advantages[:group_size], torch.zeros(group_size))
    assert advantages[group_size:].abs().sum() > 0


def test_grpo_group_of_one_has_zero_advantage() -> None:
    close(alg.grpo_advantages(torch.tensor([2.0, 7.0]), group_size=1), [0.0, 0.0])


@pytest.mark.parametrize(("rewards", "group_size"), [(torch.zeros(5), 2), (torch.zeros(2, 2), 2)])
def test_grpo_rejects_misshapen_rewards(rewards: torch.Tensor, group_size: int) -> None:
    with pytest.raises(ValueError, match="group_size"):
        alg.grpo_advantages(rewards, group_size)


def test_grpo_rejects_group_size_zero() -> None:
    with pytest.raises(ValueError, match="group_size"):
        alg.grpo_advantages(torch.zeros(4), 0)


def test_gae_full_row() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    # gamma 0.9, lambda 0.8 (gamma * lambda = 0.72), last token terminal:
    # t=2: delta = 1 - 0.7 = 0.3                 A2 = 0.3
    # t=1: delta = 0.9 * 0.7 - 0.6 = 0.03        A1 = 0.03 + 0.72 * 0.3 = 0.246
    # t=0: delta = 0.9 * 0.6 - 0.5 = 0.04        A0 = 0.04 + 0.72 * 0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    advantages, returns = alg.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    close(advantages, [[0.21712, 0.246, 0.3]])
    close(returns, [[0.71712, 0.846, 1.0]])


def test_gae_with_lambda_zero_is_the_one_step_td_error() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    # deltas from the test above: [0.04, 0.03, 0.3]
    advantages, _ = alg.gae_advantages(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.0)
    close(advantages, [[0.04, 0.03, 0.3]])


def test_gae_ignores_prompt_and_padding_positions() -> None:
    # row 0: prompt at t=0 and padding at t=3 carry junk rewards/values that must not leak in.
    # gamma = lambda = 1, so A_t = (sum of rewards from t on) - V_t within the response:
    #   t=2: 1 - 0.25 = 0.75; t=1: (0 + 1) - 0.5 = 0.5; returns = A + V = [1, 1]
    # row 1: fully masked -> zeros everywhere
    rewards = torch.tensor([[9.0, 0.0, 1.0, 9.0], [1.0, 1.0, 1.0, 1.0]])
    values = torch.tensor([[9.0, 0.5, 0.25, 9.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]])
    advantages, returns = alg.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    close(advantages, [[0.0, 0.5, 0.75, 0.0], [0.0, 0.0, 0.0, 0.0]])
    close(returns, [[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_gae_is_detached_from_the_critic_graph() -> None:
    values = torch.tensor([[0.5, 0.5]], requires_grad=True)
    advantages, returns = alg.gae_advantages(torch.ones(1, 2), values, torch.ones(1, 2), 1.0, 1.0)
    assert not advantages.requires_grad
    assert not returns.requires_grad


# ------------------------------------------------------------------------------------ losses


def _ratios_to_logprobs(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Old log-probs of 0 and new log-probs of log(ratio), so exp(new - old) = ratio."""
    new = torch.log(torch.tensor([ratios])).requires_grad_(True)
    return new, torch.zeros_like(new)


def test_clipped_policy_loss_values_clip_fraction_and_kl() -> None:
    logprobs, old_logprobs = _ratios_to_logprobs([1.5, 0.5, 1.1, 0.7])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    # clip range 0.2 -> ratios clamped to [0.8, 1.2]; per token max(-A r, -A clip(r)):
    # t0 r=1.5 A=+1: max(-1.5, -1.2) = -1.2  (clipped term active)
    # t1 r=0.5 A=+1: max(-0.5, -0.8) = -0.5
    # t2 r=1.1 A=-1: max( 1.1,  1.1) =  1.1  (inside the range: not counted as clipped)
    # t3 r=0.7 A=-1: max( 0.7,  0.8) =  0.8  (clipped term active)
    # loss = (-1.2 - 0.5 + 1.1 + 0.8) / 4 = 0.05; clip fraction 2 / 4
    # approx KL = mean(r - 1 - ln r) = (0.094535 + 0.193147 + 0.004690 + 0.056675) / 4 = 0.087262
    result = alg.clipped_policy_loss(logprobs, old_logprobs, advantages, mask, clip_range=0.2)
    close(result.loss, 0.05)
    close(result.clip_fraction, 0.5)
    close(result.approx_kl, 0.087262)
    result.loss.backward()
    # clipped tokens get no gradient; the others get d(-A r)/d logp = -A r, divided by 4 tokens
    close(logprobs.grad, [[0.0, -0.125, 0.275, 0.0]])  # type: ignore[arg-type]


def test_clipped_policy_loss_respects_the_mask() -> None:
    logprobs, old_logprobs = _ratios_to_logprobs([1.5, 0.5, 1.1, 0.7])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # t3 dropped: (-1.2 - 0.5 + 1.1) / 3 = -0.2; clipped tokens among the kept: t0 -> 1/3
    result = alg.clipped_policy_loss(logprobs, old_logprobs, advantages, mask, clip_range=0.2)
    close(result.loss, -0.2)
    close(result.clip_fraction, 1.0 / 3.0)


def test_clipped_policy_loss_with_a_higher_upper_clip() -> None:
    logprobs, old_logprobs = _ratios_to_logprobs([1.5, 0.5, 1.1, 0.7])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    # range [0.8, 1.6]: t0 now inside (-1.5); t3 still clipped at 0.8
    # loss = (-1.5 - 0.5 + 1.1 + 0.8) / 4 = -0.025; clip fraction 1/4
    result = alg.clipped_policy_loss(
        logprobs, old_logprobs, advantages, torch.ones(1, 4), clip_range=0.2, clip_range_high=0.6
    )
    close(result.loss, -0.025)
    close(result.clip_fraction, 0.25)


def test_clipped_policy_loss_broadcasts_sequence_advantages_and_aggregates() -> None:
    logprobs = torch.zeros(3, 2)  # ratio 1 everywhere, so per-token loss = -A
    advantages = torch.tensor([2.0, -1.0, 7.0])
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])
    # per token: row 0 [-2, -2], row 1 [1, -], row 2 nothing
    # token mean: (-2 - 2 + 1) / 3 = -1
    # sequence mean: rows with tokens -> mean(-2, 1) = -0.5 (the empty row is not counted)
    token_mean = alg.clipped_policy_loss(logprobs, logprobs, advantages, mask)
    sequence_mean = alg.clipped_policy_loss(
        logprobs, logprobs, advantages, mask, aggregation="sequence-mean-token-mean"
    )
    former_name = alg.clipped_policy_loss(  # the name from before issue 26 still works
        logprobs, logprobs, advantages, mask, aggregation="sequence_mean"
    )
    close(token_mean.loss, -1.0)
    close(sequence_mean.loss, -0.5)
    close(former_name.loss, -0.5)
    close(token_mean.clip_fraction, 0.0)


def test_clipped_policy_loss_with_everything_masked_is_zero() -> None:
    logprobs, old_logprobs = _ratios_to_logprobs([1.5, 0.5])
    result = alg.clipped_policy_loss(
        logprobs, old_logprobs, torch.tensor([[1.0, 1.0]]), torch.zeros(1, 2)
    )
    for value in result:
        close(value, 0.0)


def test_value_loss_with_clipping() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0]])
    old_values = torch.tensor([[1.5, 1.5, 3.0]])
    returns = torch.tensor([[2.0, 2.0, 2.0]])
    # clip 0.2: clipped V = old + clamp(V - old, -0.2, 0.2) = [1.3, 1.7, 3.0]
    # t0: max((1-2)^2, (1.3-2)^2) = max(1, 0.49) = 1     (unclipped active)
    # t1: max((2-2)^2, (1.7-2)^2) = max(0, 0.09) = 0.09  (clipped active)
    # t2: max(1, 1) = 1                                  (tie: not counted)
    # loss = 0.5 * (1 + 0.09 + 1) / 3 = 0.348333; clip fraction 1/3
    result = alg.value_loss(values, old_values, returns, torch.ones(1, 3), clip_range=0.2)
    close(result.loss, 0.348333)
    close(result.clip_fraction, 1.0 / 3.0)


def test_value_loss_without_clipping_and_with_a_mask() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0]])
    returns = torch.tensor([[2.0, 2.0, 2.0]])
    # 0.5 * (1 + 0 + 1) / 3 = 0.333333; masking t2: 0.5 * (1 + 0) / 2 = 0.25
    unclipped = alg.value_loss(values, values, returns, torch.ones(1, 3))
    close(unclipped.loss, 1.0 / 3.0)
    close(unclipped.clip_fraction, 0.0)
    close(alg.value_loss(values, values, returns, torch.tensor([[1, 1, 0]])).loss, 0.25)
    close(alg.value_loss(values, values, returns, torch.zeros(1, 3), clip_range=0.2).loss, 0.0)
