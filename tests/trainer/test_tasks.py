"""Synthetic tasks: deterministic prompts, rewards with a known maximum, and learnability."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainer.algo import formulas as algorithms
from rlhf_trainer.data import tasks
from rlhf_trainer.data.tasks import TARGET_TOKEN, get_task
from rlhf_trainer.modeling import logprobs as lp
from rlhf_trainer.rewards.functions import RuleReward


def test_target_token_reward_is_the_fraction_of_target_tokens() -> None:
    t = TARGET_TOKEN
    responses = [[t, t, t, t], [t, 5, 5, t], [5, 5], []]
    # 4/4, 2/4, 0/2, and 0 for an empty response
    assert tasks.target_token_reward([[2]] * 4, responses, [{}] * 4) == [1.0, 0.5, 0.0, 0.0]


def test_copy_first_token_reward_compares_with_the_prompt() -> None:
    prompts = [[3, 9, 9], [7, 3], [4]]
    responses = [[3, 3, 9, 3], [3, 3], []]
    # 3/4 copies of 3; 0/2 copies of 7; empty response -> 0
    assert tasks.copy_first_token_reward(prompts, responses, [{}] * 3) == [0.75, 0.0, 0.0]


def test_even_token_reward_counts_even_ids_whatever_the_vocabulary() -> None:
    responses = [[2, 4, 151934, 0], [1, 2, 3, 151935], [7], []]
    # 4/4, 1/4, 0/1, and 0 for an empty response
    assert tasks.even_token_reward([[5]] * 4, responses, [{}] * 4) == [1.0, 0.25, 0.0, 0.0]


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_every_task_reward_spec_loads_and_reaches_its_maximum(name: str) -> None:
    task = get_task(name)
    prompts = task.make_prompts(count=5, seed=0)
    perfect = [
        [{"target_token": TARGET_TOKEN, "even_tokens": 2}.get(name, prompt[0])]
        * task.response_length
        for prompt in prompts
    ]
    reward = RuleReward.from_spec(task.reward_function)
    assert reward(prompts, perfect) == [task.max_reward] * 5
    assert reward.function is task.reward


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_prompts_are_deterministic_and_within_the_vocabulary(name: str) -> None:
    task = get_task(name)
    prompts = task.make_prompts(count=200, seed=42)
    assert prompts == task.make_prompts(count=200, seed=42)
    assert prompts != task.make_prompts(count=200, seed=43)
    assert all(len(prompt) == task.prompt_length for prompt in prompts)
    tokens = {token for prompt in prompts for token in prompt}
    assert tasks.PAD_TOKEN not in tokens
    assert tokens <= set(range(1, task.vocab_size))


def test_copy_first_draws_the_first_token_from_a_small_set() -> None:
    task = get_task("copy_first")
    prompts = task.make_prompts(count=200, seed=1)
    assert {prompt[0] for prompt in prompts} == {1, 2, 3, 4}
    assert len({token for prompt in prompts for token in prompt[1:]}) > 4


def test_the_trainer_has_exactly_the_tasks_the_api_admits() -> None:
    from rlhfjob.api import SYNTHETIC_TASKS

    assert sorted(tasks.TASKS) == sorted(SYNTHETIC_TASKS)


def test_unknown_task_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown synthetic task 'nope'; known tasks: copy_first"):
        get_task("nope")


@pytest.mark.slow
def test_a_tiny_causal_lm_learns_target_token_with_grpo() -> None:
    """The task is learnable as designed: GRPO lifts a random 2-layer LM from chance to >= 0.9."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    task = get_task("target_token")
    config = LlamaConfig(
        vocab_size=task.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    num_prompts, samples_per_prompt = 8, 8
    mean_rewards = []
    for step in range(25):
        prompts = torch.tensor(task.make_prompts(num_prompts, seed=step))
        prompts = prompts.repeat_interleave(samples_per_prompt, dim=0)
        with torch.no_grad():
            sequences = prompts
            for _ in range(task.response_length):
                next_logits = model(sequences).logits[:, -1]
                next_tokens = torch.multinomial(torch.softmax(next_logits, -1), 1)
                sequences = torch.cat([sequences, next_tokens], dim=1)
        responses = sequences[:, task.prompt_length :]
        rewards = torch.tensor(task.reward(prompts.tolist(), responses.tolist(), []))
        mean_rewards.append(rewards.mean().item())

        logits = model(sequences).logits[:, task.prompt_length - 1 : -1]
        logprobs = lp.logprobs_from_logits(logits, responses)
        advantages = algorithms.grpo_advantages(rewards, samples_per_prompt)
        result = algorithms.clipped_policy_loss(
            logprobs, logprobs.detach(), advantages, torch.ones_like(logprobs)
        )
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()

    assert mean_rewards[0] < 0.3, mean_rewards
    assert sum(mean_rewards[-3:]) / 3 >= 0.9 * task.max_reward, mean_rewards
