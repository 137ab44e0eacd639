"""Padding token lists into batch tensors, and position ids for left-padded rows.

Prompts are left-padded (every prompt ends at the same column, so generation
continues from one place); responses are right-padded (every response starts
at the same column, so `response_mask` is a prefix of ones).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _check_width(sequences: Sequence[Sequence[int]], length: int | None) -> int:
    longest = max((len(sequence) for sequence in sequences), default=0)
    if length is None:
        return longest
    if longest > length:
        raise ValueError(f"cannot pad to length {length}: the longest sequence has {longest} tokens")
    return length


def left_pad(
    sequences: Sequence[Sequence[int]], pad_id: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`input_ids` [B, L], `attention_mask` [B, L]) int64, tokens at the right end of each row.

    L is `length`, or the longest sequence when `length` is None.
    """
    width = _check_width(sequences, length)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        if len(sequence):
            input_ids[row, width - len(sequence) :] = torch.as_tensor(sequence, dtype=torch.long)
            attention_mask[row, width - len(sequence) :] = 1
    return input_ids, attention_mask


def right_pad(
    sequences: Sequence[Sequence[int]], pad_id: int, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`ids` [B, L] int64 with tokens at the left end of each row, `lengths` [B] int64).

    L is `length`, or the longest sequence when `length` is None.
    """
    width = _check_width(sequences, length)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        if len(sequence):
            ids[row, : len(sequence)] = torch.as_tensor(sequence, dtype=torch.long)
    lengths = torch.tensor([len(sequence) for sequence in sequences], dtype=torch.long)
    return ids, lengths


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens from 0 (cumsum of the mask - 1); padding positions are clipped to 0."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
