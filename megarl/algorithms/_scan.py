"""Compiled backward scans for the per-token recursions (GAE, discounted return-to-go), with fused whitening.

The recursions walk each response backwards in time, one dependent step per
token, so torch can only run them as one Python-dispatched op per time step
(see `advantages._gae_torch`). Here each row is one tight loop compiled by
numba: the row is contiguous in memory, so the scan reads its inputs and
writes its outputs once, and it also gathers the whitening statistics on the
way; a second pass whitens in place. Rows are split over
`torch.get_num_threads()` threads (the kernels release the GIL).

numba is imported and the kernels compiled on first use, and cached on disk;
`available()` is False when numba is missing or the tensors are not on the CPU,
and the callers then use their pure-torch paths, which give the same numbers up
to rounding (the scan accumulates in float64, the torch paths in the input dtype).
"""

from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from megarl.algorithms.masked import require_valid_positions


@functools.cache
def _kernels():
    """(scan, whiten) compiled kernels, or None without numba. Compiled lazily per dtype, cached on disk."""
    try:
        import numba
    except ImportError:
        return None

    @numba.njit(nogil=True, cache=True)
    def scan(rewards, values, has_values, mask, gamma, lam, lo, hi, advantages, returns, stats):
        # Per row: A_t = r_t + gamma * V_next - V_t + gamma * lam * A_next at valid tokens, carried
        # through masked ones; returns = A + V. The arithmetic is float64 whatever the storage dtype.
        # stats[i] = (valid count, shift, sum(A - shift), sum((A - shift)^2)): shifted by the row's
        # first A so the variance does not cancel catastrophically when |mean| >> std.
        length = rewards.shape[1]
        decay = gamma * lam
        for i in range(lo, hi):
            next_value = 0.0
            running = 0.0
            count = 0
            shift = 0.0
            total = 0.0
            squares = 0.0
            for t in range(length - 1, -1, -1):
                value = values[i, t] if has_values else 0.0
                if mask[i, t]:
                    running = rewards[i, t] + gamma * next_value - value + decay * running
                    next_value = value
                    if count == 0:
                        shift = running
                    deviation = running - shift
                    total += deviation
                    squares += deviation * deviation
                    count += 1
                advantages[i, t] = running
                returns[i, t] = running + value
            stats[i, 0] = count
            stats[i, 1] = shift
            stats[i, 2] = total
            stats[i, 3] = squares

    @numba.njit(nogil=True, cache=True)
    def whiten(advantages, mask, mean, scale, lo, hi):
        length = advantages.shape[1]
        for i in range(lo, hi):
            for t in range(length):
                advantages[i, t] = (advantages[i, t] - mean) * scale if mask[i, t] else 0.0

    return scan, whiten


def available(*tensors: torch.Tensor) -> bool:
    """Whether the compiled scan can run on these tensors (numba installed, all on the CPU)."""
    return all(t.device.type == "cpu" for t in tensors) and _kernels() is not None


# Below this many tokens a scan takes about a millisecond: starting threads would cost more than it saves.
_PARALLEL_MIN_ELEMENTS = 1 << 18


def _over_rows(kernel, rows: int, length: int, args_for) -> None:
    """Run `kernel(*args_for(lo, hi))` on contiguous row ranges [lo, hi), one range per torch thread."""
    threads = max(1, min(torch.get_num_threads(), rows)) if rows * length >= _PARALLEL_MIN_ELEMENTS else 1
    if threads == 1:
        kernel(*args_for(0, rows))
        return
    bounds = np.linspace(0, rows, threads + 1).astype(np.int64).tolist()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for future in [pool.submit(kernel, *args_for(lo, hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]:
            future.result()


def _as_u8(mask: torch.Tensor) -> np.ndarray:
    """The mask as a contiguous uint8 numpy array (one kernel specialisation for every mask dtype)."""
    valid = mask.detach() if mask.dtype == torch.bool else mask.detach() != 0
    return valid.contiguous().view(torch.uint8).numpy()


def _whitening(stats: np.ndarray, eps: float) -> tuple[float, float]:
    """(mean, 1 / sqrt(unbiased var + eps)) over all rows, merging per-row shifted sums (Chan et al.)."""
    counts, shifts, totals, squares = stats.T
    count = int(counts.sum())
    require_valid_positions(count, 2, "masked_whiten")
    rows = counts > 0
    counts, shifts, totals, squares = counts[rows], shifts[rows], totals[rows], squares[rows]
    row_means = shifts + totals / counts
    mean = float((counts * row_means).sum() / count)
    m2 = float((squares - totals * totals / counts).sum() + (counts * (row_means - mean) ** 2).sum())
    return mean, 1.0 / math.sqrt(m2 / (count - 1) + eps)


def scan_whitened(
    rewards: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(whitened advantages, returns), both [B, R] in `rewards.dtype`; `values=None` means V = 0.

    With values: GAE (`advantages.gae`). Without and lam = 1: the discounted
    return-to-go of REINFORCE++. Needs `available()`; rewards and values share
    a float dtype.
    """
    scan, whiten = _kernels()
    rows, length = rewards.shape
    rewards_np = rewards.detach().contiguous().numpy()
    values_np = np.zeros((1, 1), rewards_np.dtype) if values is None else values.detach().contiguous().numpy()
    mask_np = _as_u8(mask)
    advantages = torch.empty((rows, length), dtype=rewards.dtype)
    returns = torch.empty((rows, length), dtype=rewards.dtype)
    stats = np.zeros((rows, 4), dtype=np.float64)
    adv_np, ret_np = advantages.numpy(), returns.numpy()
    _over_rows(
        scan,
        rows,
        length,
        lambda lo, hi: (rewards_np, values_np, values is not None, mask_np, gamma, lam, lo, hi, adv_np, ret_np, stats),
    )
    mean, scale = _whitening(stats, eps)
    _over_rows(whiten, rows, length, lambda lo, hi: (adv_np, mask_np, mean, scale, lo, hi))
    return advantages, returns
