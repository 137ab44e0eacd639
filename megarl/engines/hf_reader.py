"""HF checkpoint tensors, read by slice: a safetensors checkpoint dir, or an in-memory HF state dict.

Both offer `shapes` (every tensor's name and shape, read from the file headers without
touching the data) and `copy_into(target, piece)`, which writes one `megarl.models.Piece`
(a range of one HF tensor along one dim) into `target`. `CheckpointSlices` reads exactly
the bytes of the piece with positioned reads (`os.preadv`), located through the
safetensors header (8 bytes of header length, a JSON header giving each tensor's dtype,
shape and byte range, then the data), in blocks of at most `READ_BLOCK_BYTES` staged in
host memory: a reader holds at most one block, whatever the size of the tensor or the
checkpoint. A row-parallel piece (split along dim 1: `o_proj`, `down_proj`) is one run of
columns per row; each rank reads only its own runs. The kernel's read-ahead is off
(`POSIX_FADV_RANDOM`): it would pull in the other ranks' columns around each run, and
megabytes past the end of each row range (a disk's read-ahead window is often 8 MiB).
Through a memory mapping (safetensors' slice API) every rank faulted in whole rows, so
TP ranks each read the whole row-parallel tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from megarl.models.layout import Piece, split_fused_experts
from megarl.models.spec import Arch

Tensor = torch.Tensor
# At most this many bytes of a checkpoint are staged in host memory at a time by one slice read.
READ_BLOCK_BYTES = 16 << 20
# safetensors' dtype names (its format specification).
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """{tensor name: safetensors file} of an HF checkpoint dir (`model.safetensors` or a sharded index)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    if (path / "model.safetensors").exists():
        with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
            return {name: path / "model.safetensors" for name in handle.keys()}
    raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")


def read_tensor(path: str | Path, name: str) -> Tensor | None:
    """The whole tensor `name` of the checkpoint dir `path` (for small ones, such as a score head), or None."""
    file = checkpoint_files(path).get(name)
    if file is None:
        return None
    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(name)


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are in its safetensors file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the first element in the file


def read_header(file: Path) -> dict[str, StoredTensor]:
    """Every tensor of one safetensors file, from its header alone."""
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    data_start = 8 + length
    stored = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: tensor {name} has dtype {info['dtype']}, which megarl does not read")
        stored[name] = StoredTensor(file, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]),
                                    data_start + info["data_offsets"][0])
    return stored


def _read_exactly(fd: int, buffer: memoryview, offset: int) -> None:
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got == 0:
            raise EOFError(f"file ends before byte {offset + len(buffer)}")
        done += got


class CheckpointSlices:
    """Slice reads from an HF safetensors checkpoint dir; nothing is read until `copy_into` asks for a slice."""

    def __init__(self, path: str | Path):
        self.files = checkpoint_files(path)
        self.stored: dict[str, StoredTensor] = {}
        for file in sorted(set(self.files.values())):
            self.stored.update(read_header(file))
        self.shapes: dict[str, tuple[int, ...]] = {name: stored.shape for name, stored in self.stored.items()}
        # One staging buffer for every read, grown to the largest block asked for: a fresh block per
        # piece would leave freed blocks behind in the allocator next to the new one.
        self._staging = torch.empty(0, dtype=torch.uint8)

    def copy_into(self, target: Tensor, piece: Piece) -> None:
        """`target` <- the piece's slice of its HF tensor, read block by block into host memory.

        Along dim 0 the slice is one contiguous byte range; along dim 1 it is one run of
        `piece.length` columns per row, each read on its own. Read-ahead is off, so the
        neighbouring ranks' rows and columns stay on disk; instead each block's exact ranges
        are announced (`POSIX_FADV_WILLNEED`) before they are read, so the kernel fetches them
        all at once rather than one row after the other (three times slower from a cold cache).
        """
        stored = self.stored[piece.hf_name]
        if piece.dim not in (0, 1):
            raise ValueError(f"{piece.hf_name}: slices along dim {piece.dim} are not read (only dims 0 and 1)")
        shape, itemsize = stored.shape, torch.empty((), dtype=stored.dtype).element_size()
        inner = math.prod(shape[piece.dim + 1:])
        run_bytes = piece.length * inner * itemsize  # one row's slice (dim 1), or one row (dim 0)
        if piece.dim == 0:
            rows, row_bytes, stride = piece.length, inner * itemsize, inner * itemsize
            first = stored.offset + piece.src_start * row_bytes
        else:
            rows, row_bytes, stride = shape[0], run_bytes, shape[1] * inner * itemsize
            first = stored.offset + piece.src_start * inner * itemsize
        block_rows = max(1, READ_BLOCK_BYTES // row_bytes)
        if self._staging.numel() < min(rows, block_rows) * row_bytes:
            self._staging = torch.empty(0, dtype=torch.uint8)  # the old one goes before the new one comes
            self._staging = torch.empty(min(rows, block_rows) * row_bytes, dtype=torch.uint8)
        staging = self._staging
        fd = os.open(stored.file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            view = memoryview(staging.numpy())
            for start in range(0, rows, block_rows):
                count = min(block_rows, rows - start)
                if piece.dim == 0:  # whole rows: one range
                    ranges = [(0, first + start * row_bytes, count * row_bytes)]
                else:  # one run of columns per row
                    ranges = [(row * row_bytes, first + (start + row) * stride, row_bytes) for row in range(count)]
                for _, offset, nbytes in ranges:  # the kernel starts reading all of them at once
                    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
                for at, offset, nbytes in ranges:
                    _read_exactly(fd, view[at : at + nbytes], offset)
                block = staging[: count * row_bytes].view(stored.dtype).view(count, *target.shape[1:])
                target.narrow(0, start, count).copy_(block)
        finally:
            os.close(fd)


class StateDictSlices:
    """The same reads from an in-memory HF state dict (transformers 5's fused MoE experts are split first)."""

    def __init__(self, hf_sd: Mapping[str, Tensor], arch: Arch):
        self.tensors = split_fused_experts(hf_sd, arch)
        self.shapes = {name: tuple(tensor.shape) for name, tensor in self.tensors.items()}

    def copy_into(self, target: Tensor, piece: Piece) -> None:
        target.copy_(self.tensors[piece.hf_name].narrow(piece.dim, piece.src_start, piece.length))
