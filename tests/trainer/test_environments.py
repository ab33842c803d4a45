"""Agentic RL without a model or a sandbox (`rlhf_trainer.environments`): tool calls in the
model's format, the scheduler's order of engine calls, masks, limits and seeds, with scripted
engines and environments; then the same scheduler on a tiny random HF engine for determinism.
The sandbox and a real tokenizer: `test_environment_tools.py`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch

from rlhf_trainer.algo.batch import build_batch
from rlhf_trainer.algo.experience import Rollout, last_model_run, load_sampled, save_sampled
from rlhf_trainer.data.prompts import PromptItem
from rlhf_trainer.environments import (
    ENVIRONMENTS,
    EPISODE_KEY,
    environment_reward,
    tool_use_reward,
)
from rlhf_trainer.environments.base import (
    EnvironmentContext,
    EnvStep,
    NoTools,
    ToolBox,
    Turn,
    record_messages,
)
from rlhf_trainer.environments.episodes import EpisodeRunner, Limits, figures
from rlhf_trainer.environments.loading import environment_factory, sandbox_runner
from rlhf_trainer.environments.toolcalls import parse_tool_calls, result_text
from rlhf_trainer.rollout.base import Completion, SamplingParams
from rlhf_trainer.run.metrics import TrainerMetrics
from rlhf_trainer.run.sampling import score_rollout
from rlhfjob.api import BUILTIN_ENVIRONMENTS, EnvironmentSpec
from rlhfjob.contract.sandbox import ToolCall, ToolResult

STOP = 99
"""The scripted engines' end of turn."""
ENV_TOKENS = [50, 51]
"""What the scripted format renders any environment answer as."""


# --------------------------------------------------------------------------------------------
# Tool calls in the model's format


def test_a_turn_without_a_tool_call_has_none() -> None:
    assert parse_tool_calls("The answer is 42.") == []


def test_one_call_with_its_arguments() -> None:
    call = '{"name": "calculator", "arguments": {"expression": "6*7"}}'
    text = f"Let me compute.\n<tool_call>\n{call}\n</tool_call>"
    [call] = parse_tool_calls(text)
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "6*7"}, None)
    assert call.to_call("0-0") == ToolCall(
        tool="calculator", arguments={"expression": "6*7"}, call_id="0-0"
    )


def test_several_calls_in_order_arguments_as_a_string_or_parameters() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call> and '
        '<tool_call>{"name": "b", "parameters": {"y": 2}}</tool_call>'
        '<tool_call>{"name": "c"}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("a", {"x": 1}, None),
        ("b", {"y": 2}, None),
        ("c", {}, None),
    ]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("<tool_call>{calculator: 6*7}</tool_call>", "not JSON"),
        ('<tool_call>["calculator"]</tool_call>', '{"name": ..., "arguments": {...}}'),
        ('<tool_call>{"name": ""}</tool_call>', '{"name": ..., "arguments": {...}}'),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "a", "arguments": "{oops"}</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "a", "arguments": {}}', "not closed"),
    ],
)
def test_a_malformed_call_is_a_call_with_its_problem(text: str, problem: str) -> None:
    [call] = parse_tool_calls(text)
    assert call.error is not None and problem in call.error


def test_a_good_call_then_an_open_one_is_two_calls() -> None:
    text = '<tool_call>{"name": "a"}</tool_call> <tool_call>{"name": "b", "argu'
    calls = parse_tool_calls(text)
    assert [c.error is None for c in calls] == [True, False]


def test_results_read_as_output_or_as_the_failure() -> None:
    assert result_text(ToolResult(outcome="ok", output="42")) == "42"
    failed = ToolResult(outcome="timeout", error="wall time", output="partial")
    assert result_text(failed) == "Error (timeout): wall time\npartial"


# --------------------------------------------------------------------------------------------
# The tool box: what reaches the runner


class Recorder:
    """A `ToolRunner` that answers every call with its arguments, and remembers them."""

    def __init__(self, outcome: str = "ok") -> None:
        self.outcome = outcome
        self.calls: list[ToolCall] = []

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        self.calls += calls
        return [
            ToolResult.model_validate(
                {"call_id": c.call_id, "outcome": self.outcome, "output": "x", "seconds": 0.5}
            )
            for c in calls
        ]


