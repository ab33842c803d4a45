"""Every seed the trainer derives, from one hash.

A seed is a function of its parts only (never of time, placement or which engines are alive),
so a resumed run samples exactly what the uninterrupted run sampled. The parts are joined with
``":"`` and hashed with blake2b; the named helpers fix the parts of each use, and their values
are pinned by tests: changing them changes every sample of every run.
"""

from __future__ import annotations

import hashlib


def mix(*parts: object) -> int:
    """A well-mixed 62-bit seed from `parts` (``str`` of each, joined with ``":"``)."""
    text = ":".join(str(part) for part in parts)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def derive_seed(seed: int, index: int) -> int:
    """The seed of item `index` (an engine, a chunk, a rank) of a call seeded with `seed`."""
    return mix(seed, index)


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of training step `step` of a run seeded with `seed`."""
    return mix("rlhf-step", seed, step)


def generation_seed(seed: int, step: int, batch: int) -> int:
    """The sampling seed of rollout `batch` of step `step` (dynamic sampling samples several):
    the step's own seed for the first, so a run without dynamic sampling keeps its samples."""
    return step_seed(seed, step) if batch == 0 else mix("rlhf-step", seed, step, "batch", batch)


def segment_seed(seed: int, segment: int) -> int:
    """The seed of segment `segment` (1, 2, ...) of a partial rollout seeded with `seed`; the
    first segment keeps `seed` itself."""
    return mix("rlhf-segment", seed, segment)


def turn_seed(seed: int, trajectory: int, turn: int) -> int:
    """The seed of turn `turn` of trajectory `trajectory` of a multi-turn rollout seeded with
    `seed`: a turn samples the same tokens whichever other trajectories share its engine call."""
    return mix("rlhf-turn", seed, trajectory, turn)
