"""Launching engine servers as subprocesses, waiting for them, and stopping them by PID.

`start_cpu_engine` runs `python -m megarl.rollout.cpu_engine` in its own
process group with its output in a log file, and returns once `/health`
answers 200. A server that exits early or never becomes healthy raises
`ServerStartError` carrying the tail of its log. Servers bind to 127.0.0.1
unless told otherwise. The pieces (`cpu_engine_command`, `spawn_server`,
`wait_healthy`) are also used by the fleet, whose servers may be SGLang
processes owned by Ray actors.

No secret is ever on a command line (every local user can read
`/proc/<pid>/cmdline`): the API key travels in a YAML file only its owner can
read (`write_secrets`), named by `--config FILE.yaml`, which SGLang 0.5.23 and
the CPU engine both read their arguments from (the command line wins over it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from megarl.ports import free_port
from megarl.processes import blocked_sigterm, stop_signal

LOG_TAIL_CHARS = 4000


class ServerStartError(RuntimeError):
    """The engine process exited or never became healthy; the message ends with its log tail."""


@dataclass
class ServerHandle:
    """A running engine process: its URL, PID, log file and API key."""

    url: str
    process: subprocess.Popen  # or what has its pid, returncode, poll() and wait(timeout)
    log_path: Path
    api_key: str | None = None
    stop_signal: int = signal.SIGTERM  # SIGINT where the server runs shielded from SIGTERM (megarl.processes)
    secrets_path: Path | None = None  # the --config file holding the key, removed once the server stops
    _stopped: bool = field(default=False, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Signal the server's process group (`stop_signal`), then SIGKILL it if it has not exited in `timeout_s`."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.process.poll() is not None:
                return
            # The server was started in its own session, so its process group id is its PID.
            _signal_group(self.process.pid, self.stop_signal)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=timeout_s)
        finally:
            if self.secrets_path is not None:
                self.secrets_path.unlink(missing_ok=True)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def write_secrets(path: str | Path, values: dict[str, str]) -> Path:
    """Write `values` (flag name -> value) as a `--config` YAML file that only its owner can read or write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a file left by another start keeps its old mode; start afresh
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        yaml.safe_dump(values, file)
    return path


def secrets_path_for(log_path: str | Path) -> Path:
    """Where the secrets of the server logging to `log_path` go: beside its log, `<log stem>.secrets.yaml`."""
    log_path = Path(log_path)
    return log_path.with_name(f"{log_path.stem}.secrets.yaml")


def cpu_engine_command(
    model_path: str | Path,
    *,
    host: str,
    port: int,
    config: str | Path | None = None,
    threads: int = 1,
    tokenizer_path: str | Path | None = None,
    max_batch: int = 256,
    weight_version: str | None = None,
    seed: int | None = None,
    log_level: str = "info",
    dtype: str | None = None,
    enable_memory_saver: bool = False,
    enable_weights_cpu_backup: bool = False,
    health_check_timeout_s: float | None = None,
    weight_update_group_timeout_s: float | None = None,
    max_request_bytes: int | None = None,
    max_sequences: int | None = None,
    max_reply_entries: int | None = None,
    deterministic: bool = False,
    enable_lora: bool = False,
    max_lora_rank: int | None = None,
    lora_target_modules: list[str] | None = None,
    lora_paths: list[str] | None = None,
    max_loras_per_batch: int | None = None,
    max_loaded_loras: int | None = None,
    device_memory_bytes: int | None = None,
    mem_fraction_static: float | None = None,
    max_total_tokens: int | None = None,
) -> list[str]:
    """The argv that runs one CPU engine server (LoRA and KV-pool flags as SGLang's); `config` is a file of further
    arguments (the API key)."""
    command = [sys.executable, "-m", "megarl.rollout.cpu_engine", "--model-path", str(model_path)]
    command += ["--host", host, "--port", str(port), "--threads", str(threads), "--max-batch", str(max_batch)]
    command += ["--log-level", log_level]
    optional = {"--config": config, "--tokenizer-path": tokenizer_path, "--weight-version": weight_version,
                "--seed": seed, "--dtype": dtype, "--health-check-timeout-s": health_check_timeout_s,
                "--weight-update-group-timeout-s": weight_update_group_timeout_s,
                "--max-request-bytes": max_request_bytes, "--max-sequences": max_sequences,
                "--max-reply-entries": max_reply_entries, "--max-lora-rank": max_lora_rank,
                "--max-loras-per-batch": max_loras_per_batch, "--max-loaded-loras": max_loaded_loras,
                "--device-memory-bytes": device_memory_bytes, "--mem-fraction-static": mem_fraction_static,
                "--max-total-tokens": max_total_tokens}
    for flag, value in optional.items():
        if value is not None:
            command += [flag, str(value)]
    for flag, values in (("--lora-target-modules", lora_target_modules), ("--lora-paths", lora_paths)):
        if values:
            command += [flag, *map(str, values)]
    switches = {"--enable-memory-saver": enable_memory_saver, "--enable-weights-cpu-backup": enable_weights_cpu_backup,
                "--enable-deterministic-inference": deterministic, "--enable-lora": enable_lora}
    return command + [flag for flag, on in switches.items() if on]


