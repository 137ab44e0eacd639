"""Column-level helpers for `Batch`: conversion, row indices, equality, compaction.

A Batch column is either a torch tensor (leading dim = samples) or a 1-D numpy
object array (one Python object per sample). These functions hold the rules
for turning user values into columns and row selectors into index arrays, so
that `batch.py` only deals with whole-batch bookkeeping.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

RowIndex = slice | np.ndarray


def to_object_array(key: str, value: Any) -> np.ndarray:
    """`value` (list, tuple, numpy array) as a 1-D object array with one element per sample.

    Built element by element so that a list of equal-length lists stays a list
    of lists instead of becoming a 2-D array; a 2-D numpy array becomes one row
    per element.
    """
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"non-tensor {key!r}: a 0-d array has no batch dimension (put per-batch values in meta)")
        if value.dtype == object and value.ndim == 1:
            return value
        if value.ndim == 1:
            return value.astype(object)
        return np.fromiter(value, dtype=object, count=len(value))
    if isinstance(value, (list, tuple)):
        return np.fromiter(value, dtype=object, count=len(value))
    raise TypeError(
        f"column {key!r}: expected a torch.Tensor, numpy array, list or tuple, got {type(value).__name__}"
        " (put per-batch values in meta)"
    )


def check_tensor(key: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"tensor {key!r}: expected a torch.Tensor, got {type(value).__name__}")
    if value.ndim == 0:
        raise ValueError(f"tensor {key!r}: a 0-d tensor has no batch dimension (put per-batch values in meta)")
    return value


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def row_index(index: Any, length: int) -> RowIndex:
    """A row selector (slice, int list/array/tensor, bool mask) as a slice or an int64 array in [0, length)."""
    if isinstance(index, slice):
        return index
    if isinstance(index, torch.Tensor):
        index = index.detach().cpu().numpy()
    elif isinstance(index, (list, tuple, range)):
        index = np.asarray(index)
        if index.size == 0:
            index = index.astype(np.int64)
    if not isinstance(index, np.ndarray):
        raise TypeError(
            f"row index must be a slice, int list, int/bool numpy array or tensor, got {type(index).__name__}"
            " (use b[[i]] for one row, b['key'] for a column)"
        )
    if index.ndim != 1:
        raise IndexError(f"row index must be 1-D, got shape {tuple(index.shape)}")
    if index.dtype == np.bool_:
        if len(index) != length:
            raise IndexError(f"bool mask has length {len(index)}, batch has length {length}")
        return np.flatnonzero(index)
    if not np.issubdtype(index.dtype, np.integer):
        raise TypeError(f"row index must hold integers or bools, got dtype {index.dtype}")
    index = index.astype(np.int64, copy=False)
    if index.size and (index.min() < -length or index.max() >= length):
        bad = index[(index < -length) | (index >= length)][0]
        raise IndexError(f"row index {bad} out of range for batch of length {length}")
    return np.where(index < 0, index + length, index)


def take_tensor(tensor: torch.Tensor, rows: RowIndex, on_device: dict[torch.device, torch.Tensor]) -> torch.Tensor:
    """Rows of `tensor`; `on_device` caches the index per device so it is copied once per batch."""
    if isinstance(rows, slice):
        return tensor[rows]
    if tensor.device not in on_device:
        on_device[tensor.device] = torch.from_numpy(rows).to(tensor.device)
    return tensor.index_select(0, on_device[tensor.device])


def values_equal(a: Any, b: Any) -> bool:
    """Equality for meta values and non-tensor elements, where `==` may return an array or raise."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def first_object_mismatch(a: np.ndarray, b: np.ndarray) -> int | None:
    """Index of the first row where two equal-length object arrays differ, or None."""
    if a is b:
        return None
    try:
        # numpy compares element by element in C; identical objects short-circuit.
        same = np.asarray(a == b, dtype=bool)
        if same.shape == a.shape:
            bad = np.flatnonzero(~same)
            return int(bad[0]) if bad.size else None
    except (TypeError, ValueError):
        pass
    # Elements such as arrays make `==` ambiguous: compare one by one.
    for row, (x, y) in enumerate(zip(a, b)):
        if not values_equal(x, y):
            return row
    return None


def first_tensor_mismatch(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index of the first row where two same-shape tensors differ, or None."""
    if a is b or torch.equal(a, b):
        return None
    differs = (a != b).reshape(a.shape[0], -1).any(dim=1)
    return int(differs.nonzero()[0, 0])


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself, or a contiguous copy when it views a larger storage.

    Pickling a view serialises its whole storage: a DP shard sliced from a
    16k-sample batch would otherwise ship all 16k rows to every rank.
    """
    needed = tensor.numel() * tensor.element_size()
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == needed:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
