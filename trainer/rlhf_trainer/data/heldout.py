"""The held-out prompts of `spec.evaluation`: a file of their own, or a seeded split of the
training set that the run then never samples. Loaded at start-up, so a held-out set that cannot
be had fails the job at once, naming the field."""

from __future__ import annotations

import random
from collections.abc import Callable

from rlhf_trainer.data.prompts import PromptItem, Tokenizer, fit_prompts, load_prompts
from rlhf_trainer.seeds import mix
from rlhfjob.api import RLHFJobSpec


def split_held_out(
    prompts: list[PromptItem], count: int, seed: int
) -> tuple[list[PromptItem], list[PromptItem]]:
    """`count` prompts chosen by `seed`, held out, and the rest (both in dataset order)."""
    if count >= len(prompts):
        raise ValueError(
            f"spec.evaluation.heldOutPrompts: {count} leaves none of the dataset's "
            f"{len(prompts)} prompts to train on"
        )
    chosen = set(random.Random(mix("rlhf-held-out", seed)).sample(range(len(prompts)), count))
    kept = [item for i, item in enumerate(prompts) if i not in chosen]
    held = [item for i, item in enumerate(prompts) if i in chosen]
    return kept, held


def load_held_out(
    spec: RLHFJobSpec,
    prompts: list[PromptItem],
    tokenizer: Tokenizer | None,
    load: Callable[..., list[PromptItem]] = load_prompts,
) -> tuple[list[PromptItem], list[PromptItem]]:
    """The prompts to train on and the held-out ones (none without `spec.evaluation`), a file
    of them read with `load` (`load_prompts`'s signature; an environment renders its own).
    ValueError naming the field when the held-out set cannot be had."""
    evaluation = spec.evaluation
    if evaluation is None:
        return prompts, []
    if evaluation.held_out_prompts is not None:
        prompts, held = split_held_out(prompts, evaluation.held_out_prompts, spec.algorithm.seed)
    else:
        assert evaluation.source is not None  # the API requires one of them
        try:
            held = load(
                evaluation.source,
                spec.dataset.prompt_field,
                tokenizer=tokenizer,
                synthetic_count=evaluation.max_prompts or 256,
                seed=mix("rlhf-evaluation-source", spec.algorithm.seed),
                chat_template=spec.dataset.chat_template,
            )
        except (ValueError, OSError) as error:
            raise ValueError(f"spec.evaluation.source: {error}") from error
        held, _ = fit_prompts(held, spec.algorithm.max_prompt_length, "truncate")
        if not held:
            raise ValueError(f"spec.evaluation.source: {evaluation.source} holds no prompts")
    if evaluation.max_prompts is not None:
        held = held[: evaluation.max_prompts]
    return prompts, held
