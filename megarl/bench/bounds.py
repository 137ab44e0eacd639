"""The device's matmul peak, measured in the same run as the MFU it is the denominator of.

`matmul_peak_tflops`: the best matmul rate of one device (on CPU one process slot,
i.e. one thread, as every engine rank runs with OMP_NUM_THREADS=1), used where no
datasheet peak is given. The weight-sync bounds belong to their transports
(`megarl.weightsync.bounds`, the `bound` of each `WEIGHT_SYNC_TRANSPORTS` entry).
"""

from __future__ import annotations

import time

import torch


def matmul_peak_tflops(*, device: str = "cpu", dtype: torch.dtype = torch.float32, threads: int = 1,
                       size: int | None = None, seconds: float = 1.0) -> float:
    """The best rate (TFLOP/s) of square `size` matmuls over about `seconds`, with `threads` CPU threads."""
    size = size or (8192 if device.startswith("cuda") else 512)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline or best == 0.0:
            _sync(device)
            start = time.perf_counter()
            torch.mm(a, b)
            _sync(device)
            best = max(best, 2 * size**3 / (time.perf_counter() - start))
        return best / 1e12
    finally:
        torch.set_num_threads(previous)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
