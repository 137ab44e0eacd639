"""Masked reductions over response tokens: sum, count, mean, unbiased variance, whitening.

Every statistic in the algorithm core is taken over the valid (mask != 0)
tokens only; padding must never move a mean or a variance. Masks are 0/1
tensors of any dtype (bool, int or float) broadcastable to the values.
Masked positions are dropped with `torch.where`, not multiplied by 0, so
garbage there (NaN, -inf log-probs of padding) cannot leak into a statistic.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is nonzero; over everything (dim=None) or along `dim`."""
    kept = torch.where(mask.bool(), values, 0.0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of valid positions (int64), over everything or along `dim`."""
    return torch.count_nonzero(mask, dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over valid positions. A row (or tensor) with no valid position gives 0, not NaN.

    Shapes: values [B, R], mask [B, R] -> [] (dim=None) or [B] (dim=-1).
    """
    count = masked_count(mask, dim).clamp(min=1).to(values.dtype)
    return masked_sum(values, mask, dim) / count


def require_valid_positions(count: int, needed: int, what: str) -> None:
    """ValueError naming `what` when fewer than `needed` positions are valid (a statistic is undefined)."""
    if count < needed:
        raise ValueError(f"{what} needs at least {needed} valid positions, mask has {count}")


def _valid_count(mask: torch.Tensor, needed: int, what: str) -> int:
    count = int(masked_count(mask).item())
    require_valid_positions(count, needed, what)
    return count


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all valid positions (0-d), unbiased by default (divides by n - 1).

    Two-pass (centre first, then square) for accuracy on large batches.
    Raises ValueError when there are too few valid positions to define it.
    """
    count = _valid_count(mask, 2 if unbiased else 1, "masked_var")
    mean = masked_sum(values, mask) / count
    return masked_sum((values - mean).square_(), mask) / (count - 1 if unbiased else count)


def _sum_of_squares(values: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """sum(values ** 2) in chunks of `chunk` elements: a 1M-element temporary instead of a full copy."""
    total = torch.zeros((), dtype=values.dtype, device=values.device)
    for part in values.reshape(-1).split(chunk):
        total += part.square().sum()
    return total


def masked_whiten_(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """In place: valid positions become `(x - mean) * rsqrt(var + eps)`, masked positions 0.

    Mean and unbiased variance are over the valid positions. Shapes: values
    [B, R], mask [B, R]; returns `values`. In place and without full-size
    temporaries, because at 16k x 4k each one is another 256 MiB to fault in.
    """
    count = _valid_count(mask, 2, "masked_whiten")
    invalid = ~mask.bool()
    values.masked_fill_(invalid, 0.0)
    values.sub_(values.sum() / count).masked_fill_(invalid, 0.0)
    var = _sum_of_squares(values) / (count - 1)
    return values.mul_(torch.rsqrt(var + eps))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Out-of-place `masked_whiten_`: `[B, R]` -> whitened copy `[B, R]`, 0 at masked positions."""
    return masked_whiten_(values.clone(), mask, eps)
