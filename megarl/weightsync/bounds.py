"""What bounds each weight-sync transport, measured on this machine: the figure `megarl bench` sets a sync against.

A transport's registry entry (`megarl.registry.WEIGHT_SYNC_TRANSPORTS`) carries its
`bound`, a `SyncBound`: the name the report shows and a function that measures the
bound's seconds for the bytes a step synced. The measurements:

- `memcpy_seconds`: one single-threaded copy of the bytes, both buffers already
  touched (the bound of the `tensor` transport).
- `broadcast_seconds`: a raw gloo (or NCCL) broadcast of the same pieces between
  two fresh processes (the bound of the `distributed` transport).
- `disk_seconds`: writing the bytes to a file and reading them back (the bound
  of the `disk` transport, which writes without fsync, as this does).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.ports import free_port


@dataclass(frozen=True)
class SyncBound:
    """A transport's bound: its `name` in reports and `seconds(nbytes, *, bucket_bytes, scratch_dir, device)`,
    the measured seconds of the bound for `nbytes` synced in buckets of `bucket_bytes` (`scratch_dir`: a
    directory it may write to; `device`: "cuda" or "cpu", the run's placement)."""

    name: str
    seconds: Callable[..., float]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def memcpy_seconds(nbytes: int, repeats: int = 5, before_each: Callable[[], object] = lambda: None) -> float:
    """Median seconds of one single-threaded copy of `nbytes` (both buffers touched first: no page faults);
    `before_each` runs before every timed copy (a barrier, to copy at the same moment as another process)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source = torch.ones(nbytes, dtype=torch.uint8)
        target = torch.zeros(nbytes, dtype=torch.uint8)
        times = []
        for _ in range(repeats):
            before_each()
            start = time.perf_counter()
            target.copy_(source)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        torch.set_num_threads(previous)


def _broadcast_rank(rank: int, port: int, sizes: list[int], backend: str, result) -> None:
    """One of the two processes of `broadcast_seconds`: rank 0 sends `sizes` pieces, rank 1 receives them."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffer = torch.ones(max(sizes), dtype=torch.uint8, device=device)
    torch.distributed.broadcast(buffer[: min(sizes)], src=0)  # connections up before the clock starts
    torch.distributed.barrier()
    _sync(device)
    start = time.perf_counter()
    for size in sizes:
        torch.distributed.broadcast(buffer[:size], src=0)
    _sync(device)
    torch.distributed.barrier()
    if rank == 0:
        result.value = time.perf_counter() - start
    torch.distributed.destroy_process_group()


def broadcast_seconds(sizes: list[int], *, backend: str = "gloo", timeout_s: float = 600.0) -> float:
    """Seconds to broadcast pieces of `sizes` bytes from one fresh process to another (`nccl`: GPUs 0 and 1)."""
    context = multiprocessing.get_context("spawn")
    result = context.Value("d", -1.0)
    port = free_port()
    procs = [context.Process(target=_broadcast_rank, args=(rank, port, sizes, backend, result)) for rank in range(2)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    if any(proc.exitcode != 0 for proc in procs) or result.value < 0:
        raise RuntimeError(f"{backend} broadcast bound: processes exited with {[p.exitcode for p in procs]}")
    return result.value


def disk_seconds(nbytes: int, directory: str | Path) -> float:
    """Seconds to write `nbytes` to a new file in `directory` (no fsync) and read them back; the file is removed."""
    data = torch.ones(nbytes, dtype=torch.uint8).numpy()
    into = bytearray(nbytes)
    path = Path(directory) / f".megarl-disk-bound-{os.getpid()}"
    Path(directory).mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        with open(path, "wb") as handle:
            handle.write(memoryview(data))
        with open(path, "rb") as handle:
            handle.readinto(into)
        return time.perf_counter() - start
    finally:
        path.unlink(missing_ok=True)
