"""Log-probabilities and entropy of the tokens a model chose: the kernels every role runs.

The policy, the reference, the critic's scorer and the rollout engines all turn logits (or the
last hidden states and the LM head) into per-token log-probs; the chunked and fused variants keep
the `[B, T, V]` logits from being materialised at full precision.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from rlhf_trainer.masked import masked_mean

# --------------------------------------------------------------------------------------------
# Log-probabilities and entropy
# --------------------------------------------------------------------------------------------


def logprobs_from_logits(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of each token in ``token_ids`` under ``softmax(logits / temperature)``.

    ``logits`` is ``[..., V]`` and ``token_ids`` is ``[...]``; the caller aligns them (for a causal
    LM, ``logits[:, :-1]`` scores ``input_ids[:, 1:]``). Computed as ``logit - logsumexp`` in
    float32, which avoids materialising a full log-softmax copy of the vocabulary.
    """
    scaled = logits.float() / temperature
    chosen = scaled.gather(dim=-1, index=token_ids.long().unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(scaled, dim=-1)


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy (nats) of ``softmax(logits / temperature)`` at every position: ``[..., V] -> [...]``.

    The temperature must be the one the log-probs use, or the entropy describes another
    distribution than the one trained.
    """
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    probs = log_probs.exp()
    # 0 * log 0 is 0 by convention; without the where, a -inf logit would give NaN.
    plogp = torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs))
    return -plogp.sum(dim=-1)


def masked_entropy(logits: Tensor, mask: Tensor, temperature: float = 1.0) -> Tensor:
    """Mean per-token entropy over masked-in positions (a scalar; 0 if nothing is masked in)."""
    return masked_mean(token_entropy(logits, temperature), mask)


CHUNK_ELEMENTS = 1 << 28
"""`next_token_logprobs_and_entropy` works on this many logits at a time (1 GiB of float32)."""


def next_token_logprobs_and_entropy(
    logits: Tensor,
    input_ids: Tensor,
    temperature: float = 1.0,
    chunk_elements: int = CHUNK_ELEMENTS,
    compiled: bool = False,
) -> tuple[Tensor, Tensor]:
    """Log-prob of every next token and the entropy at every position of a causal LM's output.

    ``logits`` is the model's ``[B, L, V]`` output and ``input_ids`` its ``[B, L]`` input;
    both results are ``[B, L - 1]`` (position ``t`` scores ``input_ids[:, t + 1]``), of
    ``softmax(logits / temperature)``. The same values as `logprobs_from_logits` and
    `token_entropy` on ``logits[:, :-1]``, but in one fused pass: the vocabulary is never held
    in float32 for the whole batch (only `chunk_elements` of it at a time, recomputed in the
    backward pass), and the gradient is written straight into one buffer shaped like
    ``logits``. On a 151,936-token vocabulary the unfused forms spent a large share of a policy
    update materialising copies of the logits (`BENCHMARKS.md`, policy update). With
    `compiled` (`spec.model.compiledLogprobs`) each chunk's math is one Inductor kernel per
    direction (`chunk_math`).
    """
    if logits.dim() != 3 or input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, L, V] and input_ids [B, L]; got {tuple(logits.shape)} "
            f"and {tuple(input_ids.shape)}"
        )
    result = _NextTokenLogprobsAndEntropy.apply(
        logits, input_ids, float(temperature), int(chunk_elements), bool(compiled)
    )
    return result[0], result[1]


def _chunks(logits: Tensor, chunk_elements: int) -> list[slice]:
    """Row ranges of ``logits`` ``[B, L, V]`` of at most `chunk_elements` (at least one row)."""
    per_row = max(1, logits.shape[1] * logits.shape[2])
    rows = max(1, chunk_elements // per_row)
    return [slice(start, start + rows) for start in range(0, logits.shape[0], rows)]


def _scaled(chunk: Tensor, temperature: float) -> Tensor:
    """``chunk / temperature`` as a new tensor of at least float32 (the caller works in place)."""
    scaled = chunk.to(torch.promote_types(chunk.dtype, torch.float32), copy=True)
    return scaled.div_(temperature) if temperature != 1.0 else scaled


ChunkMath = tuple[Callable[..., tuple[Tensor, Tensor, Tensor]], Callable[..., Tensor]]


@functools.cache
def chunk_math(compiled: bool) -> ChunkMath:
    """The per-chunk forward and backward of the log-probs and entropy: eager, or compiled by
    `torch.compile` (Inductor, dynamic shapes; once per process, on first use). Eager, each
    direction is several passes over a chunk's float32 logits (the upcast, log-softmax,
    exponential, the entropy's product, the gradient's updates); compiled, one fused kernel
    each: those passes were a fifth of a 1.5B update's GPU time (`BENCHMARKS.md`)."""
    if not compiled:
        return _forward_chunk, _backward_chunk
    compile_ = functools.partial(torch.compile, dynamic=True)
    return compile_(_forward_chunk), compile_(_backward_chunk)


