"""HF checkpoint tensors, read by slice: a safetensors checkpoint dir, or an in-memory HF state dict.

Both offer `shapes` (every tensor's name and shape, read from the file headers without
touching the data) and `copy_into(target, piece)`, which writes one `megarl.models.Piece`
(a range of one HF tensor along one dim) into `target`. `CheckpointSlices` reads through
safetensors' slice API in blocks of at most `READ_BLOCK_BYTES`, each through a memory
mapping that is closed before the next block, so a reader holds at most one block of
the file at a time, whatever the size of the tensor or the checkpoint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from megarl.models.layout import Piece, split_fused_experts
from megarl.models.spec import Arch

Tensor = torch.Tensor
# One slice read maps at most this much of a checkpoint file at a time (bytes of whole
# source rows; a column slice still reads whole rows), then unmaps it.
READ_BLOCK_BYTES = 64 << 20


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


class CheckpointSlices:
    """Slice reads from an HF safetensors checkpoint dir; nothing is read until `copy_into` asks for a slice."""

    def __init__(self, path: str | Path):
        self.files = checkpoint_files(path)
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.files.values())):
            with safe_open(str(file), framework="pt") as handle:
                self.shapes.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})

    def copy_into(self, target: Tensor, piece: Piece) -> None:
        """`target` <- the piece's slice of its HF tensor, read in row blocks.

        safetensors hands out slices as views of a memory mapping of the file; a block's
        mapping is closed before the next block is read, so the pages of at most one
        block count towards this process's memory at a time.
        """
        shape = self.shapes[piece.hf_name]
        rows = piece.length if piece.dim == 0 else shape[0]
        row_bytes = 4 * math.prod(shape[1:])  # 4: an upper bound on the element size
        step = max(1, READ_BLOCK_BYTES // row_bytes)
        for first in range(0, rows, step):
            last = min(rows, first + step)
            if piece.dim == 0:
                index = slice(piece.src_start + first, piece.src_start + last)
            else:
                index = (slice(first, last), slice(piece.src_start, piece.src_start + piece.length))
            with safe_open(str(self.files[piece.hf_name]), framework="pt") as handle:
                target.narrow(0, first, last - first).copy_(handle.get_slice(piece.hf_name)[index])


class StateDictSlices:
    """The same reads from an in-memory HF state dict (transformers 5's fused MoE experts are split first)."""

    def __init__(self, hf_sd: Mapping[str, Tensor], arch: Arch):
        self.tensors = split_fused_experts(hf_sd, arch)
        self.shapes = {name: tuple(tensor.shape) for name, tensor in self.tensors.items()}

    def copy_into(self, target: Tensor, piece: Piece) -> None:
        target.copy_(self.tensors[piece.hf_name].narrow(piece.dim, piece.src_start, piece.length))
