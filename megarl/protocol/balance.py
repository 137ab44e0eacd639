"""Token balancing: reorder samples so equal-size DP chunks carry near-equal token counts.

`balanced_permutation` solves a balanced k-way number partition: every rank
gets exactly n/k samples and the spread (max - min) of per-rank token sums
should be as small as possible. Two stages:

1. Balanced Karmarkar-Karp (largest differencing): sort the counts, cut them
   into n/k partial partitions of k samples (one per rank), then repeatedly
   merge the two partial partitions with the largest spread, pairing the
   heaviest part of one with the lightest part of the other.
2. Swap refinement: while some sample of the heaviest rank and some sample of
   the lightest rank can be exchanged to narrow their gap, exchange the pair
   that narrows it most (a vectorised nearest-value search).
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from megarl.protocol.columns import check_positive_int

# Each swap costs O(m log m) for m samples per rank; the cap keeps 16k samples
# well under a second even on inputs where the swaps only creep forward.
_MAX_SWAPS = 2000


def balanced_permutation(token_counts: Sequence[int] | np.ndarray, world_size: int) -> np.ndarray:
    """A permutation `perm` of range(n) that spreads `token_counts` evenly over `world_size` ranks.

    Cutting `counts[perm]` into `world_size` equal contiguous chunks gives
    near-equal chunk sums: rank r gets `perm[r*m:(r+1)*m]`, m = n / world_size,
    in their original order. Raises ValueError unless n divides by world_size.
    """
    counts = np.asarray(token_counts)
    if counts.ndim != 1:
        raise ValueError(f"token_counts must be 1-D, got shape {counts.shape}")
    if counts.size and not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"token_counts must be integers, got dtype {counts.dtype}")
    counts = counts.astype(np.int64, copy=False)
    world_size = check_positive_int("world_size", world_size)
    if len(counts) % world_size:
        raise ValueError(
            f"cannot balance {len(counts)} samples over world_size={world_size}: "
            f"{len(counts)} is not divisible by {world_size}"
        )
    if world_size == 1 or len(counts) == 0:
        return np.arange(len(counts), dtype=np.int64)
    rank_of = _karmarkar_karp(counts, world_size)
    members = _swap_refine(counts, rank_of, world_size)
    return np.concatenate([np.sort(rows) for rows in members])


def _karmarkar_karp(counts: np.ndarray, world_size: int) -> np.ndarray:
    """Rank of every sample from balanced largest differencing (each rank gets n/world_size samples)."""
    n = len(counts)
    order = np.argsort(-counts, kind="stable")
    # A partial partition is (part sums sorted descending, node id of each part).
    # Node ids 0..n-1 are samples (by position in `order`); a merge makes
    # world_size new nodes, each the union of two older ones, recorded in `merges`.
    part_sums: list[np.ndarray] = []
    part_nodes: list[np.ndarray] = []
    heap: list[tuple[int, int]] = []
    for group in range(n // world_size):
        rows = slice(group * world_size, (group + 1) * world_size)
        part_sums.append(counts[order[rows]])
        part_nodes.append(np.arange(rows.start, rows.stop))
        heapq.heappush(heap, (-int(part_sums[-1][0] - part_sums[-1][-1]), group))
    merges: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    next_node = n
    while len(heap) > 1:
        _, a = heapq.heappop(heap)
        _, b = heapq.heappop(heap)
        sums = part_sums[a] + part_sums[b][::-1]
        new_nodes = np.arange(next_node, next_node + world_size)
        next_node += world_size
        merges.append((new_nodes, part_nodes[a], part_nodes[b][::-1]))
        descending = np.argsort(-sums, kind="stable")
        part_sums[a], part_nodes[a] = sums[descending], new_nodes[descending]
        heapq.heappush(heap, (-int(part_sums[a][0] - part_sums[a][-1]), a))
    root = heap[0][1]
    label = np.empty(next_node, dtype=np.int64)
    label[part_nodes[root]] = np.arange(world_size)
    # Children always have smaller ids than their merge, so walking merges
    # backwards hands every node its final rank before its children need it.
    for new_nodes, left, right in reversed(merges):
        label[left] = label[new_nodes]
        label[right] = label[new_nodes]
    rank_of = np.empty(n, dtype=np.int64)
    rank_of[order] = label[:n]
    return rank_of


def _swap_refine(counts: np.ndarray, rank_of: np.ndarray, world_size: int) -> list[np.ndarray]:
    """Per-rank sample indices after exchanging pairs between the heaviest and lightest ranks."""
    by_rank = np.argsort(rank_of, kind="stable")
    per_rank = len(counts) // world_size
    members = [by_rank[r * per_rank:(r + 1) * per_rank].copy() for r in range(world_size)]
    sums = np.array([counts[rows].sum() for rows in members], dtype=np.int64)
    for _ in range(_MAX_SWAPS):
        heavy, light = int(np.argmax(sums)), int(np.argmin(sums))
        gap = int(sums[heavy] - sums[light])
        if gap <= 1:
            break
        swap = _best_swap(counts[members[heavy]], counts[members[light]], gap)
        if swap is None:
            break
        i, j = swap
        moved = int(counts[members[heavy][i]] - counts[members[light][j]])
        members[heavy][i], members[light][j] = members[light][j], members[heavy][i]
        sums[heavy] -= moved
        sums[light] += moved
    return members


def _best_swap(heavy: np.ndarray, light: np.ndarray, gap: int) -> tuple[int, int] | None:
    """(i, j) whose exchange moves d = heavy[i] - light[j], 0 < d < gap, with |gap - 2d| smallest.

    None when no exchange narrows the gap.
    """
    light_order = np.argsort(light, kind="stable")
    light_sorted = light[light_order]
    # The ideal partner of heavy[i] is heavy[i] - gap/2: look at its two sorted neighbours.
    above = np.searchsorted(light_sorted, heavy - gap / 2)
    best: tuple[float, int, int] | None = None
    for candidate in (np.clip(above - 1, 0, len(light) - 1), np.clip(above, 0, len(light) - 1)):
        moved = heavy - light_sorted[candidate]
        score = np.where((moved > 0) & (moved < gap), np.abs(gap - 2 * moved), np.inf)
        i = int(np.argmin(score))
        if np.isfinite(score[i]) and (best is None or score[i] < best[0]):
            best = (float(score[i]), i, int(light_order[candidate[i]]))
    return None if best is None else (best[1], best[2])
