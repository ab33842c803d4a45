"""Agentic RL with its real parts: a tokenizer's chat template (with tools, and the fallback for
one without), the real sandbox server (`python -m rlhf_trainer.sandbox.server`) running the
model's tool calls, and the trainer's path from start-up to a training batch (`load_inputs`,
`Sampler`, `rollout_batch`) on a scripted engine that plays a model's turns as token ids."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from rlhf_local.tiny_models import save_tiny_tokenizer
from rlhf_trainer.data.multiplication import record, write_splits
from rlhf_trainer.environments import ENVIRONMENTS, EPISODE_KEY
from rlhf_trainer.environments.chat import ChatFormat
from rlhf_trainer.environments.episodes import EpisodeRunner, Limits
from rlhf_trainer.environments.loading import EnvironmentRuntime, SandboxRunner
from rlhf_trainer.rollout.base import Completion, SamplingParams
from rlhf_trainer.run.loop import rollout_batch
from rlhf_trainer.run.metrics import TrainerMetrics
from rlhf_trainer.run.sampling import Sampler
from rlhf_trainer.run.startup import NonRetryableError, load_inputs
from rlhf_trainer.sandbox.client import SandboxAuthError, SandboxClient
from rlhf_trainer.sandbox.tools import schemas
from rlhfjob.api import EnvironmentSpec, RLHFJobSpec
from trainer.sandbox_server import Sandbox, running_sandbox

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
QWEN_LIKE_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}{% for tool in tools %}"
    "{{ '\\n' + (tool | tojson) }}{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{% if message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}"
    "{% endif %}{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}"
    "{% endif %}{% else %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Qwen2.5's template in short: tools in the system turn, tool results as <tool_response>
blocks in one user turn."""
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1234 * 56"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny byte-level tokenizer with ChatML's two special tokens and a tools template."""
    from transformers import AutoTokenizer

    directory = save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tokenizer.chat_template = QWEN_LIKE_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


# --------------------------------------------------------------------------------------------
# The real sandbox server


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    with running_sandbox(tmp_path_factory.mktemp("sandbox")) as server:
        yield server


# --------------------------------------------------------------------------------------------
# Messages to tokens


def test_a_template_with_tools_renders_them_and_the_results_after_a_turn(tokenizer: Any) -> None:
    chat = ChatFormat(tokenizer, schemas(["calculator"]))
    assert chat.native_tools and chat.turn_end == f"{IM_END}\n"
    prompt = tokenizer.decode(chat.prompt([{"role": "user", "content": "What is 2 * 3?"}]))
    assert prompt.startswith(f"{IM_START}system\n# Tools\n<tools>\n") and '"calculator"' in prompt
    assert prompt.endswith(f"{IM_START}user\nWhat is 2 * 3?{IM_END}\n{IM_START}assistant\n")
    end = tokenizer.convert_tokens_to_ids(IM_END)
    results = [{"role": "tool", "content": "6"}, {"role": "tool", "content": "7"}]
    after = tokenizer.decode(chat.continuation(results, stop_token=end))
    assert after == (
        f"\n{IM_START}user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n7\n"
        f"</tool_response>{IM_END}\n{IM_START}assistant\n"
    )
    # A turn cut at a stop string has not ended with the template's end: it is added.
    cut = tokenizer.decode(chat.continuation(results[:1], stop_token=None))
    assert cut.startswith(f"{IM_END}\n{IM_START}user\n<tool_response>\n6")


def test_a_template_without_tools_gets_them_in_the_system_message(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path))  # no tools, no end
    chat = ChatFormat(plain, schemas(["calculator"]))
    assert not chat.native_tools and chat.turn_end == ""
    prompt = plain.decode(chat.prompt([{"role": "user", "content": "hi"}]))
    assert prompt.startswith("<|system|># Tools\n\nYou may call one or more functions")
    assert '"name": "calculator"' in prompt and prompt.endswith("<|user|>hi<|assistant|>")
    brief = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}]
    assert plain.decode(chat.prompt(brief)).startswith("<|system|>Be brief.\n\n# Tools")
    after = chat.continuation([{"role": "tool", "content": "42"}], stop_token=None)
    assert plain.decode(after) == "<|tool|>42<|assistant|>"


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer: Any) -> None:
    class Forgetful:
        chat_template = "no tools"

        def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> str:
            return "|".join(m["content"] for m in messages[-2:])  # only the last two

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(map(chr, ids))

    chat = ChatFormat(Forgetful(), [])
    with pytest.raises(ValueError, match="renders earlier messages differently"):
        chat.continuation([{"role": "tool", "content": "1"}], None)


# --------------------------------------------------------------------------------------------
# Tool calls through the sandbox


