"""What the forkserver of `_engine_spawn.run_spawned` imports once per test session, before its first fork;
imported in that server process only. Every rank forked from it then starts with these imported
(torch and megatron alone cost each spawned rank ~9 CPU s on 2 cores).

None of them may start a thread at import: the server must be single-threaded when it forks (every rank
checks, and `test_engine_spawn` too). A module missing here is only imported again by the ranks that use it.
"""

import json
import os
import sys

# The server's own sys.path and PYTHONPATH: pytest's, as `_engine_spawn._start_forkserver` handed them over.
_paths = json.loads(os.environ.pop("MEGARL_FORKSERVER_PATHS"))
sys.path[:] = _paths["sys_path"]
if _paths["pythonpath"] is None:
    del os.environ["PYTHONPATH"]
else:
    os.environ["PYTHONPATH"] = _paths["pythonpath"]

# Before torch loads: OpenMP sizes its thread pool from it, and a fork does not take a pool's threads along.
os.environ["OMP_NUM_THREADS"] = "1"

import importlib  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(1)

MODULES = (
    "megarl.engines",  # first: its torch.cuda stubs must precede every megatron import (megarl/engines/__init__.py)
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.pipeline_parallel",
    "megatron.core.transformer.moe",
    "megarl.engines.distributed",
    "megarl.engines.actor",
    "megarl.engines.critic",
    "megarl.engines.reward_model",
    "megarl.engines.checkpoint",
    "megarl.engines.export",
    "megarl.engines.lora_export",
    "megarl.engines.offload",
    "megarl.weightsync",
    "megarl.rollout.client",
    # What a CPU-engine server imports before it serves (`_server_fork` forks servers from here).
    "uvicorn",
    "megarl.rollout.cpu_engine.__main__",
    "megarl.rollout.cpu_engine.engine",
    "megarl.rollout.cpu_engine.http_server",
    "megarl.rollout.cpu_engine.weights",
    # The targets' modules, and what the test modules that hold targets import (a rank imports that module).
    "pytest",
    "_tiny",
    "_engine_workers",
    "_lora_workers",
    "_plan_ranks",
    "_weightsync_ranks",
    "_recipe_values",
    "_engine_spawn",
    "_server_fork",
)

for name in MODULES:
    importlib.import_module(name)
