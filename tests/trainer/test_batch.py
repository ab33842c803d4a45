"""Pure pieces between the driver and the ZeRO-3 ranks: batches, shard plans, DeepSpeed config,
learning-rate schedule, advantages and how prompts are spread over engines."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from rlhf_trainer import masked  # noqa: E402
from rlhf_trainer.algo import formulas as alg  # noqa: E402
from rlhf_trainer.algo.batch import PAD_TOKEN_ID, ShardPlan, build_batch  # noqa: E402
from rlhf_trainer.algo.experience import (  # noqa: E402
    flatten_completions,
    grpo_advantages,
    ppo_advantages,
)
from rlhf_trainer.data.prompts import PromptItem  # noqa: E402
from rlhf_trainer.elastic import split_evenly  # noqa: E402
from rlhf_trainer.modeling.zero import deepspeed_config, lr_multiplier  # noqa: E402
from rlhf_trainer.rollout.base import Completion  # noqa: E402
from rlhf_trainer.seeds import step_seed  # noqa: E402
from rlhfjob.api import AlgorithmSpec  # noqa: E402


def algorithm(**fields) -> AlgorithmSpec:
    return AlgorithmSpec.model_validate({"totalSteps": 10, **fields})


def test_a_batch_puts_prompt_then_response_and_masks_the_response_columns():
    batch = build_batch([[5, 6], [7]], [[1, 2, 3], [4]])
    assert batch.input_ids.tolist() == [[5, 6, 1, 2, 3], [7, 4, PAD_TOKEN_ID, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # Column t scores token t + 1: row 0's response tokens 1, 2, 3 sit at columns 1..3.
    assert batch.action_mask.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    assert batch.num_action_tokens == 4


def test_a_batch_rejects_mismatched_rows_and_empty_prompts():
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        build_batch([[1], [2]], [[3]])
    with pytest.raises(ValueError, match="at least one token"):
        build_batch([[]], [[3]])


def test_padding_rows_are_inert():
    batch = build_batch([[5, 6]], [[1, 2]]).with_fields(advantages=torch.tensor([2.0]))
    padded = batch.padded_to(3)
    assert len(padded) == 3
    assert padded.num_action_tokens == batch.num_action_tokens
    assert padded.attention_mask[1:].tolist() == [[1, 0, 0, 0], [1, 0, 0, 0]]
    assert padded.fields["advantages"].tolist() == [2.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        batch.padded_to(0)


@pytest.mark.parametrize(
    ("rows", "world", "micro", "accumulation", "padded"),
    [(64, 2, 16, 2, 64), (6, 2, 2, 2, 8), (1, 2, 4, 1, 8), (64, 1, 16, 4, 64)],
)
def test_a_shard_plan_gives_every_rank_the_same_whole_micro_batches(
    rows, world, micro, accumulation, padded
):
    plan = ShardPlan(rows, world, micro)
    assert plan.accumulation_steps == accumulation
    assert plan.padded_rows == padded
    assert plan.rows_per_rank == accumulation * micro


def test_sharding_then_unsharding_gives_back_the_rows_in_order():
    prompts = [[row + 1] for row in range(6)]
    batch = build_batch(prompts, [[9]] * 6)
    plan = ShardPlan(6, world_size=2, micro_batch_size=2)
    shards = [plan.shard(batch, rank) for rank in range(2)]
    assert [len(shard) for shard in shards] == [4, 4]
    assert plan.unshard([shard.input_ids[:, 0] for shard in shards]).tolist() == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="plan is for 6 rows"):
        plan.shard(batch.rows(0, 5), 0)


def random_batch(rows: int, seed: int = 0):
    """Rows of different prompt and response lengths, with a per-token value to average."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 6, (rows, 2), generator=generator).tolist()
    batch = build_batch([[1] * p for p, _ in lengths], [[2] * r for _, r in lengths])
    return batch.with_fields(value=torch.randn(batch.action_mask.shape, generator=generator))