def _log_softmax_(scaled: Tensor, lse: Tensor) -> Tensor:
    """In place: ``scaled - lse``, with ``-inf`` clamped to the dtype's minimum so that
    ``0 * log 0`` is 0 rather than NaN."""
    return scaled.sub_(lse.unsqueeze(-1)).clamp_(min=torch.finfo(scaled.dtype).min)


def _forward_chunk(
    chunk: Tensor, targets: Tensor, temperature: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(log p of `targets`, entropy, logsumexp) of a chunk of logits ``[..., V]`` at
    `temperature` (in float32 or wider)."""
    scaled = _scaled(chunk, temperature)
    lse = torch.logsumexp(scaled, dim=-1)
    log_p = _log_softmax_(scaled, lse)
    chosen = log_p.gather(-1, targets).squeeze(-1)
    # sum_v p log p as a batched dot product: no third vocabulary-sized tensor.
    entropy = -torch.einsum("...v,...v->...", log_p.exp(), log_p)
    return chosen, entropy, lse


def _backward_chunk(
    chunk: Tensor,
    targets: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_chosen: Tensor | None,
    grad_entropy: Tensor | None,
    temperature: float,
) -> Tensor:
    """The gradient with respect to a chunk of logits ``[..., V]`` (in float32 or wider,
    built in place in their scaled copy); the other tensors are the chunk's rows.

    With ``p = softmax(x)``, ``x = logits / T`` and entropy ``H = -sum p log p``:
    ``d log p_y / dx = onehot(y) - p`` and ``dH / dx = -p (log p + H)``.
    """
    log_p = _log_softmax_(_scaled(chunk, temperature), lse)
    p = log_p.exp()
    # d/dx = -(g_H p (log p + H) + g_y p) + onehot(y) g_y, built in place in log_p.
    # p multiplies before g_H does: log p of an impossible token is clamped to the dtype's
    # minimum, and scaled by |g_H| > 1 first it would overflow to inf, and 0 * inf is NaN;
    # p (log p + H) is exactly 0 there.
    if grad_entropy is not None:
        g_h = grad_entropy.to(log_p.dtype).unsqueeze(-1)
        dx = log_p.add_(entropy.unsqueeze(-1)).mul_(p).mul_(g_h)
    else:
        dx = log_p.zero_()
    if grad_chosen is not None:
        g_y = grad_chosen.to(log_p.dtype).unsqueeze(-1)
        dx.addcmul_(p, g_y)
    dx.neg_()
    if grad_chosen is not None:
        dx.scatter_add_(-1, targets, g_y)
    return dx.div_(temperature) if temperature != 1.0 else dx


class _NextTokenLogprobsAndEntropy(torch.autograd.Function):
    """Forward and backward of `next_token_logprobs_and_entropy`, chunk by chunk of rows."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits: Tensor,
        input_ids: Tensor,
        temperature: float,
        chunk_elements: int,
        compiled: bool,
    ) -> tuple[Tensor, Tensor]:
        scores, targets = logits[:, :-1], input_ids[:, 1:].long().unsqueeze(-1)
        shape = scores.shape[:2]
        dtype = torch.promote_types(logits.dtype, torch.float32)
        chosen = torch.empty(shape, dtype=dtype, device=logits.device)
        entropy = torch.empty_like(chosen)
        lse = torch.empty_like(chosen)
        forward_chunk, _ = chunk_math(compiled)
        for rows in _chunks(scores, chunk_elements):
            chosen[rows], entropy[rows], lse[rows] = forward_chunk(
                scores[rows], targets[rows], temperature
            )
        ctx.save_for_backward(logits, input_ids, lse, entropy)
        ctx.temperature, ctx.chunk_elements = temperature, chunk_elements  # type: ignore[attr-defined]
        ctx.compiled = compiled  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        return chosen, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_chosen: Tensor | None,
        grad_entropy: Tensor | None,
    ) -> tuple[Tensor | None, None, None, None, None]:
        logits, input_ids, lse, entropy = ctx.saved_tensors  # type: ignore[attr-defined]
        temperature: float = ctx.temperature  # type: ignore[attr-defined]
        grad = torch.zeros_like(logits)  # the last position scores nothing
        if grad_chosen is None and grad_entropy is None:
            return grad, None, None, None, None
        scores, targets = logits[:, :-1], input_ids[:, 1:].long().unsqueeze(-1)
        _, backward_chunk = chunk_math(ctx.compiled)  # type: ignore[attr-defined]
        for rows in _chunks(scores, ctx.chunk_elements):  # type: ignore[attr-defined]
            grad[rows, :-1] = backward_chunk(
                scores[rows], targets[rows], lse[rows], entropy[rows],
                None if grad_chosen is None else grad_chosen[rows],
                None if grad_entropy is None else grad_entropy[rows],
                temperature,
            )  # fmt: skip
        return grad, None, None, None, None


