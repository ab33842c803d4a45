"""The derived seeds are pinned: a change here changes every sample of every run."""

from __future__ import annotations

from rlhf_trainer.seeds import derive_seed, generation_seed, mix, segment_seed, step_seed


def test_derived_seeds_keep_their_values() -> None:
    # Computed with engines.derive_seed before the seeds moved to rlhf_trainer.seeds.
    assert derive_seed(0, 0) == 1780076726024870709
    assert derive_seed(42, 3) == 3777066729632592571
    assert derive_seed(11, 3) == 4461135681390321395
    assert derive_seed(2**40, 7) == 2833462947534232852


def test_step_seeds_keep_their_values() -> None:
    # Computed with experience.step_seed before the seeds moved to rlhf_trainer.seeds.
    assert step_seed(0, 0) == 4298396768651460946
    assert step_seed(0, 5) == 1812683546318565324
    assert step_seed(42, 3) == 3353154399157715884
    assert step_seed(7, 100) == 1718968042050769912


def test_both_helpers_are_mix_of_their_parts() -> None:
    assert derive_seed(42, 3) == mix(42, 3)
    assert step_seed(42, 3) == mix("rlhf-step", 42, 3)
    assert 0 <= mix("anything", 1, 2.5) < 2**62


def test_a_steps_first_rollout_keeps_the_step_seed_and_the_others_are_pinned() -> None:
    # Dynamic sampling's extra rollouts of a step: the first is the step's own sampling, so a
    # job without dynamic sampling samples what it always did.
    assert generation_seed(42, 3, 0) == step_seed(42, 3)
    assert generation_seed(42, 3, 1) == mix("rlhf-step", 42, 3, "batch", 1)
    assert generation_seed(42, 3, 1) == 3864085508742287071


def test_partial_rollout_segment_seeds_are_pinned_and_distinct() -> None:
    assert segment_seed(42, 1) == mix("rlhf-segment", 42, 1)
    assert len({segment_seed(42, segment) for segment in range(1, 9)} | {42}) == 9
