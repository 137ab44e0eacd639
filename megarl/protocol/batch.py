"""`Batch`: the per-step data object that the controller grows phase by phase.

A Batch holds columns that share the leading (sample) dimension: torch tensors
(`input_ids`, `attention_mask`, `old_log_probs`, ...) and 1-D numpy object
arrays (`uid`, `data_source`, `reward_model`, ...), plus a `meta` dict for
per-batch values (step, temperature, ...). Every operation either returns a
consistent Batch or raises an error naming the key and the sizes involved.

Row selections (indexing, split, chunk) return views of the parent's tensors,
and repeat/index share the Python objects inside non-tensor columns; pickling
compacts tensor views, so a shard sent to a Ray worker carries only its rows.
The operations count towards `op_timer.measure_batch_ops()` (the controller's
overhead per step).
"""

from __future__ import annotations

import copy
import types
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from megarl.protocol.balance import balanced_permutation
from megarl.protocol.columns import (
    check_positive_int,
    check_tensor,
    compact,
    first_object_mismatch,
    first_tensor_mismatch,
    row_index,
    take_tensor,
    to_object_array,
    values_equal,
)
from megarl.protocol.op_timer import timed


class Batch:
    """Tensors + non-tensor object arrays with one leading batch dimension, and a `meta` dict."""

    __slots__ = ("_tensors", "_non_tensors", "meta")

    @timed
    def __init__(
        self,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, np.ndarray] | None = None,
        meta: dict | None = None,
    ):
        self._tensors = {key: check_tensor(key, value) for key, value in (tensors or {}).items()}
        self._non_tensors = {key: to_object_array(key, value) for key, value in (non_tensors or {}).items()}
        self.meta = dict(meta or {})
        both = self._tensors.keys() & self._non_tensors.keys()
        if both:
            raise ValueError(f"keys {sorted(both)} are given both as tensors and as non-tensors")
        sizes = {key: len(value) for key, value in self._columns()}
        if len(set(sizes.values())) > 1:
            listing = ", ".join(f"{key}={size}" for key, size in sizes.items())
            raise ValueError(f"columns disagree on the batch size: {listing}")

    @classmethod
    @timed
    def from_dict(cls, data: Mapping[str, Any], meta: dict | None = None) -> Batch:
        """Torch tensors become tensor columns; anything else (lists, numpy arrays) a 1-D object array."""
        tensors = {key: value for key, value in data.items() if isinstance(value, torch.Tensor)}
        non_tensors = {key: value for key, value in data.items() if not isinstance(value, torch.Tensor)}
        return cls(tensors, non_tensors, meta)

    # ----- columns -----------------------------------------------------------

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Read-only view; add or replace columns with `b[key] = value`."""
        return types.MappingProxyType(self._tensors)

    @property
    def non_tensors(self) -> Mapping[str, np.ndarray]:
        """Read-only view; add or replace columns with `b[key] = value`."""
        return types.MappingProxyType(self._non_tensors)

    def _columns(self) -> Iterable[tuple[str, torch.Tensor | np.ndarray]]:
        yield from self._tensors.items()
        yield from self._non_tensors.items()

    def __len__(self) -> int:
        for _, value in self._columns():
            return len(value)
        return 0

    def keys(self) -> list[str]:
        return [*self._tensors, *self._non_tensors]

    def __contains__(self, key: object) -> bool:
        return key in self._tensors or key in self._non_tensors

    def _require(self, keys: Iterable[str], action: str) -> list[str]:
        keys = [keys] if isinstance(keys, str) else list(keys)
        missing = [key for key in keys if key not in self]
        if missing:
            raise KeyError(f"{action}: no key(s) {missing} in batch; it has {self.keys()}")
        return keys

    @timed
    def __getitem__(self, index: Any) -> Any:
        """`b["key"]` is a column; any other index selects rows and returns a Batch."""
        if isinstance(index, str):
            self._require([index], "getitem")
            return self._tensors[index] if index in self._tensors else self._non_tensors[index]
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            raise TypeError(f"b[{index}]: an int selects no rows; use b[[{index}]] for a one-row Batch")
        return self._take(row_index(index, len(self)))

    @timed
    def __setitem__(self, key: str, value: Any) -> None:
        """Add or replace one column; tensors become tensor columns, anything else an object array."""
        if not isinstance(key, str):
            raise TypeError(f"column keys are str, got {type(key).__name__}; rows are read-only")
        column = check_tensor(key, value) if isinstance(value, torch.Tensor) else to_object_array(key, value)
        others = [(name, len(col)) for name, col in self._columns() if name != key]
        if others and len(column) != others[0][1]:
            raise ValueError(
                f"column {key!r} has {len(column)} rows, batch has {others[0][1]} (column {others[0][0]!r})"
            )
        self._tensors.pop(key, None)
        self._non_tensors.pop(key, None)
        (self._tensors if isinstance(column, torch.Tensor) else self._non_tensors)[key] = column

    @timed
    def select(self, keys: str | Iterable[str]) -> Batch:
        """A Batch with only `keys` (columns shared, meta copied)."""
        keys = set(self._require(keys, "select"))
        return Batch(
            {key: value for key, value in self._tensors.items() if key in keys},
            {key: value for key, value in self._non_tensors.items() if key in keys},
            self.meta,
        )

    @timed
    def pop(self, keys: str | Iterable[str]) -> Batch:
        """Remove `keys` from this batch and return them as a Batch (meta copied)."""
        popped = self.select(keys)
        for key in popped.keys():
            self._tensors.pop(key, None)
            self._non_tensors.pop(key, None)
        return popped

    @timed
    def drop(self, keys: str | Iterable[str]) -> Batch:
        """A Batch without `keys`; this batch is unchanged."""
        keys = set(self._require(keys, "drop"))
        return self.select([key for key in self.keys() if key not in keys])

    # ----- rows --------------------------------------------------------------

    def _take(self, rows: slice | np.ndarray) -> Batch:
        on_device: dict[torch.device, torch.Tensor] = {}
        return Batch(
            {key: take_tensor(value, rows, on_device) for key, value in self._tensors.items()},
            {key: value[rows] for key, value in self._non_tensors.items()},
            self.meta,
        )

    @timed
    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Every sample `n` times: interleaved [a, a, b, b] or tiled [a, b, a, b]."""
        n = check_positive_int("repeat: n", n)
        if interleave:
            tensors = {key: value.repeat_interleave(n, dim=0) for key, value in self._tensors.items()}
            non_tensors = {key: np.repeat(value, n) for key, value in self._non_tensors.items()}
        else:
            tensors = {key: value.repeat(n, *[1] * (value.ndim - 1)) for key, value in self._tensors.items()}
            non_tensors = {key: np.tile(value, n) for key, value in self._non_tensors.items()}
        return Batch(tensors, non_tensors, self.meta)

    @timed
    def reorder(self, perm: Sequence[int] | np.ndarray | torch.Tensor) -> Batch:
        """Rows in the order `perm`, which must be a permutation of range(len(self))."""
        order = np.asarray(perm.cpu() if isinstance(perm, torch.Tensor) else perm)
        n = len(self)
        if order.shape != (n,) or (n and not np.issubdtype(order.dtype, np.integer)):
            raise ValueError(f"reorder: perm must be {n} integers, got shape {order.shape} dtype {order.dtype}")
        if n and not np.array_equal(np.sort(order), np.arange(n)):
            raise ValueError(f"reorder: perm is not a permutation of range({n})")
        return self._take(order.astype(np.int64, copy=False))

    @timed
    def split(self, size: int) -> list[Batch]:
        """Consecutive Batches of `size` rows (the last may be smaller)."""
        size = check_positive_int("split: size", size)
        return [self._take(slice(start, start + size)) for start in range(0, len(self), size)]

    @timed
    def chunk(self, n: int) -> list[Batch]:
        """`n` consecutive Batches whose sizes differ by at most one (the first len % n get the extra row)."""
        n = check_positive_int("chunk: n", n)
        if n > len(self):
            raise ValueError(f"chunk: cannot cut {len(self)} samples into {n} non-empty chunks")
        base, extra = divmod(len(self), n)
        bounds = np.cumsum([0] + [base + (i < extra) for i in range(n)])
        return [self._take(slice(int(start), int(stop))) for start, stop in zip(bounds[:-1], bounds[1:])]

    @timed
    def balance(self, world_size: int, mask_key: str = "attention_mask") -> tuple[Batch, np.ndarray]:
        """(reordered batch, perm) such that `chunk(world_size)` gives near-equal token counts.

        Tokens per sample are the row sums of the 2-D tensor `mask_key`.
        """
        self._require([mask_key], "balance")
        mask = self[mask_key]
        if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
            raise ValueError(f"balance: {mask_key!r} must be a 2-D tensor, got {getattr(mask, 'shape', type(mask))}")
        perm = balanced_permutation(mask.sum(dim=-1, dtype=torch.int64).cpu().numpy(), world_size)
        return self.reorder(perm), perm

    # ----- combining ---------------------------------------------------------

    @timed
    def union(self, other: Batch) -> Batch:
        """All columns of both; shared columns must be equal, meta values must agree."""
        if self.keys() and other.keys() and len(self) != len(other):
            raise ValueError(f"union: batch sizes differ: {len(self)} vs {len(other)}")
        for key, value in other._tensors.items():
            if key in self._non_tensors:
                raise ValueError(f"union: {key!r} is a non-tensor here and a tensor in the other batch")
            if key in self._tensors:
                _check_same_tensor(key, self._tensors[key], value)
        for key, value in other._non_tensors.items():
            if key in self._tensors:
                raise ValueError(f"union: {key!r} is a tensor here and a non-tensor in the other batch")
            if key in self._non_tensors:
                row = first_object_mismatch(self._non_tensors[key], value)
                if row is not None:
                    raise ValueError(
                        f"union: non-tensor {key!r} differs at row {row}: "
                        f"{self._non_tensors[key][row]!r} vs {value[row]!r}"
                    )
        return Batch(
            {**self._tensors, **other._tensors},
            {**self._non_tensors, **other._non_tensors},
            _merge_meta([self.meta, other.meta], "union"),
        )

    @staticmethod
    @timed
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all `batches` in order; every batch must have the same keys and trailing shapes."""
        batches = list(batches)
        if not batches:
            raise ValueError("concat: no batches given")
        first = batches[0]
        for i, batch in enumerate(batches[1:], start=1):
            problems = []
            for kind, mine, theirs in (
                ("tensor", first._tensors, batch._tensors),
                ("non-tensor", first._non_tensors, batch._non_tensors),
            ):
                if missing := [key for key in mine if key not in theirs]:
                    problems.append(f"batch {i} lacks {kind} keys {missing} of batch 0")
                if extra := [key for key in theirs if key not in mine]:
                    problems.append(f"batch {i} has {kind} keys {extra} not in batch 0")
            if problems:
                raise ValueError("concat: " + "; ".join(problems))
            for key, value in batch._tensors.items():
                ref = first._tensors[key]
                if value.shape[1:] != ref.shape[1:] or value.dtype != ref.dtype:
                    raise ValueError(
                        f"concat: tensor {key!r} is {tuple(value.shape)} {value.dtype} in batch {i}, "
                        f"{tuple(ref.shape)} {ref.dtype} in batch 0 (only the batch dim may differ)"
                    )
        return Batch(
            {key: torch.cat([b._tensors[key] for b in batches]) for key in first._tensors},
            {key: np.concatenate([b._non_tensors[key] for b in batches]) for key in first._non_tensors},
            _merge_meta([b.meta for b in batches], "concat"),
        )

    # ----- movement ----------------------------------------------------------

    @timed
    def to(self, device: torch.device | str) -> Batch:
        """A Batch with every tensor on `device` (non-tensors and meta shared/copied)."""
        return Batch({key: value.to(device) for key, value in self._tensors.items()}, self._non_tensors, self.meta)

    @timed
    def clone(self) -> Batch:
        """A fully independent copy: tensors cloned, non-tensor objects and meta deep-copied."""
        return Batch(
            {key: value.clone() for key, value in self._tensors.items()},
            copy.deepcopy(self._non_tensors),
            copy.deepcopy(self.meta),
        )

    @timed
    def __getstate__(self) -> dict:
        return {
            "tensors": {key: compact(value) for key, value in self._tensors.items()},
            "non_tensors": self._non_tensors,
            "meta": self.meta,
        }

    def __setstate__(self, state: dict) -> None:
        self._tensors = state["tensors"]
        self._non_tensors = state["non_tensors"]
        self.meta = state["meta"]

    def __repr__(self) -> str:
        tensors = ", ".join(
            f"{key}: {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
            for key, value in self._tensors.items()
        )
        non_tensors = ", ".join(self._non_tensors)
        return f"Batch(len={len(self)}, tensors={{{tensors}}}, non_tensors=[{non_tensors}], meta={self.meta!r})"


def _check_same_tensor(key: str, mine: torch.Tensor, theirs: torch.Tensor) -> None:
    if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
        raise ValueError(
            f"union: tensor {key!r} is {tuple(mine.shape)} {mine.dtype} here, "
            f"{tuple(theirs.shape)} {theirs.dtype} in the other batch"
        )
    row = first_tensor_mismatch(mine, theirs.to(mine.device))
    if row is not None:
        raise ValueError(f"union: tensor {key!r} differs at row {row}")


def _merge_meta(metas: Sequence[dict], action: str) -> dict:
    merged: dict = {}
    for i, meta in enumerate(metas):
        for key, value in meta.items():
            if key in merged and not values_equal(merged[key], value):
                raise ValueError(f"{action}: meta {key!r} conflicts: {merged[key]!r} vs {value!r} (batch {i})")
            merged.setdefault(key, value)
    return merged
