"""CPU-engine servers for tests, forked from the session's forkserver rather than started as fresh processes.

A fresh `python -m megarl.rollout.cpu_engine` spends ~9 CPU s of its start importing torch, transformers'
model-loading modules and the HTTP stack, before it reads a weight (measured on the 2-core machine: 9.5 CPU s
to healthy, fresh; 0.8 forked). The forkserver of `_engine_spawn` has imported all of that once
(`_spawn_preload`), so `fork_server` (a `spawn_server` for `start_cpu_engine(spawn=...)`) forks the server from
it: the child checks it was forked from a single-threaded server and draws fresh RNG states, as a rank does,
leads a session of its own, appends its output to the log, takes the test's environment, then runs the
engine's own `__main__.main` on the very argv a fresh process gets. From there on it is the same program:
`start_cpu_engine` waits for its health, and `ServerHandle.stop` signals its process group, as for any other.

What only a fresh process shows (its command line in /proc, a start from a bare interpreter) is tested on
servers started with the default `spawn_server`; so are every server the fleet starts (through
`ServerHost`, in Ray actors) and every end-to-end run's. With CUDA, forking is unsafe (`_engine_spawn`),
and `fork_server` starts the process afresh.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import torch.multiprocessing as mp

from _engine_spawn import START_METHOD, _as_if_fresh, _start_forkserver
from megarl.processes import stop_signal
from megarl.rollout.server import ServerHandle, spawn_server

ENGINE_MODULE = "megarl.rollout.cpu_engine"


class ForkedProcess:
    """The part of `subprocess.Popen` a `ServerHandle` uses (pid, poll, wait, returncode), for a process forked
    by the forkserver: not this process's child, so its exit status comes through the forkserver's pipe."""

    def __init__(self, process: mp.Process):
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        # Polled, not joined: a torch shared-memory manager the server starts may hold its sentinel pipe open.
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._process.exitcode is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked CPU engine {self.pid}", timeout)
            time.sleep(0.05)
        return self._process.exitcode


def _serve(argv: list[str], log_path: str, env: dict[str, str]) -> None:
    """In the forked child: become what `spawn_server`'s Popen makes (a session leader writing to the log, with
    the test's environment), then run the engine as `python -m megarl.rollout.cpu_engine ARGV` would."""
    _as_if_fresh()
    os.setsid()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(env)
    from megarl.rollout.cpu_engine.__main__ import main

    main(argv)


def fork_server(command: list[str], *, url: str, log_path: str | Path, env: dict[str, str] | None = None,
                api_key: str | None = None, secrets_path: Path | None = None) -> ServerHandle:
    """`spawn_server` for a CPU-engine `command`, forked from the forkserver (see the module docstring)."""
    if START_METHOD != "forkserver":
        return spawn_server(command, url=url, log_path=log_path, env=env, api_key=api_key, secrets_path=secrets_path)
    python, flag, module, *argv = command
    if (flag, module) != ("-m", ENGINE_MODULE):
        raise ValueError(f"fork_server starts the CPU engine only, not {command[:3]}")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _start_forkserver()
    process = mp.get_context("forkserver").Process(target=_serve, args=(argv, str(log_path),
                                                                       {**os.environ, **(env or {})}))
    process.start()
    return ServerHandle(url=url, process=ForkedProcess(process), log_path=log_path, api_key=api_key,
                        stop_signal=stop_signal(), secrets_path=secrets_path)
