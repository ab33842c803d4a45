"""Masked tensor reductions: sums, means, variances and whitening over the response tokens.

Every layer that reduces over a batch of padded sequences needs them (the log-prob kernels, the
advantage estimators, the losses), so they sit on the ground floor.
"""

from __future__ import annotations

import torch
from torch import Tensor

# --------------------------------------------------------------------------------------------
# Masking helpers
# --------------------------------------------------------------------------------------------


def zero_masked_out(values: Tensor, mask: Tensor) -> Tensor:
    """``values`` with every masked-out position set to 0 (even if it held ``inf`` or NaN)."""
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is set (over all elements, or along ``dim``).

    Masked-out positions are selected away rather than multiplied by 0, so junk there (``inf``
    or NaN log-probs of padding, say) cannot leak into the result.
    """
    masked = zero_masked_out(values, mask)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` where ``mask`` is set.

    A row (or a whole tensor) with no masked-in element has mean 0 rather than NaN, so that a
    fully padded sequence contributes nothing instead of poisoning the loss.
    """
    weights = mask.to(values.dtype)
    count = weights.sum() if dim is None else weights.sum(dim=dim)
    total = masked_sum(values, weights, dim)
    return total / count.clamp(min=1.0)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = False) -> Tensor:
    """Variance of the masked-in elements of ``values`` (population variance by default)."""
    weights = mask.to(values.dtype)
    mean = masked_mean(values, weights)
    count = weights.sum()
    squared_error_sum = masked_sum((values - mean) ** 2, weights)
    denominator = count - 1.0 if unbiased else count
    return squared_error_sum / denominator.clamp(min=1.0)


def masked_whiten(
    values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> Tensor:
    """Normalise the masked-in elements to zero mean and unit variance.

    Statistics come from masked-in elements only; masked-out positions are returned as 0. With
    ``shift_mean=False`` the mean is added back, which only rescales (as some PPO variants do).
    """
    weights = mask.to(values.dtype)
    mean = masked_mean(values, weights)
    var = masked_var(values, weights)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return zero_masked_out(whitened, weights)
