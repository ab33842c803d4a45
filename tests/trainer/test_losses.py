"""The policy objective a rank minimises: its micro-batches add up to the spec's aggregation over
the whole step, and the defaults are today's loss exactly; dynamic sampling's choice of groups
and the experience helpers of the new estimators."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainer import masked
from rlhf_trainer.algo import formulas as alg
from rlhf_trainer.algo.batch import ShardPlan
from rlhf_trainer.algo.experience import (
    ESTIMATORS,
    Rollout,
    StepScores,
    choose_groups,
)
from rlhf_trainer.algo.losses import (
    BEHAVIOUR_WEIGHT_CAP,
    REFERENCE_KL,
    PolicyObjective,
    old_logprobs_needed,
)
from rlhfjob.api import AlgorithmSpec

ROWS, LENGTH = 10, 7


def step_fields(seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Per-row tensors of a step: the mask (a prompt, then responses of different lengths),
    the fields the update reads, and the current log-probs (with gradients)."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(ROWS, LENGTH)
    for row in range(ROWS):
        mask[row, 1 : 2 + row % (LENGTH - 1)] = 1.0
    old = -torch.rand(ROWS, LENGTH, generator=generator) * 2
    fields = {
        "old_logprobs": old,
        "ref_logprobs": old + torch.randn(ROWS, LENGTH, generator=generator) * 0.1,
        "advantages": torch.randn(ROWS, generator=generator),
    }
    logprobs = (old + torch.randn(ROWS, LENGTH, generator=generator) * 0.2).clamp(max=0.0)
    return mask, fields, logprobs.requires_grad_(True)


def spec(**fields: object) -> AlgorithmSpec:
    return AlgorithmSpec.model_validate(
        {"totalSteps": 1, "klCoef": 0.05, "entropyCoef": 0.01, "maxResponseLength": 8, **fields}
    )


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"lossAggregation": "sequence-mean-token-mean"},
        {"lossAggregation": "sequence-mean-token-sum", "clipRangeHigh": 0.28},
        {"lossAggregation": "constant-normaliser", "scaleRewards": False},
        {"policyLoss": "gspo", "clipRangeLow": 3e-4, "clipRangeHigh": 4e-4},
    ],
    ids=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "dr-grpo", "gspo"],
)
def test_micro_batches_weighted_by_their_units_add_up_to_the_whole_steps_loss(fields) -> None:
    # As a rank does: each micro-batch's loss times its units times the plan's scale (one rank,
    # so the scale is accumulation steps / the step's units), the padding rows inert.
    algorithm = spec(**fields)
    objective = PolicyObjective(algorithm)
    mask, batch_fields, logprobs = step_fields()
    entropies = torch.rand(ROWS, LENGTH) * logprobs.abs()  # differentiable, like the real one
    whole = objective(logprobs, entropies, batch_fields, mask).loss
    plan = ShardPlan(ROWS, world_size=1, micro_batch_size=4)  # 3 micro-batches, 2 rows padding
    scale = plan.loss_scale(objective.units(mask)) / plan.accumulation_steps
    total = torch.zeros(())
    padded = plan.padded_rows
    pad = padded - ROWS
    mask_p = torch.cat([mask, torch.zeros(pad, LENGTH)])
    logprobs_p = torch.cat([logprobs, torch.zeros(pad, LENGTH)])
    entropies_p = torch.cat([entropies, torch.zeros(pad, LENGTH)])
    fields_p = {k: torch.cat([v, torch.zeros(pad, *v.shape[1:])]) for k, v in batch_fields.items()}
    for start in range(0, padded, 4):
        rows = slice(start, start + 4)
        micro = objective(
            logprobs_p[rows], entropies_p[rows], {k: v[rows] for k, v in fields_p.items()},
            mask_p[rows],
        )  # fmt: skip
        total = total + micro.loss * micro.units * scale
    torch.testing.assert_close(total, whole, atol=1e-6, rtol=1e-6)
    (whole_grad,) = torch.autograd.grad(whole, logprobs, retain_graph=True)
    (total_grad,) = torch.autograd.grad(total, logprobs)
    torch.testing.assert_close(total_grad, whole_grad, atol=1e-7, rtol=1e-5)


def test_the_default_objective_is_the_clipped_token_mean_loss_with_kl_and_entropy() -> None:
    # An existing job's spec trains exactly as before: the same functions, the same order.
    algorithm = spec()
    mask, fields, logprobs = step_fields(1)
    entropies = torch.rand(ROWS, LENGTH)
    got = PolicyObjective(algorithm)(logprobs, entropies, fields, mask)
    policy = alg.clipped_policy_loss(
        logprobs, fields["old_logprobs"], fields["advantages"], mask, clip_range=0.2
    )
    kl = alg.kl_loss(logprobs, fields["ref_logprobs"], mask, "k3")
    entropy = masked.masked_mean(entropies, mask)
    expected = policy.loss + 0.05 * kl - 0.01 * entropy
    assert torch.equal(got.loss, expected)
    assert got.units == float(mask.sum())
    assert set(got.terms) == {"policy_loss", "clip_fraction", "approx_kl", "kl_loss", "entropy"}


def test_stale_tokens_are_weighted_by_proximal_over_behaviour_probability_capped() -> None:
    """The decoupled objective (maxStaleness): behaviour log-probs equal to the proximal ones
    change nothing; a token the engine sampled at half the proximal probability counts twice;
    a weight above the cap counts as the cap; the weight carries no gradient."""
    algorithm = spec(klCoef=0.0, entropyCoef=0.0)
    objective = PolicyObjective(algorithm)
    mask, fields, logprobs = step_fields(2)
    entropies = torch.zeros(ROWS, LENGTH)
    plain = objective(logprobs, entropies, fields, mask)
    same = objective(
        logprobs, entropies, fields | {"behaviour_logprobs": fields["old_logprobs"]}, mask
    )
    torch.testing.assert_close(same.loss, plain.loss, rtol=0, atol=0)
    assert float(same.terms["behaviour_weight"]) == pytest.approx(1.0)

    halved = fields | {"behaviour_logprobs": fields["old_logprobs"] - torch.log(torch.tensor(2.0))}
    doubled = objective(logprobs, entropies, halved, mask)
    torch.testing.assert_close(doubled.loss, 2 * plain.loss)
    (grad,) = torch.autograd.grad(doubled.loss, logprobs)
    (plain_grad,) = torch.autograd.grad(plain.loss, logprobs)
    torch.testing.assert_close(grad, 2 * plain_grad)

    far = fields | {"behaviour_logprobs": fields["old_logprobs"] - 10.0}
    capped = objective(logprobs, entropies, far, mask)
    torch.testing.assert_close(capped.loss, BEHAVIOUR_WEIGHT_CAP * plain.loss)
    assert float(capped.terms["behaviour_kl"]) > float(doubled.terms["behaviour_kl"]) > 0


def test_the_policy_loss_chooses_its_aggregation_unless_the_spec_does() -> None:
    assert spec().effective_loss_aggregation == "token-mean"
    assert spec(policyLoss="gspo").effective_loss_aggregation == "sequence-mean-token-mean"
    chosen = spec(policyLoss="gspo", lossAggregation="token-mean")
    assert chosen.effective_loss_aggregation == "token-mean"
    assert spec(clipRange=0.3, clipRangeHigh=0.4).clip_bounds == (0.3, 0.4)


def test_dynamic_sampling_chooses_groups_with_signal_first_then_fills() -> None:
    signal = [False, True, False, True, True, False]
    assert choose_groups(signal, 2) == ([1, 3], 0)
    assert choose_groups(signal, 3) == ([1, 3, 4], 0)
    assert choose_groups(signal, 5) == ([0, 1, 2, 3, 4], 2)  # two filled, sampling order kept
    rollout = Rollout([[g] for g in range(6)], [[g, g] for g in range(6)], [{}] * 6, [0] * 6)
    picked = Rollout.concatenate([rollout, rollout]).groups([1, 2], group_size=3)
    assert picked.prompts == [[3], [4], [5], [0], [1], [2]]


@pytest.mark.parametrize("name", ["rloo", "reinforce-plus-plus", "reinforce-plus-plus-baseline"])
def test_the_new_estimators_give_advantages_for_the_update(name: str) -> None:
    mask, fields, _ = step_fields(2)
    algorithm = spec(name=name, groupSize=2, promptsPerStep=5, microBatchSize=2)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.25])
    scores = StepScores(rewards, mask, fields["old_logprobs"], fields["ref_logprobs"])
    advantages = ESTIMATORS[name].estimate(scores, algorithm)["advantages"]
    assert advantages.shape[0] == ROWS and torch.isfinite(advantages).all()
    assert algorithm.samples_per_prompt == 2
    if name == "rloo":  # the rest of the group is the baseline: equal groups learn nothing
        assert torch.all(advantages[2:4] == 0) and torch.all(advantages[4:6] == 0)
    elif name == "reinforce-plus-plus-baseline":  # ... before the batch whitening moves them
        equal = advantages[2:6][mask[2:6].bool()]
        assert torch.allclose(equal, equal[0])


@pytest.mark.parametrize(
    ("fields", "needed"),
    [
        ({}, False),  # GRPO, KL as a loss, one epoch, on-policy
        ({"name": "ppo", "klMode": "loss"}, False),
        ({"updateEpochs": 2}, True),  # the second pass trains a policy that has moved
        ({"maxStaleness": 1}, True),  # the proximal policy is not the behaviour one
        ({"klMode": "reward"}, True),  # the advantages read them
        ({"klMode": "reward", "klCoef": 0.0}, False),
    ],
)
def test_old_logprobs_are_computed_only_where_the_update_cannot_make_them(
    fields: dict[str, object], needed: bool
) -> None:
    assert old_logprobs_needed(spec(**fields)) is needed


@pytest.mark.parametrize("loss", ["ppo-clip", "gspo"])
def test_without_old_logprobs_the_update_trains_as_if_the_pass_had_made_them(loss: str) -> None:
    """One optimizer step on the policy's own samples: the old log-probs the skipped pass would
    give are these log-probs; the loss, its gradient and the KL to the reference are the same."""
    algorithm = spec(policyLoss=loss)
    objective = PolicyObjective(algorithm)
    mask, fields, logprobs = step_fields(3)
    entropies = torch.rand(ROWS, LENGTH)
    made = {k: v for k, v in fields.items() if k != "old_logprobs"}
    given = made | {"old_logprobs": logprobs.detach().clone()}  # what the pass would compute
    skipped, computed = (
        objective(logprobs, entropies, made, mask),
        objective(logprobs, entropies, given, mask),
    )
    torch.testing.assert_close(skipped.loss, computed.loss, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(skipped.loss, logprobs)
    (expected,) = torch.autograd.grad(computed.loss, logprobs)
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)
    assert float(skipped.terms["clip_fraction"]) == 0.0  # a ratio of exactly 1
    kl = masked.masked_mean(alg.kl_estimate(logprobs.detach(), fields["ref_logprobs"], "k3"), mask)
    torch.testing.assert_close(skipped.terms[REFERENCE_KL], kl)
    assert REFERENCE_KL not in computed.terms  # the driver computes it from the pass