def spawn_server(command: list[str], *, url: str, log_path: str | Path, env: dict[str, str] | None = None,
                 api_key: str | None = None, secrets_path: Path | None = None) -> ServerHandle:
    """Start `command` in its own session with stdout+stderr appended to `log_path`; does not wait.

    Below a launched job's Ray node the server starts with SIGTERM blocked, as the node itself: only the
    driver acts on Slurm's SIGTERM, and stops the server (with SIGINT) once it no longer needs it."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log, blocked_sigterm():
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
        )
    return ServerHandle(url=url, process=process, log_path=log_path, api_key=api_key, stop_signal=stop_signal(),
                        secrets_path=secrets_path)


def start_cpu_engine(
    model_path: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    api_key: str | None = None,
    threads: int = 1,
    log_path: str | Path | None = None,
    env: dict[str, str] | None = None,
    startup_timeout_s: float = 120.0,
    spawn: Callable[..., ServerHandle] = spawn_server,
    **options: Any,
) -> ServerHandle:
    """Start one CPU engine server and wait until it is healthy; `options` are `cpu_engine_command`'s.

    `spawn` starts the process (`spawn_server`'s arguments); the tests pass one that forks the server from a
    process that has already imported torch and transformers."""
    port = port if port is not None else free_port(host)
    if log_path is None:
        handle, name = tempfile.mkstemp(prefix=f"megarl-cpu-engine-{port}-", suffix=".log")
        os.close(handle)
        log_path = name
    secrets = write_secrets(secrets_path_for(log_path), {"api-key": api_key}) if api_key else None
    command = cpu_engine_command(model_path, host=host, port=port, config=secrets, threads=threads, **options)
    # Each engine owns `threads` cores at most; more OpenMP threads only thrash shared CPUs.
    process_env = {**(env or {}), "OMP_NUM_THREADS": str(threads)}
    server = spawn(command, url=f"http://{host}:{port}", log_path=log_path, env=process_env, api_key=api_key,
                   secrets_path=secrets)
    try:
        wait_healthy(server.url, exit_code=server.process.poll, log_tail=server.log_tail,
                     timeout_s=startup_timeout_s, what=f"CPU engine (log {server.log_path})")
    except BaseException:
        server.stop()
        raise
    return server


def wait_healthy(
    url: str,
    *,
    exit_code: Callable[[], int | None],
    log_tail: Callable[[], str],
    timeout_s: float,
    what: str = "server",
    interval_s: float = 0.1,
) -> None:
    """Poll `url`/health until it answers 200; ServerStartError with the log tail if the process exits or time runs out.

    `exit_code` and `log_tail` are callables so the process may live elsewhere (a Ray actor on another node).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        code = exit_code()
        if code is not None:
            raise ServerStartError(
                f"{what} at {url} exited with status {code} before becoming healthy; log tail:\n{log_tail()}"
            )
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            raise ServerStartError(f"{what} at {url} not healthy after {timeout_s:.0f} s; log tail:\n{log_tail()}")
        time.sleep(interval_s)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
