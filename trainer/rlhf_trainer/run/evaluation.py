"""Held-out evaluation (`spec.evaluation`): does the policy get better on prompts it never
trains on?

The held-out prompts are a file of their own or a seeded split of the training set that the
run then never samples (`rlhf_trainer.data.heldout`). They are generated on the job's own rollout
engines between steps (after the weight sync, so the engines hold the policy just trained; no second
copy of the model), scored by the job's reward: greedy responses give `score` (the mean reward) and
`accuracy` (the fraction that passes `passThreshold`); `samples` responses per prompt at
`temperature` give pass@k and mean@k. Every figure is also split by the records'
`dataSourceField`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlhf_trainer.algo.experience import Rollout
from rlhf_trainer.data.prompts import PromptItem
from rlhf_trainer.rollout.base import SamplingParams
from rlhf_trainer.run import metrics as m
from rlhf_trainer.run.sampling import Phase, Sampler, score_rollout
from rlhf_trainer.seeds import mix
from rlhfjob.api import EvaluationSpec

DEFAULT_SOURCE = "default"
"""The data source of records without the `dataSourceField`."""


def is_due(evaluation: EvaluationSpec | None, step: int, total_steps: int) -> bool:
    """Whether step `step` is evaluated (0: before the first step)."""
    if evaluation is None:
        return False
    return step == 0 or step == total_steps or step % evaluation.interval_steps == 0


class Evaluator:
    """Generates and scores the held-out prompts with the run's engines and reward."""

    def __init__(
        self,
        evaluation: EvaluationSpec,
        prompts: Sequence[PromptItem],
        sampler: Sampler,
        reward: Callable[..., Any],
        phase: Phase,
    ) -> None:
        self.evaluation = evaluation
        self.prompts = list(prompts)
        self.sampler = sampler
        self.reward = reward
        self.phase = phase

    def _sampling(self, step: int, greedy: bool) -> SamplingParams:
        algorithm = self.sampler.algorithm
        return SamplingParams(
            n=1 if greedy else self.evaluation.samples,
            temperature=0.0 if greedy else self.evaluation.temperature,
            top_p=1.0 if greedy else algorithm.top_p,
            max_tokens=self.evaluation.max_response_length or algorithm.max_response_length,
            seed=mix("rlhf-evaluation", algorithm.seed, step, "greedy" if greedy else "sampled"),
            stop_token_ids=self.sampler.inputs.stop_token_ids,
            logprobs=False,
        )

    def _scored(self, step: int, greedy: bool) -> tuple[Rollout, torch.Tensor]:
        rollout = self.sampler.complete(self.prompts, self._sampling(step, greedy))
        rewards = score_rollout(self.reward, rollout, self.sampler.spec.environment)
        return rollout, torch.tensor(rewards, dtype=torch.float64)

    def evaluate(self, step: int) -> dict[str, Any]:
        """The evaluation of the policy after `step` steps: one record of the step log."""
        record: dict[str, Any] = {"step": step, "prompts": len(self.prompts)}
        threshold = self.evaluation.pass_threshold
        sources = [
            str(item.metadata.get(self.evaluation.data_source_field, DEFAULT_SOURCE))
            for item in self.prompts
        ]
        by_source: dict[str, dict[str, float]] = defaultdict(dict)
        with self.phase(m.PHASE_EVALUATE):
            if self.evaluation.greedy:
                rollout, rewards = self._scored(step, greedy=True)
                passed = (rewards >= threshold).double()
                record |= {"score": mean(rewards), "accuracy": mean(passed)}
                record["response_tokens"] = mean(
                    torch.tensor([len(r) for r in rollout.responses], dtype=torch.float64)
                )
                for name, rows in _rows_by_source(sources, 1).items():
                    by_source[name] |= {
                        "score": mean(rewards[rows]),
                        "accuracy": mean(passed[rows]),
                    }
            if (k := self.evaluation.samples) > 0:
                _, rewards = self._scored(step, greedy=False)
                grouped = rewards.view(len(self.prompts), k)
                any_passed = (grouped >= threshold).any(dim=1).double()
                record |= {f"pass@{k}": mean(any_passed), f"mean@{k}": mean(grouped)}
                for name, rows in _rows_by_source(sources, 1).items():
                    by_source[name] |= {
                        f"pass@{k}": mean(any_passed[rows]),
                        f"mean@{k}": mean(grouped[rows]),
                    }
        if len(by_source) > 1 or DEFAULT_SOURCE not in by_source:
            record["by_source"] = dict(by_source)
        return record


def _rows_by_source(sources: list[str], per_prompt: int) -> dict[str, torch.Tensor]:
    """Each data source's row indices (`per_prompt` rows a prompt)."""
    rows: dict[str, list[int]] = defaultdict(list)
    for index, name in enumerate(sources):
        rows[name].extend(range(index * per_prompt, (index + 1) * per_prompt))
    return {name: torch.tensor(indices) for name, indices in rows.items()}


def mean(values: torch.Tensor) -> float:
    return float(values.mean()) if values.numel() else 0.0


def headline(record: dict[str, Any]) -> str:
    """One line for the driver's log."""
    parts = [f"evaluation at step {record['step']} ({record['prompts']} prompts)"]
    parts += [f"{key} {value:.3f}" for key, value in m.evaluation_figures(record).items()]
    return " | ".join(parts)
