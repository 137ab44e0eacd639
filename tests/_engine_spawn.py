"""Run a multi-rank check in fresh spawned processes and bring its result back to pytest.

Megatron needs the CPU compatibility layer and process-global parallel state, so the
engine tests keep it out of the pytest process: `run_spawned(target, ...)` starts one
process per rank, each initialises torch.distributed + megatron at `layout`, calls
`target(rank=..., **kwargs)` and saves its return value; the test asserts on it. With
`layout=None` the target sets up its own process groups and gets `world_size` and the
rendezvous `port` too (the weight-sync ranks).
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from megarl.ports import free_port

def _entry(target, rank: int, world_size: int, port: int, layout: dict | None, kwargs: dict, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        if layout is None:
            result = target(rank=rank, world_size=world_size, port=port, **kwargs)
        else:
            from megarl.engines.distributed import destroy_distributed, init_distributed

            init_distributed(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, **layout)
            result = target(rank=rank, **kwargs)
            destroy_distributed()
        torch.save(result, Path(out_dir) / f"result{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


MEGATRON_TP1PP1 = {"tp": 1, "pp": 1}


def run_spawned(target, *, world_size: int = 1, layout: dict | None = MEGATRON_TP1PP1, timeout_s: float = 300,
                **kwargs) -> list:
    """`target`'s return value on each rank (rank order). Raises with the child's traceback on failure."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="megarl-engine-test-") as out_dir:
        procs = [
            ctx.Process(target=_entry, args=(target, rank, world_size, port, layout, kwargs, out_dir))
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        # Poll exit codes rather than join(): torch's shared-memory manager, started by a rank
        # that shares a tensor, inherits that rank's sentinel pipe and keeps join() waiting.
        deadline = time.monotonic() + timeout_s
        while any(proc.exitcode is None for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for proc in procs:  # only our own children, by handle
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        errors = sorted(Path(out_dir).glob("error*.txt"))
        if errors:
            raise AssertionError("engine process failed:\n" + "\n".join(e.read_text() for e in errors))
        codes = [proc.exitcode for proc in procs]
        if any(code != 0 for code in codes):
            raise AssertionError(f"engine processes exited with {codes} (timeout {timeout_s}s?)")
        return [torch.load(Path(out_dir) / f"result{rank}.pt", weights_only=False) for rank in range(world_size)]