class ModelTurns:
    """`generate` playing a model: each trajectory's turns as texts, ended with <|im_end|>."""

    def __init__(self, tokenizer: Any, turns: list[str], prompt_length: int) -> None:
        self.tokenizer = tokenizer
        self.turns = turns
        self.prompt_length = prompt_length
        self.start = tokenizer.convert_tokens_to_ids(IM_START)
        self.end = tokenizer.convert_tokens_to_ids(IM_END)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[list[Completion]]:
        out = []
        for prompt in prompts:
            turn = prompt[self.prompt_length :].count(self.start) // 2  # two an answer
            ids = self.tokenizer.encode(self.turns[turn], add_special_tokens=False)
            out.append([Completion([*ids, self.end], [], 0)])
        return out


def runtime(
    tokenizer: Any, sandbox: Sandbox, spec: EnvironmentSpec, token: str = ""
) -> EnvironmentRuntime:
    """The environment as start-up builds it, over the test's sandbox."""
    tools = schemas(spec.tools)
    runner = SandboxRunner(SandboxClient([sandbox.url], token or sandbox.token, timeout_s=20))
    return EnvironmentRuntime(
        spec, ENVIRONMENTS[spec.name], tools, runner, ChatFormat(tokenizer, tools)
    )


NAMED = {"urls": ["http://sandbox.invalid:8470"]}
"""A spec's sandbox (the tests' runtime uses the test's server)."""
CALCULATOR = EnvironmentSpec.model_validate(
    {"name": "multiplication", "tools": ["calculator"], "maxTurns": 3, "sandbox": NAMED}
)


def test_a_calculator_call_runs_in_the_sandbox_and_only_the_models_tokens_train(
    tokenizer: Any, sandbox: Sandbox
) -> None:
    env = runtime(tokenizer, sandbox, CALCULATOR)
    item = env.item(record(1234, 56), "record 1")
    model = ModelTurns(
        tokenizer, [f"Let me compute.\n{CALL}", "The answer is 69104."], len(item.prompt)
    )
    episodes = EpisodeRunner(env.new, env.chat, Limits(3, 256), (model.end,))
    rollout = episodes.run(model.generate, [item], SamplingParams(seed=1))
    [episode] = [r[EPISODE_KEY] for r in rollout.metadata]
    assert (episode["reward"], episode["stop"], episode["turns"]) == (1.0, "done", 2)
    assert episode["tool_outcomes"] == {"calculator/ok": 1} and episode["tool_sandbox_seconds"] > 0
    [response], [mask] = rollout.responses, rollout.action_masks
    environment = [t for t, m in zip(response, mask, strict=True) if m == 0]
    model_tokens = [t for t, m in zip(response, mask, strict=True) if m == 1]
    assert tokenizer.decode(environment) == (
        f"\n{IM_START}user\n<tool_response>\n69104\n</tool_response>{IM_END}\n{IM_START}assistant\n"
    )
    turns = f"Let me compute.\n{CALL}{IM_END}The answer is 69104.{IM_END}"
    assert tokenizer.decode(model_tokens) == turns
    # The environment's tokens sit between the turns, one block, and are never trained on.
    first, answer = mask.index(0), len(environment)
    assert mask == [1] * first + [0] * answer + [1] * (len(mask) - first - answer)


def test_errors_timeouts_and_malformed_calls_are_answered_and_counted(
    tokenizer: Any, sandbox: Sandbox
) -> None:
    spec = EnvironmentSpec.model_validate(
        {"name": "tool-calling", "tools": ["python", "calculator"], "toolTimeoutSeconds": 1.0,
         "maxTurns": 2, "sandbox": NAMED}
    )  # fmt: skip
    env = runtime(tokenizer, sandbox, spec)
    item = env.item({"prompt": "Work it out."}, "record 1")
    calls = (
        '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "open(1)"}}</tool_call>'
        "<tool_call>not json</tool_call>"
        '<tool_call>{"name": "shell", "arguments": {}}</tool_call>'
    )
    model = ModelTurns(tokenizer, [calls, "Done."], len(item.prompt))
    episodes = EpisodeRunner(env.new, env.chat, Limits(2, 4000), (model.end,))
    started = time.monotonic()
    rollout = episodes.run(model.generate, [item], SamplingParams(seed=1))
    assert time.monotonic() - started < 15  # the loop was stopped at its 1 s
    episode = rollout.metadata[0][EPISODE_KEY]
    assert episode["tool_outcomes"] == {
        "python/timeout": 1, "calculator/error": 1, "shell/error": 1,
    }  # fmt: skip
    assert (episode["tool_calls"], episode["tool_errors"], episode["tool_timeouts"]) == (3, 2, 1)
    assert episode["info"] == {"malformed_calls": 1} and episode["stop"] == "done"
    answer = tokenizer.decode(rollout.responses[0])
    assert "Error (timeout)" in answer and "not JSON" in answer and "unknown tool 'shell'" in answer