def test_the_tool_box_sends_allowed_calls_under_the_time_limit_and_counts_them() -> None:
    runner = Recorder()
    box = ToolBox(runner, ["calculator"], timeout_s=3.0, max_calls=2)
    results = box.run(
        [
            ToolCall(tool="calculator", arguments={"expression": "1"}),
            ToolCall(tool="shell", arguments={"cmd": "rm -rf /"}),
            ToolCall(tool="calculator", arguments={"expression": "3"}),
        ]
    )
    assert [r.outcome for r in results] == ["ok", "error", "error"]
    assert "unknown tool 'shell'" in results[1].error
    assert "at most 2 tool calls" in results[2].error
    assert [(c.tool, c.timeout_s, c.call_id) for c in runner.calls] == [("calculator", 3.0, "0")]
    stats = box.stats
    assert (stats.calls, stats.errors, stats.timeouts, stats.sandbox_seconds) == (3, 2, 0, 0.5)
    assert len(stats.latencies) == 1


def test_without_tools_every_call_is_an_error() -> None:
    [result] = NoTools().run([ToolCall(tool="python", call_id="x")])
    assert (result.outcome, result.call_id) == ("error", "x")


# --------------------------------------------------------------------------------------------
# The scheduler on a scripted engine


class Scripted:
    """An environment that plays what its record says: `turns` turns (tool results in
    between, after waiting on `gate` when it has one), then a reward of 1."""

    gates: dict[str, threading.Event] = {}

    def __init__(self, context: EnvironmentContext | None = None) -> None:
        self.record: dict[str, Any] = {}

    def reset(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        self.record = record
        return [{"role": "user", "content": "go"}]

    def step(self, turn: Turn) -> EnvStep:
        if turn.index + 1 >= self.record.get("turns", 1):
            return EnvStep(None, reward=1.0, info={"last": turn.text})
        gate = self.gates.get(self.record.get("gate", ""))
        if gate is not None:
            assert gate.wait(timeout=30), "the gate never opened"
        return EnvStep([{"role": "tool", "content": "r"}], info={"answered": 1})


class TokenFormat:
    """Environment answers as `ENV_TOKENS`; text is the tokens' numbers."""

    def continuation(self, messages: list[dict[str, Any]], stop_token: int | None) -> list[int]:
        return list(ENV_TOKENS)

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(map(str, token_ids))


class ScriptedEngine:
    """`generate` as the fleet's: each prompt's turn is `[trajectory id, turn, STOP]` (the id is
    the prompt's first token), or what `turn` says; it records every call."""

    def __init__(self, turn: Callable[[list[int], SamplingParams], list[int]] | None = None):
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.turn = turn
        self.on_call: Callable[[list[int]], None] = lambda ids: None

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        ids = [prompt[0] for prompt in prompts]
        self.calls.append((ids, sampling))
        self.on_call(ids)
        out = []
        for prompt in prompts:
            done = prompt[1:].count(STOP)
            tokens = self.turn(prompt, sampling) if self.turn else [prompt[0], done, STOP]
            out.append([Completion(tokens[: sampling.max_tokens], [], policy_version=7)])
        return out


ROOMY = Limits(max_turns=4, max_trajectory_tokens=64)


def runner(limits: Limits = ROOMY, stop: tuple[int, ...] = (STOP,)) -> EpisodeRunner:
    def make() -> tuple[Scripted, ToolBox]:
        return Scripted(), ToolBox(NoTools(), [], 1.0, 4)

    return EpisodeRunner(make, TokenFormat(), limits, stop_token_ids=stop)


def items(*records: dict[str, Any]) -> list[PromptItem]:
    return [PromptItem([i, 0], record) for i, record in enumerate(records)]


SAMPLING = SamplingParams(n=1, max_tokens=8, seed=123, logprobs=False)


def test_a_trajectory_waiting_on_its_tools_does_not_hold_back_the_others() -> None:
    """Trajectory 0's tool answers only once trajectory 1 is on its third turn: 1 goes through
    its turns meanwhile, and 0's next turn is an engine call of its own."""
    Scripted.gates["slow"] = gate = threading.Event()
    engine = ScriptedEngine()
    engine.on_call = lambda ids: gate.set() if ids == [1] and len(engine.calls) == 3 else None
    episodes = runner()
    rollout = episodes.run(
        engine.generate,
        items({"turns": 2, "gate": "slow"}, {"turns": 3}, {"turns": 1}),
        SAMPLING,
    )
    assert [ids for ids, _ in engine.calls] == [[0, 1, 2], [1], [1], [0]]
    assert episodes.calls == [[0, 1, 2], [1], [1], [0]]
    assert [e[EPISODE_KEY]["turns"] for e in rollout.metadata] == [2, 3, 1]
    assert [e[EPISODE_KEY]["stop"] for e in rollout.metadata] == ["done"] * 3


def test_each_turn_is_seeded_by_its_trajectory_and_turn_not_by_its_call() -> None:
    engine = ScriptedEngine()
    runner().run(engine.generate, items({"turns": 2}, {"turns": 1}), SAMPLING)
    first, second = (sampling for _, sampling in engine.calls)
    assert (first.n, first.seed) == (1, 123)
    assert len(set(first.prompt_seeds)) == 2 and second.prompt_seeds[0] not in first.prompt_seeds
    again = ScriptedEngine()
    runner().run(again.generate, items({"turns": 2}, {"turns": 1}), SAMPLING)
    assert [s.prompt_seeds for _, s in again.calls] == [s.prompt_seeds for _, s in engine.calls]


def test_a_two_turn_trajectory_trains_only_the_models_tokens() -> None:
    rollout = runner().run(ScriptedEngine().generate, items({"turns": 2}), SAMPLING)
    # turn 1: [0, 0, STOP]; the answer: ENV_TOKENS; turn 2: [0, 1, STOP]
    assert rollout.responses == [[0, 0, STOP, *ENV_TOKENS, 0, 1, STOP]]
    assert rollout.action_masks == [[1, 1, 1, 0, 0, 1, 1, 1]]
    assert rollout.num_generated_tokens == 6
    assert rollout.final_turns() == [[0, 1, STOP]]
    batch = build_batch(rollout.prompts, rollout.responses, rollout.action_masks)
    # prompt [0, 0]: column t scores token t + 1, so the response starts at column 1
    expected = [0.0, 1, 1, 1, 0, 0, 1, 1, 1]
    assert batch.action_mask.tolist() == [expected]
    assert batch.input_ids.tolist() == [[0, 0, 0, 0, STOP, *ENV_TOKENS, 0, 1, STOP]]


def test_the_mask_is_checked_against_its_response() -> None:
    with pytest.raises(ValueError, match="2 mask values, 3 tokens"):
        build_batch([[1]], [[1, 2, 3]], [[1, 0]])


def test_last_model_run_is_the_last_turn_even_after_an_answer() -> None:
    assert last_model_run([1, 2, 3, 4, 5], [1, 1, 0, 0, 0]) == [1, 2]
    assert last_model_run([1, 2, 3], [0, 0, 0]) == []
    assert Rollout([[1]], [[5, 6]], [{}], [0]).final_turns() == [[5, 6]]


def test_the_environments_reward_summary_and_info_are_in_the_record() -> None:
    rollout = runner().run(ScriptedEngine().generate, items({"turns": 2, "answer": "9"}), SAMPLING)
    [record] = rollout.metadata
    episode = record[EPISODE_KEY]
    assert record["answer"] == "9" and episode["reward"] == 1.0
    assert episode["info"] == {"answered": 1, "last": "0 1 99"}
    assert rollout.policy_versions == [7]
    assert environment_reward(rollout.prompts, rollout.responses, rollout.metadata) == [1.0]
    assert environment_reward([[1]], [[2]], [{}]) == [0.0]


def test_the_tool_use_reward_pays_for_calls_that_ran_and_half_for_tries() -> None:
    def episode(**fields: Any) -> dict[str, Any]:
        return {EPISODE_KEY: {"tool_calls": 0, "tool_outcomes": {}, "info": {}} | fields}

    metadata = [
        episode(tool_calls=2, tool_outcomes={"calculator/ok": 1, "calculator/error": 1}),
        episode(tool_calls=1, tool_outcomes={"calculator/timeout": 1}),
        episode(info={"malformed_calls": 1}),
        episode(),
        {},
    ]
    assert tool_use_reward([[1]] * 5, [[2]] * 5, metadata) == [1.0, 0.5, 0.5, 0.0, 0.0]


def test_limits_truncate_at_turns_tokens_and_turn_length() -> None:
    endless = {"turns": 100}
    by_turns = runner(Limits(max_turns=3, max_trajectory_tokens=64))
    turns = by_turns.run(ScriptedEngine().generate, items(endless), SAMPLING)
    episode = turns.metadata[0][EPISODE_KEY]
    assert (episode["stop"], episode["truncated"], episode["turns"]) == ("turns", True, 3)

    by_tokens = runner(Limits(max_turns=10, max_trajectory_tokens=12))
    engine = ScriptedEngine()
    rollout = by_tokens.run(engine.generate, items(endless), SAMPLING)
    # each call asks for at most the tokens left: turns of 3 and answers of 2 leave 7, then 2
    assert [s.max_tokens for _, s in engine.calls] == [8, 7, 2]
    assert rollout.metadata[0][EPISODE_KEY]["stop"] == "tokens"
    assert len(rollout.responses[0]) == 12 and rollout.action_masks[0][-2:] == [1, 1]

    rambling = ScriptedEngine(turn=lambda prompt, sampling: [7] * 20)  # never ends its turn
    cut = runner().run(rambling.generate, items(endless), SAMPLING)
    assert cut.metadata[0][EPISODE_KEY]["stop"] == "turn_length"
    assert cut.responses == [[7] * 8]


def test_no_room_for_another_turn_truncates_before_the_answer_is_added() -> None:
    tight = runner(Limits(max_turns=10, max_trajectory_tokens=5))
    rollout = tight.run(ScriptedEngine().generate, items({"turns": 5}), SAMPLING)
    assert rollout.responses == [[0, 0, STOP]]  # 3 + 2 would leave none for the model
    assert rollout.metadata[0][EPISODE_KEY]["stop"] == "tokens"


def test_a_truncated_trajectory_gets_the_specs_reward_if_set() -> None:
    rollout = runner(Limits(2, 64)).run(
        ScriptedEngine().generate, items({"turns": 1}, {"turns": 9}), SAMPLING
    )

    def everyone_one(prompts: Any, responses: Any, metadata: Any) -> list[float]:
        assert responses == rollout.final_turns()  # the reward reads the last turn
        return [1.0] * len(responses)

    plain = EnvironmentSpec(name="tool-calling")
    assert score_rollout(everyone_one, rollout, plain) == [1.0, 1.0]
    strict = EnvironmentSpec(name="tool-calling", truncatedReward=-1.0)
    assert score_rollout(everyone_one, rollout, strict) == [1.0, -1.0]


def test_groups_keep_their_samples_together() -> None:
    engine = ScriptedEngine(turn=lambda prompt, sampling: [prompt[0], STOP])
    rollout = runner().run(
        engine.generate, items({"turns": 1}, {"turns": 1}), SamplingParams(n=3, seed=1)
    )
    assert [response[0] for response in rollout.responses] == [0, 0, 0, 1, 1, 1]
    [(ids, sampling)] = engine.calls
    assert len(ids) == 6 and sampling.n == 1 and len(set(sampling.prompt_seeds)) == 6


def test_an_environment_that_raises_fails_the_rollout() -> None:
    class Broken(Scripted):
        def step(self, turn: Turn) -> EnvStep:
            raise RuntimeError("environment bug")

    episodes = EpisodeRunner(
        lambda: (Broken(), ToolBox(NoTools(), [], 1.0, 1)), TokenFormat(), Limits(2, 64), (STOP,)
    )
    with pytest.raises(RuntimeError, match="environment bug"):
        episodes.run(ScriptedEngine().generate, items({}), SAMPLING)


def test_figures_and_metrics_of_a_batch() -> None:
    rollout = runner(Limits(2, 64)).run(
        ScriptedEngine().generate, items({"turns": 1}, {"turns": 9}), SAMPLING
    )
    rollout.metadata[0][EPISODE_KEY] |= {
        "tool_calls": 3, "tool_errors": 1, "tool_timeouts": 1, "tool_sandbox_seconds": 1.5,
        "tool_outcomes": {"python/ok": 1, "python/error": 1, "python/timeout": 1},
        "tool_round_trips": [0.2, 0.4],
    }  # fmt: skip
    found = figures(rollout.metadata)
    assert found["env_turns_mean"] == 1.5 and found["env_turns_max"] == 2
    assert [found[f"env_tool_{name}"] for name in ("calls", "errors", "timeouts")] == [3, 1, 1]
    assert found["env_truncated"] == found["env_truncated_turns"] == 1
    assert found["env_tool_round_trip_seconds_mean"] == pytest.approx(0.3)
    assert found["env_tool_sandbox_seconds_mean"] == 0.5
    assert figures([{}]) == {}

    metrics = TrainerMetrics()
    metrics.record_episodes([r[EPISODE_KEY] for r in rollout.metadata])
    sample = metrics.registry.get_sample_value
    assert sample("rlhf_trainer_environment_turns_total") == 3
    assert sample("rlhf_trainer_environment_trajectories_total", {"stop": "turns"}) == 1
    assert sample("rlhf_trainer_tool_calls_total", {"tool": "python", "outcome": "timeout"}) == 1
    assert sample("rlhf_trainer_tool_round_trip_seconds_count") == 2


def test_a_sampled_batch_keeps_its_masks_through_a_checkpoint(tmp_path: Path) -> None:
    from rlhf_trainer.algo.experience import SampledStep

    rollout = runner().run(ScriptedEngine().generate, items({"turns": 2}), SAMPLING)
    sampled = SampledStep(rollout, torch.ones(1), torch.ones(1), {}, {"env_turns_mean": 2.0})
    save_sampled(sampled, tmp_path / "next.pt")
    again = load_sampled(tmp_path / "next.pt")
    assert again.rollout == rollout and again.report == sampled.report


# --------------------------------------------------------------------------------------------
# Names, start-up


def test_every_environment_the_api_names_is_registered_and_no_other() -> None:
    assert set(ENVIRONMENTS) == set(BUILTIN_ENVIRONMENTS)


def test_an_environment_named_by_module_and_function_is_imported() -> None:
    assert environment_factory(f"{__name__}:Scripted") is Scripted
    with pytest.raises(ValueError, match=r"spec\.environment\.name: cannot load"):
        environment_factory(f"{__name__}:Missing")
    with pytest.raises(ValueError, match=r"spec\.environment\.name: 'chess' is not known"):
        environment_factory("chess")


def test_a_sandbox_without_its_token_fails_naming_the_field() -> None:
    spec = EnvironmentSpec.model_validate(
        {"name": "tool-calling", "tools": ["python"], "sandbox": {"urls": ["http://s:8470"]}}
    )
    with pytest.raises(ValueError, match=r"sandbox\.tokenEnv: .* has no RLHF_SANDBOX_TOKEN"):
        sandbox_runner(spec, environ={})
    assert isinstance(sandbox_runner(EnvironmentSpec(name="tool-calling"), environ={}), NoTools)


def test_a_record_starts_from_its_messages_or_its_text() -> None:
    chat = [{"role": "user", "content": "hi"}]
    assert record_messages({"prompt": chat}, "prompt") == chat
    assert record_messages({"q": "hi"}, "q") == chat
    with pytest.raises(ValueError, match="neither chat messages nor text"):
        record_messages({"prompt": [1, 2]}, "prompt")


# --------------------------------------------------------------------------------------------
# A real engine: the same seeds, the same trajectories


@pytest.fixture(scope="module")
def engine() -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf_trainer.rollout.engines import HFEngine

    torch.manual_seed(0)
    config = Qwen2Config(  # type: ignore[call-arg]
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip
    return HFEngine(Qwen2ForCausalLM(config), num_threads=1)


def test_the_same_seeds_give_the_same_trajectories_whatever_shares_a_call(engine: Any) -> None:
    many = items({"turns": 3}, {"turns": 2}, {"turns": 3}, {"turns": 1})
    sampling = SamplingParams(n=2, max_tokens=6, seed=5, temperature=1.0, logprobs=False)
    first = runner(Limits(3, 40), stop=()).run(engine.generate, many, sampling)
    again = runner(Limits(3, 40), stop=()).run(engine.generate, many, sampling)
    assert first.responses == again.responses and first.action_masks == again.action_masks
    assert [r[EPISODE_KEY]["turns"] for r in first.metadata] == [3, 3, 2, 2, 3, 3, 1, 1]
    reseeded = SamplingParams(n=2, max_tokens=6, seed=6, logprobs=False)
    other = runner(Limits(3, 40), stop=()).run(engine.generate, many, reseeded)
    assert other.responses != first.responses
    # A prompt's sample depends on its own seed only, not on the prompts beside it.
    alone = SamplingParams(max_tokens=6, prompt_seeds=(11,), logprobs=False)
    beside = SamplingParams(max_tokens=6, prompt_seeds=(3, 11), logprobs=False)
    [[one]] = engine.generate([[5, 6, 7]], alone)
    [_, [two]] = engine.generate([[1, 2, 3, 4, 9], [5, 6, 7]], beside)
    assert one.token_ids == two.token_ids


def test_engines_split_a_call_with_its_prompt_seeds() -> None:
    sampling = SamplingParams(seed=1, prompt_seeds=(10, 11, 12, 13))
    part = sampling.for_prompts(1, 3, seed=99)
    assert (part.seed, part.prompt_seeds) == (99, (11, 12))
    assert SamplingParams(seed=1).for_prompts(0, 2, seed=4).prompt_seeds == ()


def test_the_progress_line_says_what_the_trajectories_did() -> None:
    from rlhf_trainer.run.steps import progress_line

    record = {"step": 3, "reward_mean": 0.5, "reward_std": 0.1, "step_seconds": 2.0}
    assert "turns" not in progress_line(record, 10)
    record |= {"env_turns_mean": 2.25, "env_tool_calls": 9.0, "env_truncated": 1.0}
    assert "| turns 2.25, tool calls 9, truncated 1 |" in progress_line(record, 10)