@pytest.mark.parametrize("rows", [12, 13, 64])
def test_the_global_batch_does_not_depend_on_the_number_of_ranks(rows):
    """Fewer ranks take more micro-batches; every rank count trains the same rows, once."""
    batch = random_batch(rows)
    for world in (1, 2, 3, 4):
        plan = ShardPlan(rows, world, micro_batch_size=4)
        shards = [plan.shard(batch, rank) for rank in range(world)]
        assert {len(list(shard.micro_batches(4))) for shard in shards} == {plan.accumulation_steps}
        assert plan.accumulation_steps == math.ceil(rows / (4 * world))
        together = plan.unshard([shard.input_ids for shard in shards])
        assert torch.equal(together, batch.input_ids), world
        assert sum(shard.num_action_tokens for shard in shards) == batch.num_action_tokens


def deepspeed_gradient_weighting(batch, plan: ShardPlan) -> float:
    """The step's gradient-carrying sum as the ranks build it: each micro-batch backpropagates
    its token-mean value times its tokens times `loss_scale`, DeepSpeed divides that by the
    accumulation steps and averages the ranks' sums (a gradient is linear in the loss, so the
    loss's total stands for it)."""
    scale = plan.loss_scale(batch.num_action_tokens)
    per_rank = []
    for rank in range(plan.world_size):
        total = 0.0
        for micro in plan.shard(batch, rank).micro_batches(plan.micro_batch_size):
            tokens = float(micro.action_mask.sum())
            mean = (
                float(masked.masked_mean(micro.fields["value"], micro.action_mask)) if tokens else 0
            )
            total += mean * tokens * scale / plan.accumulation_steps
        per_rank.append(total)
    return sum(per_rank) / plan.world_size


@pytest.mark.parametrize("rows", [12, 13, 64])
def test_one_rank_of_2k_rows_steps_like_two_ranks_of_k_rows(rows):
    """The loss scaling makes the step the token mean over the whole batch for every rank
    count, padding and uneven micro-batches included: per-token means are weighted by their
    tokens, not averaged per micro-batch or per rank."""
    batch = random_batch(rows, seed=rows)
    whole_mean = float(masked.masked_mean(batch.fields["value"], batch.action_mask))
    for world in (1, 2, 3, 4):
        got = deepspeed_gradient_weighting(batch, ShardPlan(rows, world, micro_batch_size=4))
        assert got == pytest.approx(whole_mean, rel=1e-5), world