def test_a_wrong_token_fails_the_rollout(tokenizer: Any, sandbox: Sandbox) -> None:
    env = runtime(tokenizer, sandbox, CALCULATOR, token="not-the-token")
    item = env.item(record(1234, 56), "record 1")
    model = ModelTurns(tokenizer, [CALL, "69104"], len(item.prompt))
    episodes = EpisodeRunner(env.new, env.chat, Limits(3, 256), (model.end,))
    with pytest.raises(SandboxAuthError):
        episodes.run(model.generate, [item], SamplingParams(seed=1))


# --------------------------------------------------------------------------------------------
# The trainer's path: start-up, the sampler, the training batch


def job_spec(tmp_path: Path, tokenizer_dir: Path, sandbox: Sandbox) -> RLHFJobSpec:
    train, test = write_splits(tmp_path / "data", train=6, test=4, seed=0)
    return RLHFJobSpec.model_validate(
        {
            "image": "example.com/trainer:1",
            "model": {
                "tokenizer": str(tokenizer_dir),
                "randomInit": {"model_type": "qwen2", "vocab_size": 320},
            },
            "dataset": {"source": str(train)},
            "reward": {"function": "rlhf_trainer.environments:environment_reward"},
            "algorithm": {"name": "grpo", "groupSize": 2, "promptsPerStep": 2, "totalSteps": 2,
                          "maxPromptLength": 512, "maxResponseLength": 64, "stopTokenIds": [296]},
            "environment": {"name": "multiplication", "tools": ["calculator"],
                            "maxTrajectoryTokens": 256, "sandbox": {"urls": [sandbox.url]}},
            "evaluation": {"source": str(test), "intervalSteps": 1},
            "roles": {"trainer": {}, "rollout": {"backend": "hf"}},
        }
    )  # fmt: skip


def test_a_job_with_an_environment_samples_scores_and_masks_its_batch(
    tmp_path: Path, tokenizer_dir: Path, tokenizer: Any, sandbox: Sandbox, monkeypatch: Any
) -> None:
    spec = job_spec(tmp_path, tokenizer_dir, sandbox)
    assert tokenizer.convert_tokens_to_ids(IM_END) == 296
    monkeypatch.delenv("RLHF_SANDBOX_TOKEN", raising=False)
    with pytest.raises(NonRetryableError, match=r"tokenEnv: .* has no RLHF_SANDBOX_TOKEN"):
        load_inputs(spec, check_model=False)
    monkeypatch.setenv("RLHF_SANDBOX_TOKEN", sandbox.token)
    inputs = load_inputs(spec, check_model=False)
    assert inputs.episodes is not None and len(inputs.prompts) == 6 and len(inputs.held_out) == 4
    first = inputs.prompts[0]
    assert first.metadata["prompt"][0]["content"].startswith("What is ")  # the whole record
    assert '"calculator"' in tokenizer.decode(first.prompt)

    class Engines:
        """Answers right after one calculator call, or wrong without one (by trajectory)."""

        def __init__(self) -> None:
            self.calls = 0

        def generate(
            self, prompts: list[list[int]], sampling: SamplingParams
        ) -> list[list[Completion]]:
            self.calls += 1
            out = []
            for prompt in prompts:
                text = tokenizer.decode(prompt)
                question = text[text.rindex("What is ") + 8 :].split("?")[0]
                call = {"name": "calculator", "arguments": {"expression": question}}
                if "<tool_response>" in text:
                    answer = text.split("<tool_response>\n")[-1].split("\n")[0]
                elif sampling.prompt_seeds[len(out)] % 2:  # by the trajectory's seed
                    answer = f"<tool_call>{json.dumps(call)}</tool_call>"
                else:
                    answer = "7"
                out.append([Completion([*tokenizer.encode(answer), 296], [], 0)])
            return out

    engines = Engines()

    def phase(name: str) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    sampler = Sampler(spec, inputs, engines, TrainerMetrics(), phase)
    sampled = sampler.sample(step=1)
    episodes = [r[EPISODE_KEY] for r in sampled.rollout.metadata]
    calls = [e["tool_calls"] for e in episodes]
    assert sampled.rewards.tolist() == [float(n == 1) for n in calls] and 0 < sum(calls) < 4
    assert sampled.report["env_tool_calls"] == sampled.report["env_sandbox_calls"] == sum(calls)
    assert sampled.report["env_turns_max"] == 2 and "env_sandbox_latency_p50" in sampled.report
    batch = rollout_batch(sampled)
    for row, response in enumerate(sampled.rollout.responses):
        start = len(sampled.rollout.prompts[row]) - 1
        trained = batch.action_mask[row, start : start + len(response)].tolist()
        assert trained == [float(m) for m in sampled.rollout.action_masks[row]]
        assert batch.action_mask[row].sum() == sum(sampled.rollout.action_masks[row])
