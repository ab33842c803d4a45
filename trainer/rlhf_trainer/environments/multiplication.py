"""`multiplication`: products of larger numbers than a small model computes in its head, with
a calculator in the sandbox. Rewarded 1 for the exact product in the answer, else 0.

The records: `rlhf_trainer.data.multiplication` (a 3-4 digit number times a 2-3 digit one). The
environment is `tool-calling` whose answer (the first turn without a tool call) is scored with
`rewards.text.exact_answer` against the record's ``answer``.
"""

from __future__ import annotations

from rlhf_trainer.environments.base import ENVIRONMENTS, EnvStep, Turn
from rlhf_trainer.environments.tool_calling import ToolCallingEnvironment
from rlhf_trainer.rewards.text import exact_answer


@ENVIRONMENTS.register("multiplication")
class MultiplicationEnvironment(ToolCallingEnvironment):
    """`tool-calling`, rewarded for the exact product in the answer."""

    def answer(self, turn: Turn) -> EnvStep:
        reward = exact_answer([turn.text], [self.record])[0]
        return EnvStep(None, reward=reward)
