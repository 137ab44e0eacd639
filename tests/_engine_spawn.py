"""Run a multi-rank check in fresh rank processes and bring its result back to pytest.

Megatron needs the CPU compatibility layer and process-global parallel state, so the
engine tests keep it out of the pytest process: `run_spawned(target, ...)` starts one
process per rank, each initialises torch.distributed + megatron at `layout`, calls
`target(rank=..., **kwargs)` and saves its return value; the test asserts on it. With
`layout=None` the target sets up its own process groups and gets `world_size` and the
rendezvous `port` too (the weight-sync ranks).

Start-up dominated these jobs on 2 cores (each rank imported torch and megatron, ~9 CPU s), so
on a machine without CUDA the ranks fork from a forkserver: one server process per pytest
process (per xdist worker), started at the first job, imports `_spawn_preload` (torch, megatron,
the engines, transformers' tiny models and the targets' modules) once, and every rank is a fork
of it, already imported. Forking is safe there because the server has one thread (checked in
every rank) and OpenMP is pinned to one thread before torch loads; each rank resets the RNGs a
fresh process would have drawn anew.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from megarl.ports import free_port

# With CUDA the ranks are spawned (the `gpu` tests, which are not on the 2-core machine's clock): the engines
# then use CUDA and NCCL, and the CUDA driver is not fork-safe once a process has called into it; the server's
# `import megarl.engines` already asks torch.cuda whether a GPU exists, so a forked rank could lose its GPU.
START_METHOD = "spawn" if torch.cuda.is_available() else "forkserver"
# What the server imports before its first fork; `_spawn_preload` first sets the server's sys.path to pytest's,
# handed over in this variable.
PATHS_VAR = "MEGARL_FORKSERVER_PATHS"
mp.get_context("forkserver").set_forkserver_preload(["_spawn_preload"])
_START_LOCK = threading.Lock()


def _start_forkserver() -> None:
    """Start this session's forkserver unless it runs. Python 3.11's server ignores the sys.path it is given
    (later versions apply it), so pytest's goes through the environment, with tests/ on PYTHONPATH for
    `_spawn_preload` itself; the server puts both back as they were."""
    from multiprocessing import forkserver

    with _START_LOCK:
        saved = {name: os.environ.get(name) for name in ("PYTHONPATH", PATHS_VAR)}
        os.environ[PATHS_VAR] = json.dumps({"sys_path": sys.path, "pythonpath": saved["PYTHONPATH"]})
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), saved["PYTHONPATH"]]))
        try:
            forkserver.ensure_running()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _as_if_fresh() -> None:
    """Give a forked rank what a fresh process would start with: one thread in its server (a fork copies
    only the calling thread, so another thread's held locks would stay held forever), and the torch and
    numpy RNG states a new process draws (a fork inherits the server's; `random` reseeds itself)."""
    threads = len(os.listdir(f"/proc/{os.getppid()}/task"))
    if threads != 1:
        raise RuntimeError(f"the forkserver had {threads} threads when it forked this rank: forking is unsafe")
    torch.default_generator.set_state(torch.Generator().get_state())
    np.random.seed()


def _entry(target, rank: int, world_size: int, port: int, layout: dict | None, out_dir: str, env: dict,
           forked: bool) -> None:
    try:
        if forked:
            _as_if_fresh()
        os.environ.update(env)  # the test's environment at the job's start, as a spawned rank gets it
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        kwargs = torch.load(Path(out_dir) / "kwargs.pt", weights_only=False)
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
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        _start_forkserver()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="megarl-engine-test-") as out_dir:
        # Through a file rather than the process arguments: every rank gets its own copy, and a forkserver
        # takes at most ~250 file descriptors (one per shared tensor) with a new process.
        torch.save(kwargs, Path(out_dir) / "kwargs.pt")
        procs = [
            ctx.Process(target=_entry, args=(target, rank, world_size, port, layout, out_dir, dict(os.environ),
                                           START_METHOD == "forkserver"))
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        # Poll exit codes rather than join(): torch's shared-memory manager, started by a rank
        # that shares a tensor, inherits that rank's sentinel pipe and keeps join() waiting.
        deadline = time.monotonic() + timeout_s
        while any(proc.exitcode is None for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for proc in procs:  # only our own rank processes, by handle
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


def _captured(*, rank: int, world_size: int, port: int, call, args: tuple) -> tuple:
    """`call(*args)`, with everything this process writes to its stdout and stderr meanwhile (file descriptors
    1 and 2: a library's writes and a traceback's too)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = os.dup(1), os.dup(2)
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            result = call(*args)
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        return result, *(os.pread(f.fileno(), os.fstat(f.fileno()).st_size, 0).decode() for f in (out, err))


def run_captured(call, *args, timeout_s: float = 300) -> tuple:
    """(`call(*args)`, its stdout, its stderr) in one rank process, forked like `run_spawned`'s: what a fresh
    `python -c` subprocess shows, without importing torch and megatron again."""
    (result,) = run_spawned(_captured, layout=None, timeout_s=timeout_s, call=call, args=args)
    return result
