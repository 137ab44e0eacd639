"""`run_spawned`'s ranks: forked, already imported, from one single-threaded server per session (on a machine
without CUDA), yet each as fresh as a spawned process where it matters: one OpenMP thread, the test's
environment, torch's initial RNG state, their own numpy and `random` streams, their own copy of the arguments."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import pytest
import torch

from _engine_spawn import START_METHOD, run_spawned

pytestmark = pytest.mark.dist


def probe(*, rank: int, world_size: int, port: int, tensor: torch.Tensor) -> dict:
    tensor.add_(rank)  # must not reach the other rank's copy
    preload = sys.modules.get("_spawn_preload")
    return {
        "pid": os.getpid(),
        "parent": os.getppid(),
        "parent_threads": len(os.listdir(f"/proc/{os.getppid()}/task")),
        "preloaded": None if preload is None else [name for name in preload.MODULES if name in sys.modules],
        "expected": None if preload is None else list(preload.MODULES),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
        "env": os.environ.get("MEGARL_SPAWN_PROBE"),
        "torch_draw": torch.rand(3),
        "numpy_draw": np.random.rand(2),
        "random_draw": random.random(),
        "tensor": tensor,
    }


def test_ranks_are_forked_preloaded_and_start_fresh(monkeypatch):
    monkeypatch.setenv("MEGARL_SPAWN_PROBE", "set by the test")
    first = run_spawned(probe, world_size=2, layout=None, tensor=torch.zeros(2))
    second = run_spawned(probe, world_size=2, layout=None, tensor=torch.zeros(2))
    ranks = first + second
    parents = {out["parent"] for out in ranks}
    if START_METHOD == "forkserver":
        # One server for both jobs, not pytest itself; single-threaded; everything preloaded.
        assert len(parents) == 1 and os.getpid() not in parents
        assert all(out["parent_threads"] == 1 for out in ranks)
        assert all(out["expected"] and out["preloaded"] == out["expected"] for out in ranks)
    else:  # CUDA: spawned by pytest, nothing preloaded
        assert parents == {os.getpid()} and all(out["preloaded"] is None for out in ranks)
    assert len({out["pid"] for out in ranks}) == 4
    assert all(out["omp"] == "1" and out["torch_threads"] == 1 for out in ranks)
    assert all(out["env"] == "set by the test" for out in ranks)
    fresh = torch.rand(3, generator=torch.Generator())  # a new process's default generator state
    assert all(torch.equal(out["torch_draw"], fresh) for out in ranks)
    # numpy and `random` seed themselves from the OS in a new process: four different streams.
    assert len({tuple(out["numpy_draw"]) for out in ranks}) == 4
    assert len({out["random_draw"] for out in ranks}) == 4
    assert [out["tensor"].tolist() for out in ranks] == [[0.0, 0.0], [1.0, 1.0]] * 2
