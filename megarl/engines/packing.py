"""Sequence packing for dynamic micro-batching by a token budget (pure torch, no megatron).

A padded batch (`input_ids`, `attention_mask`, `position_ids` [B, S], plus per-row
tensors such as `response_mask` [B, R]) becomes micro-batches of one packed row each:
the real tokens of several sequences side by side, at most `max_tokens` tokens per row
(a longer sequence gets a row of its own). Each micro-batch holds

- `input_ids`, `position_ids` [1, T]: the real tokens, positions as given (restarting
  per sequence; RoPE reads them), and `cu_seqlens` [n + 1]: where each sequence starts
  and ends in the row (tokens after the last end are row padding);
- `token_index` [n, S]: where original token (row, t) sits in the packed row, -1 for
  padding, so losses can read per-token values in the original [n, R] layout;
- every other per-row tensor, indexed by the n rows it packs, and `valid_row` [n].

Megatron's local attention has no THD/packed-sequence support; `attention` runs it once
over the row's sequences gathered into a right-padded causal batch instead.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor
_TOKEN_KEYS = ("input_ids", "attention_mask", "position_ids")


def first_fit_decreasing(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row ids per bin: longest first, each into the first bin it fits (sum <= max_tokens).

    A sequence longer than `max_tokens` gets a bin of its own; rows of length 0 are
    placed like any other (they cost nothing).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch={max_tokens} must be >= 1")
    bins: list[list[int]] = []
    loads: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        for i, load in enumerate(loads):
            if load + lengths[row] <= max_tokens:
                bins[i].append(row)
                loads[i] += lengths[row]
                break
        else:
            bins.append([row])
            loads.append(lengths[row])
    return bins


def split_to_count(bins: list[list[int]], count: int, lengths: list[int]) -> list[list[int]]:
    """`count` bins from `bins` (count >= len(bins)): split the heaviest multi-row bin in two
    (alternating rows, so both halves get similar loads) until there are enough; when no
    bin has two rows left, add empty bins. Ranks with fewer bins use this to run as many
    micro-batches as the others without padding tokens."""
    if count < len(bins):
        raise ValueError(f"cannot shrink {len(bins)} bins to {count}")
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [i for i, b in enumerate(bins) if len(b) > 1]
        if not splittable:
            bins.extend([] for _ in range(count - len(bins)))
            break
        heaviest = max(splittable, key=lambda i: sum(lengths[r] for r in bins[i]))
        rows = bins.pop(heaviest)
        bins[heaviest:heaviest] = [rows[0::2], rows[1::2]]
    return bins


def pack_rows(batch: dict[str, Tensor], rows: list[int], *, pad_to: int | None = None) -> dict[str, Tensor]:
    """One packed micro-batch of `rows` of `batch` (see the module docstring).

    `pad_to` pads the packed row with segment-0 tokens to that length (fixed-shape pipelines).
    """
    mask = batch["attention_mask"][rows].bool()
    seq = mask.shape[1]
    lengths = mask.sum(-1)
    total = int(lengths.sum())
    length = max(total, 1) if pad_to is None else pad_to
    if length < total:
        raise ValueError(f"pad_to={pad_to} is shorter than the {total} packed tokens")
    token_index = torch.full((len(rows), seq), -1, dtype=torch.long)
    token_index[mask] = torch.arange(total)
    packed = {
        "input_ids": torch.zeros(1, length, dtype=batch["input_ids"].dtype),
        "position_ids": torch.zeros(1, length, dtype=batch["position_ids"].dtype),
        "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "token_index": token_index,
    }
    packed["input_ids"][0, :total] = batch["input_ids"][rows][mask]
    packed["position_ids"][0, :total] = batch["position_ids"][rows][mask]
    for key, value in batch.items():
        if key not in _TOKEN_KEYS:
            packed[key] = value[rows]
    packed["valid_row"] = torch.ones(len(rows))
    return packed


def padding_fraction(real_tokens: int, computed_tokens: int) -> float:
    """Share of the computed token slots that hold padding."""
    return 0.0 if computed_tokens == 0 else 1.0 - real_tokens / computed_tokens