def test_the_deepspeed_config_follows_the_algorithm():
    config = deepspeed_config(
        algorithm(microBatchSize=8, maxGradNorm=0.5),
        accumulation_steps=3,
        bf16=False,
        on_gpu=False,
    )
    assert config["train_micro_batch_size_per_gpu"] == 8
    assert config["gradient_accumulation_steps"] == 3
    assert config["gradient_clipping"] == 0.5
    assert config["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 0}
    assert config["bf16"] == {"enabled": False}
    reference = deepspeed_config(
        algorithm(), accumulation_steps=1, bf16=True, on_gpu=True, train=False
    )
    assert "gradient_clipping" not in reference
    assert reference["zero_optimization"] == {"stage": 3}
    assert reference["bf16"] == {"enabled": True}


def test_an_offloaded_optimizer_lives_in_host_memory_and_only_on_gpus():
    offloaded = deepspeed_config(
        algorithm(), accumulation_steps=1, bf16=True, on_gpu=True, stage=2, optimizer_offload=True
    )
    assert offloaded["zero_optimization"] == {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
    }
    reference = deepspeed_config(
        algorithm(), accumulation_steps=1, bf16=True, on_gpu=True, train=False,
        optimizer_offload=True,
    )  # fmt: skip
    assert "offload_optimizer" not in reference["zero_optimization"]  # it has no optimizer
    with pytest.raises(ValueError, match="needs GPUs"):
        deepspeed_config(algorithm(), accumulation_steps=1, bf16=False, on_gpu=False,
                         optimizer_offload=True)  # fmt: skip


def test_learning_rate_schedules_warm_up_then_hold_or_decay():
    warm_constant = lr_multiplier("constant", warmup_steps=3, total_steps=10)
    assert [warm_constant(n) for n in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    linear = lr_multiplier("linear", warmup_steps=0, total_steps=4)
    assert [linear(n) for n in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    cosine = lr_multiplier("cosine", warmup_steps=0, total_steps=4)
    assert cosine(2) == pytest.approx(0.5)
    assert cosine(4) == pytest.approx(0.0, abs=1e-12)
    assert cosine(1) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    with pytest.raises(ValueError):
        lr_multiplier("step", 0, 1)


def test_step_seeds_depend_on_seed_and_step_only():
    assert step_seed(0, 5) == step_seed(0, 5)
    assert len({step_seed(seed, step) for seed in range(3) for step in range(50)}) == 150


def test_completions_flatten_to_contiguous_groups():
    items = [PromptItem([3], {"i": 0}), PromptItem([4], {"i": 1})]
    completions = [
        [Completion([1], [-0.1], 2), Completion([2], [-0.2], 2)],
        [Completion([5, 6], [-0.1, -0.3], 1), Completion([7], [-0.5], 2)],
    ]
    rollout = flatten_completions(items, completions)
    assert rollout.prompts == [[3], [3], [4], [4]]
    assert rollout.responses == [[1], [2], [5, 6], [7]]
    assert [m["i"] for m in rollout.metadata] == [0, 0, 1, 1]
    assert rollout.policy_versions == [2, 2, 1, 2]
    assert rollout.num_generated_tokens == 5


def test_grpo_can_charge_the_kl_in_the_reward():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -1.0], [-1.0, -9.0]])
    ref = torch.tensor([[-1.5, -2.0], [-1.0, 0.0]])
    # k1 summed over each response: 0.5 + 1.0 = 1.5 and 0; penalised rewards 0.85 and 0.
    spec = algorithm(groupSize=2, klCoef=0.1, klMode="reward", klEstimator="k1")
    got = grpo_advantages(rewards, spec, logprobs=logprobs, ref_logprobs=ref, mask=mask)
    expected = alg.grpo_advantages(torch.tensor([0.85, 0.0]), 2)
    torch.testing.assert_close(got, expected)
    no_kl = grpo_advantages(rewards, algorithm(groupSize=2, klMode="loss", klCoef=0.1))
    torch.testing.assert_close(no_kl, alg.grpo_advantages(rewards, 2))


def test_ppo_advantages_are_whitened_gae_and_returns_are_not():
    rewards = torch.tensor([1.0, 0.0, 0.5])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    values = torch.tensor([[0.0, 0.2, 0.4], [0.1, 0.3, 0.0], [0.5, 0.1, 0.2]])
    spec = algorithm(name="ppo", gamma=1.0, gaeLambda=0.9, klCoef=0.0)
    advantages, returns = ppo_advantages(rewards, values, mask, spec)
    token_rewards = alg.kl_shaped_token_rewards(
        rewards, torch.zeros(3, 3), torch.zeros(3, 3), mask, 0.0
    )
    raw, expected_returns = alg.gae_advantages(token_rewards, values, mask, 1.0, 0.9)
    torch.testing.assert_close(returns, expected_returns)
    torch.testing.assert_close(advantages, masked.masked_whiten(raw, mask))
    assert float(masked.masked_mean(advantages, mask)) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(
    ("count", "parts", "expected"),
    [(8, 2, [(0, 4), (4, 8)]), (5, 2, [(0, 3), (3, 5)]), (1, 3, [(0, 1), (1, 1), (1, 1)])],
)
def test_prompts_split_evenly_over_engines(count, parts, expected):
    assert split_evenly(count, parts) == expected
