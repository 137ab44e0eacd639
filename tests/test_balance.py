"""balanced_permutation: validity, exact small cases, near-optimal spread, speed, errors."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from megarl.protocol import balanced_permutation


def rank_sums(counts, perm, world_size: int) -> list[int]:
    """Per-rank token totals with a plain loop: rank r gets the r-th contiguous chunk of perm."""
    per_rank = len(perm) // world_size
    sums = [0] * world_size
    for position, sample in enumerate(perm):
        sums[position // per_rank] += int(counts[sample])
    return sums


def spread(counts, perm, world_size: int) -> int:
    sums = rank_sums(counts, perm, world_size)
    return max(sums) - min(sums)


def optimal_spread(counts, world_size: int) -> int:
    """Smallest max-min over all equal-size partitions (exhaustive; tiny inputs only)."""
    n = len(counts)
    per_rank = n // world_size
    best = None

    def search(remaining: tuple[int, ...], sums: list[int]) -> None:
        nonlocal best
        if not remaining:
            value = max(sums) - min(sums)
            best = value if best is None else min(best, value)
            return
        # Fixing the first remaining sample in the next part avoids permuted duplicates.
        head, rest = remaining[0], remaining[1:]
        for others in itertools.combinations(rest, per_rank - 1):
            part = (head, *others)
            search(tuple(i for i in rest if i not in others), sums + [sum(int(counts[i]) for i in part)])

    search(tuple(range(n)), [])
    return best


def assert_valid(perm, n: int, world_size: int) -> None:
    assert perm.dtype == np.int64 and perm.shape == (n,)
    assert sorted(perm.tolist()) == list(range(n))
    # Within a rank's chunk the original order is kept.
    for chunk in np.split(perm, world_size):
        assert chunk.tolist() == sorted(chunk.tolist())


def test_hand_computed_perfect_splits():
    counts = [9, 1, 8, 2, 7, 3, 6, 4]
    for world_size, expected in [(2, [20, 20]), (4, [10, 10, 10, 10])]:
        perm = balanced_permutation(counts, world_size)
        assert_valid(perm, 8, world_size)
        assert rank_sums(counts, perm, world_size) == expected


def test_forced_imbalance_matches_the_bound():
    # The rank holding 1000 also holds three 1s; the other holds four: spread 1003 - 4.
    counts = np.array([1, 1, 1000, 1, 1, 1, 1, 1])
    perm = balanced_permutation(counts, 2)
    assert sorted(rank_sums(counts, perm, 2)) == [4, 1003]


def test_trivial_world_sizes():
    counts = np.array([5, 3, 9, 1])
    assert balanced_permutation(counts, 1).tolist() == [0, 1, 2, 3]
    one_each = balanced_permutation(counts, 4)
    assert_valid(one_each, 4, 4)
    assert balanced_permutation([], 3).tolist() == []


@pytest.mark.parametrize("n, world_size", [(10, 2), (9, 3), (8, 4)])
def test_close_to_exhaustive_optimum(n, world_size):
    rng = np.random.default_rng(n * 100 + world_size)
    heuristic, optimum = [], []
    for _ in range(40):
        counts = rng.integers(1, 1000, n)
        perm = balanced_permutation(counts, world_size)
        assert_valid(perm, n, world_size)
        heuristic.append(spread(counts, perm, world_size))
        optimum.append(optimal_spread(counts, world_size))
    heuristic, optimum = np.array(heuristic), np.array(optimum)
    assert (heuristic >= optimum).all()  # sanity of the exhaustive reference
    # Measured: optimal in 60-100% of the cases, mean spread at most ~1.8x the
    # optimum (worst for 2 ranks of 5, where tiny spreads make ratios jumpy).
    assert (heuristic == optimum).mean() >= 0.5
    assert heuristic.mean() <= 2.0 * optimum.mean()


@pytest.mark.parametrize("distribution", ["uniform", "lognormal", "clipped"])
@pytest.mark.parametrize("n, world_size", [(4096, 8), (1024, 32), (512, 2)])
def test_large_random_batches_reach_the_lower_bound(distribution, n, world_size):
    rng = np.random.default_rng(len(distribution) + n + world_size)
    if distribution == "uniform":
        counts = rng.integers(50, 4096, n)
    elif distribution == "lognormal":
        counts = np.minimum(4096, rng.lognormal(6, 1, n).astype(np.int64) + 1)
    else:  # responses that hit max_response_length pile up at 4096
        counts = np.where(rng.random(n) < 0.3, 4096, rng.integers(50, 4096, n))
    perm = balanced_permutation(counts, world_size)
    assert_valid(perm, n, world_size)
    identity = spread(counts, np.arange(n), world_size)
    balanced = spread(counts, perm, world_size)
    # Equal totals are impossible only when the sum is not divisible by the rank count.
    lower_bound = int(counts.sum() % world_size != 0)
    assert balanced <= lower_bound + 2
    assert identity > 1000 * (balanced + 1)


@pytest.mark.parametrize("world_size", [2, 8, 64, 1024])
def test_sixteen_thousand_samples_are_fast(world_size):
    counts = np.random.default_rng(world_size).integers(1, 4096, 16384)
    start = time.perf_counter()
    perm = balanced_permutation(counts, world_size)
    elapsed = time.perf_counter() - start
    assert sorted(perm.tolist()) == list(range(16384))
    # ~0.1 s measured; the margin absorbs two busy shared cores.
    assert elapsed < 2.0
    assert spread(counts, perm, world_size) < spread(counts, np.arange(16384), world_size) / 100


def test_errors():
    with pytest.raises(ValueError, match=r"cannot balance 10 samples over world_size=4: 10 is not divisible by 4"):
        balanced_permutation(list(range(10)), 4)
    with pytest.raises(ValueError, match=r"world_size must be a positive int, got 0"):
        balanced_permutation([1, 2], 0)
    with pytest.raises(ValueError, match=r"token_counts must be 1-D, got shape \(2, 2\)"):
        balanced_permutation([[1, 2], [3, 4]], 2)
    with pytest.raises(ValueError, match=r"token_counts must be integers, got dtype float64"):
        balanced_permutation([1.5, 2.0], 2)
