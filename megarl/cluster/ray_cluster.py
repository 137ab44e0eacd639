"""Starting or joining the Ray cluster the controller runs on.

A run without a cluster to join starts its own Ray head (`start_own_head`):
`ray start` on loopback in a session of its own, with its own port block, temp
dir and auth token (in the environment only). In a session of its own, Ray's
processes do not get a signal sent to the driver's process group (a shell's job
control, a container runtime): the driver gets it, checkpoints, and only then
stops Ray. Every process the head starts carries its mark (`megarl.processes`),
so stopping it leaves nothing behind, the multiprocessing children of killed
workers included; never `ray stop`, which stops every Ray on the machine.
`start_local_ray` (an in-process head, for the test session's shared cluster)
stays on loopback with its own temp dir too, so a stale
`/tmp/ray/ray_current_cluster` from another run is never joined.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from megarl.cluster.ray_ports import free_block
from megarl.processes import MARK_ENV, sweep
from megarl.quiet import hide_ray_backend_notices, verbose

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


def _loopback_env() -> None:
    """Ray on loopback, no usage reporting, no metrics: set before Ray is first imported, which reads it once."""
    for key, value in _RAY_ENV.items():
        os.environ.setdefault(key, value)


def _own_head_env() -> None:
    """Loopback, and a token only this run knows, in the environment only (the driver and the head read it
    from there): set before Ray is first imported."""
    _loopback_env()
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    # Ray gives its node a minute to come up; a busy machine (2 cores, a test suite) may need more.
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")


def start_local_ray(*, temp_dir: str, num_cpus: int | None = None, num_gpus: int | None = None) -> None:
    """Start an in-process Ray head on loopback (no dashboard, no metrics)."""
    _loopback_env()
    import ray

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
    hide_ray_backend_notices()


def connect_ray(address: str) -> None:
    """Join an existing cluster (one started by a launcher, or this run's own head)."""
    import ray

    if not ray.is_initialized():
        # Ray's INFO lines ("Connecting to existing Ray cluster at address ...") say nothing to a megarl user.
        ray.init(address=address, runtime_env={"env_vars": _worker_env()},
                 logging_level=logging.INFO if verbose() else logging.WARNING)
        hide_ray_backend_notices()


HEAD_START_TIMEOUT_S = 300.0  # as long as Ray itself gives a node to come up (RAY_raylet_start_wait_time_s)


def _head_failed(process: subprocess.Popen, log: Path, why: str) -> RuntimeError:
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    return RuntimeError(f"this run's Ray head (pid {process.pid}) {why}; its output:\n{tail}")


def start_own_head(cleanup: ExitStack, *, num_cpus: int) -> str:
    """Start a Ray head on loopback in a session of its own and join it; `cleanup` stops it and every process
    it started, then removes its temp dir, which is returned."""
    _own_head_env()
    temp_dir = new_temp_dir()
    cleanup.callback(shutil.rmtree, temp_dir, True)
    ports, mark = free_block(os.getpid()), f"ray-run-{os.getpid()}-{secrets.token_hex(4)}"
    named = ports.named()
    low, high = ports.worker_range
    # A session of its own, a subreaper, and a watchdog that stops it should this process die without doing so.
    argv = [sys.executable, "-m", "megarl.processes", "lead", str(os.getpid()),
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
            "--include-dashboard=false", "--node-ip-address=127.0.0.1", f"--port={named['gcs']}",
            f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}",
            f"--node-manager-port={named['node_manager']}", f"--object-manager-port={named['object_manager']}",
            f"--ray-client-server-port={named['client_server']}",
            f"--dashboard-agent-grpc-port={named['dashboard_agent_grpc']}",
            f"--dashboard-agent-listen-port={named['dashboard_agent_listen']}",
            f"--metrics-export-port={named['metrics_export']}",
            f"--runtime-env-agent-port={named['runtime_env_agent']}",
            f"--min-worker-port={low}", f"--max-worker-port={high}"]
    log = Path(temp_dir) / "head.out"
    with open(log, "wb") as output:
        process = subprocess.Popen(argv, env={**os.environ, MARK_ENV: mark}, stdout=output,
                                   stderr=subprocess.STDOUT)
    # Run in reverse order at the end, after ray.shutdown (registered later): every process of the head's
    # session and below it, then the head itself is reaped.
    cleanup.callback(_reap, process)
    cleanup.callback(sweep, mark, process.pid)
    _join_when_ready(named["gcs"], process, log)
    return temp_dir


# What `ray start` prints once its node has registered with the GCS (ray/scripts/scripts.py, both roles).
_HEAD_STARTED = "Ray runtime started."


def _join_when_ready(port: int, process: subprocess.Popen, log: Path) -> None:
    """Join the head on loopback `port` once `ray start` says its node registered.

    Not before: the GCS port answers a minute earlier on a busy machine, and a driver that joins then waits
    out Ray's own connect timeout, after which neither that attempt nor a retry in this process joined."""
    deadline = time.monotonic() + HEAD_START_TIMEOUT_S
    while _HEAD_STARTED not in log.read_text(errors="replace"):
        if process.poll() is not None:
            raise _head_failed(process, log, f"exited with status {process.returncode}")
        if time.monotonic() > deadline:
            raise _head_failed(process, log, f"did not start within {HEAD_START_TIMEOUT_S:.0f} s")
        time.sleep(0.5)
    connect_ray(f"127.0.0.1:{port}")


def _reap(process: subprocess.Popen) -> None:
    process.kill()  # the sweep before it killed it already, unless it had exited
    process.wait()


def ray_for_run(cleanup: ExitStack, address: str | None, *, num_cpus: int = 8) -> str | None:
    """Join the cluster at `address`, or (none given, none running) start this run's own head, which `cleanup`
    stops with everything it started; returns the head's temp dir (None when joining)."""
    if address:
        connect_ray(address)
        return None
    _own_head_env()
    import ray

    if not ray.is_initialized():
        temp_dir = start_own_head(cleanup, num_cpus=num_cpus)
        cleanup.callback(ray.shutdown)
        return temp_dir
    return None
