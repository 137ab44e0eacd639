"""Starting or joining the Ray cluster the controller runs on.

A local cluster lives on loopback with its own temp dir, so a stale
`/tmp/ray/ray_current_cluster` from another run is never joined, and it is
stopped by `ray.shutdown()` (by the PIDs it started), never by `ray stop`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import ExitStack

# Worker processes inherit these: loopback only, no usage reporting, one
# OpenMP thread per rank (without it, measured step times on 2 cores swung 60x).
_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_prestart_worker_first_driver": "0",
    "RAY_enable_metrics_collection": "0",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _worker_env() -> dict[str, str]:
    keep = ("PYTHONPATH", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
            "MEGARL_")
    env = {k: v for k, v in os.environ.items() if k.startswith(keep)}
    env.update({k: os.environ.get(k, v) for k, v in _RAY_ENV.items()})
    return env


# Ray puts Unix sockets at <temp>/session_<date>_<time>_<pid>/sockets/plasma_store, and a
# socket path may be at most 107 bytes: the temp dir itself must stay short.
_MAX_TEMP_DIR_CHARS = 40


def new_temp_dir() -> str:
    """A fresh temp dir for a local Ray cluster: under $TMPDIR when that path is short enough, else under /tmp."""
    base = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="megarl-ray-", dir=base if len(base) <= _MAX_TEMP_DIR_CHARS - 20 else "/tmp")


def start_local_ray(*, temp_dir: str, num_cpus: int | None = None, num_gpus: int | None = None) -> None:
    """Start an in-process Ray head on loopback (no dashboard, no metrics)."""
    import ray

    for key, value in _RAY_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        return
    ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        _temp_dir=temp_dir,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        runtime_env={"env_vars": _worker_env()},
    )


def connect_ray(address: str) -> None:
    """Join an existing cluster (e.g. one started by the Slurm launcher)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, runtime_env={"env_vars": _worker_env()})


def ray_for_run(cleanup: ExitStack, address: str | None, *, num_cpus: int = 8) -> None:
    """Join the cluster at `address`, or (none given, none running) start a local one that `cleanup` shuts down
    and whose temp dir it removes."""
    import ray

    if address:
        connect_ray(address)
    elif not ray.is_initialized():
        temp_dir = new_temp_dir()
        cleanup.callback(shutil.rmtree, temp_dir, True)
        start_local_ray(temp_dir=temp_dir, num_cpus=num_cpus)
        cleanup.callback(ray.shutdown)
