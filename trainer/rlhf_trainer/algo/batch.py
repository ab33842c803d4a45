"""Rollout batches as tensors, and how they are split across ZeRO-3 ranks and micro-batches.

A batch holds one row per sampled response: the prompt and response tokens side by side, right
padded. Per-token quantities (log-probs, advantages, values) live on the *next-token grid*:
column ``t`` describes the token ``input_ids[:, t + 1]`` predicted from ``input_ids[:, :t + 1]``,
so they have ``L - 1`` columns and ``action_mask`` marks the response tokens among them.

Under ZeRO-3 every rank must run the same number of forward and backward passes (each one
gathers parameters collectively), so a batch is padded with inert rows (all masks zero) until it
splits into equal shards of whole micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

PAD_TOKEN_ID = 0
"""Fills padding positions; masks keep it out of every loss (synthetic tasks never emit it)."""


@dataclass
class Batch:
    """Sequences plus named per-row tensors (``[B]`` or ``[B, L - 1]``) that travel with them."""

    input_ids: Tensor
    """``[B, L]`` prompt then response tokens, right padded."""
    attention_mask: Tensor
    """``[B, L]`` 1 on real tokens."""
    action_mask: Tensor
    """``[B, L - 1]`` 1 where column ``t`` scores a response token."""
    fields: dict[str, Tensor] = field(default_factory=dict)
    """Extra per-row tensors: ``old_logprobs``, ``advantages``, ``returns``, ..."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(self.action_mask.sum().item())

    def with_fields(self, **tensors: Tensor) -> Batch:
        """A copy carrying additional (or replaced) per-row tensors."""
        for name, tensor in tensors.items():
            if tensor.shape[0] != len(self):
                raise ValueError(f"{name} has {tensor.shape[0]} rows, the batch has {len(self)}")
        return Batch(self.input_ids, self.attention_mask, self.action_mask, self.fields | tensors)

    def to(self, device: torch.device) -> Batch:
        return Batch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.action_mask.to(device),
            {name: tensor.to(device) for name, tensor in self.fields.items()},
        )

    def rows(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop`` (views, no copy)."""
        return Batch(
            self.input_ids[start:stop],
            self.attention_mask[start:stop],
            self.action_mask[start:stop],
            {name: tensor[start:stop] for name, tensor in self.fields.items()},
        )

    def padded_to(self, size: int) -> Batch:
        """The batch with inert rows appended until it has ``size`` rows.

        An inert row attends to its first position only (a row attending to nothing would give
        NaN attention) and has every mask and field zero, so it adds nothing to any loss.
        """
        extra = size - len(self)
        if extra < 0:
            raise ValueError(f"cannot pad {len(self)} rows down to {size}")
        if extra == 0:
            return self
        attention = torch.zeros((extra, self.attention_mask.shape[1]), dtype=torch.long)
        attention[:, 0] = 1

        def grow(tensor: Tensor, filler: Tensor | None = None) -> Tensor:
            if filler is None:
                filler = tensor.new_zeros((extra, *tensor.shape[1:]))
            return torch.cat([tensor, filler.to(tensor.dtype)])

        return Batch(
            grow(self.input_ids, torch.full_like(attention, PAD_TOKEN_ID)),
            grow(self.attention_mask, attention),
            grow(self.action_mask),
            {name: grow(tensor) for name, tensor in self.fields.items()},
        )

    def micro_batches(self, size: int) -> Iterator[Batch]:
        for start in range(0, len(self), size):
            yield self.rows(start, start + size)


def build_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    response_masks: Sequence[Sequence[int]] = (),
) -> Batch:
    """Pack ``prompt + response`` pairs into a right-padded batch with its action mask: every
    response token, or (multi-turn trajectories) those `response_masks` marks 1, the model's
    own, so that the environment's tokens inside a response are never trained on."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if response_masks and len(response_masks) != len(responses):
        raise ValueError(f"{len(response_masks)} response masks for {len(responses)} responses")
    if any(not prompt for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    length = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    input_ids = torch.full((len(prompts), length), PAD_TOKEN_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), length), dtype=torch.long)
    action_mask = torch.zeros((len(prompts), length - 1), dtype=torch.float32)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        tokens = [*prompt, *response]
        input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        attention_mask[row, : len(tokens)] = 1
        # Column t scores token t + 1: the response occupies columns len(prompt) - 1 onwards.
        if response_masks:
            mask = response_masks[row]
            if len(mask) != len(response):
                raise ValueError(f"row {row}: {len(mask)} mask values, {len(response)} tokens")
            action_mask[row, len(prompt) - 1 : len(tokens) - 1] = torch.tensor(
                mask, dtype=torch.float32
            )
        else:
            action_mask[row, len(prompt) - 1 : len(tokens) - 1] = 1.0
    return Batch(input_ids, attention_mask, action_mask)


@dataclass(frozen=True)
class ShardPlan:
    """How a batch of ``rows`` splits over ``world_size`` ranks in micro-batches.

    The rows of a step (the global batch) come from the spec alone, never from the number of
    ranks: fewer ranks each take more micro-batches (`accumulation_steps`), and `loss_scale`
    makes the optimizer step the same token mean over the whole batch, so a group that
    restarts with fewer ranks or more trains the same run.
    """

    rows: int
    world_size: int
    micro_batch_size: int

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per rank: every rank runs this many, padding where rows run out."""
        return max(1, math.ceil(self.rows / (self.world_size * self.micro_batch_size)))

    @property
    def rows_per_rank(self) -> int:
        return self.accumulation_steps * self.micro_batch_size

    @property
    def padded_rows(self) -> int:
        return self.rows_per_rank * self.world_size

    def loss_scale(self, total_units: float) -> float:
        """The factor on each micro-batch's loss times its units (tokens for a token mean,
        sequences for a sequence mean: `losses.PolicyObjective`).

        DeepSpeed divides every micro-batch's gradient by `accumulation_steps` and averages
        the ranks' gradients; this factor undoes both and divides by the batch's units, so
        the step's gradient is that of the mean over the whole batch, whatever the number of
        ranks or how the rows fall into shards.
        """
        return self.world_size * self.accumulation_steps / max(total_units, 1)

    def shard(self, batch: Batch, rank: int) -> Batch:
        """Rank ``rank``'s contiguous share of the padded batch."""
        if len(batch) != self.rows:
            raise ValueError(f"plan is for {self.rows} rows, batch has {len(batch)}")
        start = rank * self.rows_per_rank
        return batch.padded_to(self.padded_rows).rows(start, start + self.rows_per_rank)

    def unshard(self, parts: Sequence[Tensor]) -> Tensor:
        """Concatenate per-rank results (in rank order) and drop the padding rows."""
        return torch.cat(list(parts))[: self.rows]
