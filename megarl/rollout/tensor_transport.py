"""The wire format of `/update_weights_from_tensor`: named tensors <-> one base64 string.

SGLang's `serialized_named_tensors` holds one string per server TP rank; each is
`base64(ForkingPickler.dumps(payload))` (torch registers its tensor reductions
on `multiprocessing.reduction.ForkingPickler`). With `load_format` None or "direct" the
payload is a list of `(name, tensor)`; with "flattened_bucket" it is a dict
`{"flattened_tensor": <1-D uint8 tensor>, "metadata": [FlattenedTensorMetadata]}`
where each entry names one tensor and its byte range `[start_idx, end_idx)` in
the flat buffer (the field names SGLang's own bucket uses, so either side can
read the other's metadata by attribute).

On CPU, ForkingPickler with the "file_system" sharing strategy moves each
tensor's storage to shared memory and pickles only its file name, so the bytes
never travel through HTTP. Each pickled storage holds a reference on its file
that the receiver drops when it unpickles, so the sender may free its tensors
right after serialising; a payload that is never unpickled leaks its files in
/dev/shm. Unpickling runs arbitrary code: only send to servers you trust
(SGLang has the same property; protect servers with `--api-key`).
"""

from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler

LOAD_FORMATS = (None, "direct", "flattened_bucket")

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class FlattenedTensorMetadata:
    """Where one tensor lives in a flattened bucket (byte offsets into the uint8 buffer)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def flatten_bucket(named_tensors: NamedTensors) -> dict[str, Any]:
    """Pack tensors of any dtypes into one uint8 buffer plus metadata."""
    if not named_tensors:
        raise ValueError("flatten_bucket: named_tensors is empty")
    parts: list[torch.Tensor] = []
    metadata: list[FlattenedTensorMetadata] = []
    offset = 0
    for name, tensor in named_tensors:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(flat)
        metadata.append(
            FlattenedTensorMetadata(
                name, tuple(tensor.shape), tensor.dtype, offset, offset + flat.numel(), flat.numel()
            )
        )
        offset += flat.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


def unflatten_bucket(bucket: Any) -> NamedTensors:
    """Inverse of `flatten_bucket`; accepts any metadata objects with SGLang's attribute names."""
    if not isinstance(bucket, dict) or "flattened_tensor" not in bucket or "metadata" not in bucket:
        raise ValueError("flattened_bucket payload must be a dict with 'flattened_tensor' and 'metadata'")
    flat = bucket["flattened_tensor"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.dtype != torch.uint8:
        raise ValueError("flattened_bucket: 'flattened_tensor' must be a 1-D uint8 tensor")
    named: NamedTensors = []
    for meta in bucket["metadata"]:
        if not 0 <= meta.start_idx <= meta.end_idx <= flat.numel():
            raise ValueError(
                f"flattened_bucket: tensor {meta.name!r} byte range [{meta.start_idx}, {meta.end_idx}) "
                f"is outside the {flat.numel()}-byte buffer"
            )
        piece = flat[meta.start_idx : meta.end_idx]
        if piece.numel() % meta.dtype.itemsize:
            raise ValueError(f"flattened_bucket: tensor {meta.name!r} byte count does not fit dtype {meta.dtype}")
        values = piece.view(meta.dtype)
        if values.numel() != _numel(meta.shape):
            raise ValueError(
                f"flattened_bucket: tensor {meta.name!r} has {values.numel()} elements, shape {tuple(meta.shape)} "
                f"needs {_numel(meta.shape)}"
            )
        named.append((meta.name, values.view(tuple(meta.shape))))
    return named


def serialize_named_tensors(named_tensors: NamedTensors, *, load_format: str | None = None) -> str:
    """One rank's `serialized_named_tensors` entry (base64 of a ForkingPickler pickle)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    # Without file_system sharing, CPU tensors would go through file descriptors
    # that do not survive the trip through an HTTP body.
    torch.multiprocessing.set_sharing_strategy("file_system")
    payload: Any = flatten_bucket(named_tensors) if load_format == "flattened_bucket" else list(named_tensors)
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(payload)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_named_tensors(serialized: str | bytes, *, load_format: str | None = None) -> NamedTensors:
    """Inverse of `serialize_named_tensors`; raises ValueError on a malformed payload."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    try:
        raw = base64.b64decode(serialized, validate=True)
        payload = pickle.loads(raw)
    except Exception as error:  # noqa: BLE001 - any decoding failure is a bad request
        raise ValueError(f"serialized_named_tensors is not a base64 ForkingPickler payload: {error}") from error
    if load_format == "flattened_bucket":
        return unflatten_bucket(payload)
    if not isinstance(payload, (list, tuple)) or not all(
        isinstance(item, (list, tuple))
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
        for item in payload
    ):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in payload]


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count
