"""The agentic CPU example end to end: `rlhfjob train` on examples/agentic-tiny-cpu.yaml, its
tool calls run by a real sandbox server, on a local Ray (one ZeRO-3 rank, two HF engines).

A random model makes no tool call of its own, so the test swaps the example's environment for
one named `module:function` (a file beside the job, the way a researcher adds one) that calls
the calculator on the model's first turn whatever it says, and rewards the even token ids of
its second; turns end at their length (no stop token) so each reaches the environment. Every
trajectory then takes two turns and one tool call through the sandbox, and the step log says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch")
pytest.importorskip("ray")
pytest.importorskip("deepspeed")

from rlhf_trainer.data.multiplication import write_splits
from rlhf_trainer.modeling.pretrained import smollm2
from rlhf_trainer.run.curves import read_step_log
from trainer.sandbox_server import running_sandbox

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ENVIRONMENT = '''
from rlhf_trainer.environments.base import EnvStep
from rlhfjob.contract.sandbox import ToolCall


class Calculating:
    """Calls the calculator for the record's question on the first turn; rewards even ids."""

    def __init__(self, context):
        self.tools = context.tools

    def reset(self, record):
        self.question = record["prompt"][0]["content"].split("What is ")[1].split("?")[0]
        return record["prompt"]

    def step(self, turn):
        if turn.index == 0:
            call = ToolCall(tool="calculator", arguments={"expression": self.question})
            [result] = self.tools.run([call])
            assert result.ok, result
            return EnvStep([{"role": "tool", "content": result.output}])
        even = sum(token % 2 == 0 for token in turn.token_ids)
        return EnvStep(None, reward=even / len(turn.token_ids))
'''


def test_the_agentic_example_trains_with_tool_calls_in_the_sandbox(tmp_path: Path) -> None:
    document = yaml.safe_load((REPO / "examples" / "agentic-tiny-cpu.yaml").read_text())
    spec = document["spec"]
    train, test = write_splits(tmp_path / "data", train=64, test=16, seed=0)
    (tmp_path / "agentic_script.py").write_text(ENVIRONMENT)
    with running_sandbox(tmp_path / "sandbox") as sandbox:
        spec["model"]["tokenizer"] = str(smollm2())
        spec["dataset"]["source"] = str(train)
        spec["evaluation"]["source"] = str(test)
        spec["environment"]["sandbox"]["urls"] = [sandbox.url]
        spec["environment"]["name"] = "agentic_script:Calculating"
        spec["algorithm"]["stopAtEos"] = False
        spec["checkpoint"]["path"] = str(tmp_path / "checkpoints")
        job = tmp_path / "agentic.yaml"
        job.write_text(yaml.safe_dump(document))
        env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
        env["RLHF_SANDBOX_TOKEN"] = sandbox.token
        result = subprocess.run(
            [sys.executable, "-m", "rlhfjob_cli", "train", "--config", str(job)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            cwd=tmp_path,
        )
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        calls = sandbox.log.read_text().count("tool=calculator outcome=ok")
    run_dir = tmp_path / "checkpoints" / "default" / "agentic-tiny"
    records = read_step_log(run_dir / "metrics.jsonl")
    rows = spec["algorithm"]["promptsPerStep"] * spec["algorithm"]["groupSize"]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["env_turns_mean"] == record["env_turns_max"] == 2, record
        assert record["env_tool_calls"] == record["env_sandbox_calls"] == rows
        assert record["env_tool_errors"] == record["env_truncated"] == 0
        assert 0 < record["reward_mean"] < 1 and record["env_sandbox_latency_p50"] > 0
        assert record["generated_tokens"] == rows * 2 * spec["algorithm"]["maxResponseLength"]
    evaluations = read_step_log(run_dir / "metrics.jsonl", "evaluation")
    assert [(e["step"], e["prompts"]) for e in evaluations] == [(0, 8), (3, 8)]
    # every training and held-out trajectory called the calculator once, in the sandbox
    assert calls == 3 * rows + 2 * 8