def linear_next_token_logprobs_and_entropy(
    hidden: Tensor,
    head: Tensor,
    input_ids: Tensor,
    temperature: float = 1.0,
    chunk_elements: int = CHUNK_ELEMENTS,
    compiled: bool = False,
) -> tuple[Tensor, Tensor]:
    """`next_token_logprobs_and_entropy` of the logits ``hidden @ head.T``, never computed
    for more than `chunk_elements` at a time, in the forward or the backward pass.

    ``hidden`` is the ``[B, L, H]`` last hidden state of a causal LM and ``head`` its
    bias-free ``[V, H]`` output projection. Unlike the unfused form, neither the ``[B, L, V]``
    logits nor their gradient ever exist whole: each chunk's logits are recomputed in the
    backward pass, and their gradient goes straight into the hidden state's and the head's.
    """
    if hidden.dim() != 3 or input_ids.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be [B, L, H] and input_ids [B, L]; got {tuple(hidden.shape)} "
            f"and {tuple(input_ids.shape)}"
        )
    if head.dim() != 2 or head.shape[1] != hidden.shape[2]:
        raise ValueError(f"head must be [V, {hidden.shape[2]}]; got {tuple(head.shape)}")
    result = _LinearNextTokenLogprobsAndEntropy.apply(
        hidden, head, input_ids, float(temperature), int(chunk_elements), bool(compiled)
    )
    return result[0], result[1]


def _token_chunks(tokens: int, vocab: int, chunk_elements: int) -> list[slice]:
    """Token ranges whose logits ``[n, vocab]`` hold at most `chunk_elements` (at least one)."""
    rows = max(1, chunk_elements // max(1, vocab))
    return [slice(start, start + rows) for start in range(0, tokens, rows)]


class _LinearNextTokenLogprobsAndEntropy(torch.autograd.Function):
    """Forward and backward of `linear_next_token_logprobs_and_entropy`, chunk by chunk of
    tokens: the logits of a chunk are ``h @ W.T`` in the head's dtype (as the model's own
    head computes them), then the same float32 math as the unfused form."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        head: Tensor,
        input_ids: Tensor,
        temperature: float,
        chunk_elements: int,
        compiled: bool,
    ) -> tuple[Tensor, Tensor]:
        batch, length, width = hidden.shape
        states = hidden[:, :-1].reshape(-1, width)
        targets = input_ids[:, 1:].reshape(-1, 1).long()
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        chosen = torch.empty(states.shape[0], dtype=dtype, device=hidden.device)
        entropy, lse = torch.empty_like(chosen), torch.empty_like(chosen)
        weight = head.to(states.dtype)  # once, not per chunk (a copy when the dtypes differ)
        forward_chunk, _ = chunk_math(compiled)
        for rows in _token_chunks(states.shape[0], head.shape[0], chunk_elements):
            logits = states[rows] @ weight.t()
            chosen[rows], entropy[rows], lse[rows] = forward_chunk(
                logits, targets[rows], temperature
            )
        ctx.save_for_backward(hidden, head, input_ids, lse, entropy)
        ctx.temperature, ctx.chunk_elements = temperature, chunk_elements  # type: ignore[attr-defined]
        ctx.compiled = compiled  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        shape = (batch, length - 1)
        return chosen.view(shape), entropy.view(shape)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_chosen: Tensor | None,
        grad_entropy: Tensor | None,
    ) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        hidden, head, input_ids, lse, entropy = ctx.saved_tensors  # type: ignore[attr-defined]
        temperature: float = ctx.temperature  # type: ignore[attr-defined]
        grad_hidden = torch.zeros_like(hidden)  # the last position scores nothing
        if grad_chosen is None and grad_entropy is None:
            return grad_hidden, torch.zeros_like(head), None, None, None, None
        width = hidden.shape[2]
        states = hidden[:, :-1].reshape(-1, width)
        targets = input_ids[:, 1:].reshape(-1, 1).long()
        g_chosen = None if grad_chosen is None else grad_chosen.reshape(-1)
        g_entropy = None if grad_entropy is None else grad_entropy.reshape(-1)
        weight = head.to(states.dtype)
        grad_states = torch.empty_like(states)
        # Accumulated over the chunks in at least float32, as one matmul would.
        accumulate = torch.promote_types(head.dtype, torch.float32)
        grad_head = torch.zeros(head.shape, dtype=accumulate, device=head.device)
        _, backward_chunk = chunk_math(ctx.compiled)  # type: ignore[attr-defined]
        for rows in _token_chunks(states.shape[0], head.shape[0], ctx.chunk_elements):  # type: ignore[attr-defined]
            dx = backward_chunk(
                states[rows] @ weight.t(), targets[rows], lse[rows],
                entropy[rows], None if g_chosen is None else g_chosen[rows],
                None if g_entropy is None else g_entropy[rows], temperature,
            ).to(states.dtype)  # fmt: skip
            grad_states[rows] = dx @ weight
            grad_head += (dx.t() @ states[rows]).to(accumulate)
        grad_hidden[:, :-1] = grad_states.view(hidden.shape[0], -1, width)
        return grad_hidden, grad_head.to(head.dtype), None, None, None, None
