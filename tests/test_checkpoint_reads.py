"""What a rank asks of a safetensors file: exactly the bytes of its own slice, columns included.

`CheckpointSlices.copy_into` is fed row (dim 0) and column (dim 1: row-parallel, as
`o_proj` / `down_proj` are split over TP) pieces of a bf16 checkpoint, into float32
targets, with read blocks of a few rows. Every positioned read is recorded: together
they must be exactly the piece's byte ranges (each TP rank's columns, nothing of its
neighbours'), none larger than a block, with the kernel's read-ahead off and each read
announced to the kernel (and nothing else) before it is made. The values must equal safetensors' own read of the same slice.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megarl.engines import hf_reader
from megarl.models.layout import Piece

ROWS, COLS = 24, 40


@pytest.fixture
def checkpoint(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"w2d": torch.randn(ROWS, COLS, generator=gen).to(torch.bfloat16),
               "w3d": torch.randn(6, COLS, 3, generator=gen).to(torch.bfloat16),
               "norm": torch.randn(COLS, generator=gen).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path, tensors


@pytest.fixture
def reads(monkeypatch):
    """Every (offset, bytes) asked through os.preadv, and every posix_fadvise advice given."""
    record = {"reads": [], "advice": []}
    real_preadv, real_fadvise = os.preadv, os.posix_fadvise

    def preadv(fd, buffers, offset):
        record["reads"].append((offset, sum(len(b) for b in buffers)))
        return real_preadv(fd, buffers, offset)

    def fadvise(fd, offset, length, advice):
        record["advice"].append((offset, length, advice))
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(hf_reader, "READ_BLOCK_BYTES", 5 * COLS * 2)  # 5 full rows of w2d per block
    return record


def _byte_ranges(stored: hf_reader.StoredTensor, piece: Piece) -> set[int]:
    """Every byte of the file that holds an element of `piece`, from the tensor's shape alone."""
    shape, size = stored.shape, 2  # bf16
    inner = 1
    for extent in shape[piece.dim + 1:]:
        inner *= extent
    outer = 1
    for extent in shape[: piece.dim]:
        outer *= extent
    wanted = set()
    for row in range(outer):
        start = stored.offset + (row * shape[piece.dim] + piece.src_start) * inner * size
        wanted.update(range(start, start + piece.length * inner * size))
    return wanted


@pytest.mark.parametrize("name, dim, tp", [("w2d", 1, 2), ("w2d", 1, 4), ("w2d", 0, 3), ("w3d", 1, 2),
                                            ("norm", 0, 2)])
def test_each_tp_rank_reads_exactly_its_own_bytes(checkpoint, reads, name, dim, tp):
    path, tensors = checkpoint
    source = hf_reader.CheckpointSlices(path)
    full = tensors[name]
    length = full.shape[dim] // tp
    for rank in range(tp):
        piece = Piece(hf_name=name, dim=dim, src_start=rank * length, dst_start=0, length=length)
        reads["reads"].clear()
        reads["advice"].clear()
        target = torch.zeros(full.narrow(dim, 0, length).shape, dtype=torch.float32)
        source.copy_into(target, piece)
        assert torch.equal(target, full.narrow(dim, rank * length, length).float())
        with safe_open(str(path / "model.safetensors"), framework="pt") as handle:  # safetensors' own reading
            index = tuple([slice(None)] * dim + [slice(rank * length, (rank + 1) * length)])
            assert torch.equal(target, handle.get_slice(name)[index].float())
        asked = set()
        for offset, nbytes in reads["reads"]:
            assert nbytes <= hf_reader.READ_BLOCK_BYTES
            span = set(range(offset, offset + nbytes))
            assert not span & asked  # nothing read twice
            asked |= span
        assert asked == _byte_ranges(source.stored[name], piece)
        # No read-ahead into the other ranks' bytes; each range read was announced first, and only those.
        assert reads["advice"][0] == (0, 0, os.POSIX_FADV_RANDOM)
        assert sorted(reads["advice"][1:]) == sorted((offset, nbytes, os.POSIX_FADV_WILLNEED)
                                                     for offset, nbytes in reads["reads"])


def test_a_slice_along_another_dim_is_refused_by_name(checkpoint):
    path, _ = checkpoint
    piece = Piece(hf_name="w3d", dim=2, src_start=0, dst_start=0, length=1)
    with pytest.raises(ValueError, match="w3d: slices along dim 2"):
        hf_reader.CheckpointSlices(path).copy_into(torch.zeros(6, COLS, 1), piece)
