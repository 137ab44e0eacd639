"""The owner of one rollout server's process: a Ray actor on the server's bundle, or the driver itself.

`ServerHost` starts the server (megarl's CPU engine, or `sglang.launch_server`
with `sglang_server_argv`), restarts it on the same port when it can, reports
its URL, PID and exit status, and keeps its output in `<log_dir>/rollout-<i>.log`
(one log per server, appended across restarts). It never waits for health:
the driver does, so one slow server does not hold up an actor call.

`start_hosts` creates one host per server: `use_ray=True` makes each a Ray
actor with the options of its `HostPlacement` (which the controller builds:
scheduling strategy, resources, the GPUs its server uses); otherwise the hosts
live in the driver (tests, single-process runs). Placement groups and GPU
discovery are the controller's business; this module only takes their result.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from megarl.net import node_address
from megarl.oom import RoleOutOfMemory, memory_kill
from megarl.ports import free_port, port_is_free
from megarl.processes import shield_ray_actor
from megarl.rollout.server import (
    LOG_TAIL_CHARS,
    ServerHandle,
    cpu_engine_command,
    secrets_path_for,
    spawn_server,
    write_secrets,
)

LOOPBACK = "127.0.0.1"
BACKENDS = ("cpu", "sglang")


@dataclass(frozen=True)
class ServerSpec:
    """How every server of a fleet is started (server i differs only in its port and log file)."""

    backend: str  # "cpu" (megarl's CPU engine) or "sglang"
    model_path: str
    log_dir: str
    api_key: str | None = None
    bind: str = "loopback"  # "loopback", "node" (the node's address: megarl.net.node_address) or an address
    port: int | None = None  # server i first tries port + i; None: any free port
    weight_version: str = "default"
    tokenizer_path: str | None = None
    threads: int = 1  # CPU engine: torch threads
    tp: int = 1  # SGLang: tensor-parallel size
    mem_fraction: float = 0.8  # SGLang: --mem-fraction-static
    sglang_args: dict[str, Any] = field(default_factory=dict)  # the recipe's rollout.sglang block
    skip_tokenizer_init: bool = True
    enable_memory_saver: bool = False  # allow /release_memory_occupation (colocated GPUs)
    enable_weights_cpu_backup: bool = False  # resumed weights come back from a host copy
    seed: int | None = None
    # LoRA serving (`--enable-lora`): the largest adapter rank and the HF modules adapters may target
    lora_max_rank: int | None = None
    lora_target_modules: tuple[str, ...] = ()
    deterministic: bool = False  # --enable-deterministic-inference: each request's sampling_seed is honoured
    max_sequences: int | None = None  # CPU engine: most sequences (prompts x n) one request may ask for

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"ServerSpec.backend must be one of {BACKENDS}, got {self.backend!r}")


def bind_address(bind: str) -> str:
    """The address a server listens on for a `bind` setting."""
    if bind in ("loopback", "localhost", LOOPBACK):
        return LOOPBACK
    if bind == "node":
        return node_address()
    return bind


def current_node_id() -> str | None:
    """The Ray node this process runs on (None without Ray): tells servers on other nodes from local ones."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


@dataclass(frozen=True)
class HostPlacement:
    """Where server i's host runs and what its server uses: Ray actor options (resources, a scheduling
    strategy), the GPU ids to expose to the server process, and those GPUs' UUIDs (by server TP rank)."""

    actor_options: dict[str, Any] = field(default_factory=dict)
    gpu_ids: tuple[int, ...] | None = None
    device_uuids: tuple[str, ...] | None = None


class ServerHost:
    """Starts, restarts, polls and stops the process of server `index`; once closed it starts nothing."""

    def __init__(self, spec: ServerSpec, index: int, gpu_ids: list[int] | None = None):
        shield_ray_actor()  # under a launcher, SIGTERM is the driver's: it may still need this server
        self.spec, self.index, self.gpu_ids = spec, index, gpu_ids
        self.address = bind_address(spec.bind)
        # Listening on every interface still needs one address that others can reach.
        self.reachable = bind_address("node") if self.address == "0.0.0.0" else self.address
        self.log_path = Path(spec.log_dir) / f"rollout-{index}.log"
        self.port: int | None = None
        self.server: ServerHandle | None = None
        self.starts = 0
        self.closed = False
        # A restart in a driver thread may race with close() at shutdown (a Ray actor serialises calls anyway).
        self._lock = threading.Lock()

    def start(self, any_port: bool = False) -> dict[str, Any]:
        """Start the process (on a port the OS picks if `any_port`); returns its `url`, `pid` and Ray `node` id."""
        with self._lock:
            if self.closed:
                raise RuntimeError(f"rollout server {self.index}: its host is closed")
            if self.server is not None and self.server.process.poll() is None:
                raise RuntimeError(f"rollout server {self.index} is already running (pid {self.server.pid})")
            self.port = free_port(self.address) if any_port else self._choose_port()
            command, env = self._command()
            self.starts += 1
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "a") as log:
                log.write(f"=== megarl: start {self.starts} of rollout server {self.index}: {' '.join(command)}\n")
            url = f"http://{self.reachable}:{self.port}"
            self.server = spawn_server(command, url=url, log_path=self.log_path, env=env, api_key=self.spec.api_key,
                                       secrets_path=self._secrets())
            return {"url": url, "pid": self.server.pid, "node": current_node_id()}

    def restart(self, any_port: bool = False) -> dict[str, Any]:
        self.stop()
        return self.start(any_port)

    def exit_code(self) -> int | None:
        """The process's exit status; None while it runs (and before the first start)."""
        return None if self.server is None else self.server.process.poll()

    def peak_memory_gb(self) -> float | None:
        """The server process's peak resident memory (its VmHWM); None when it is not running."""
        if self.server is None or self.server.process.poll() is not None:
            return None
        try:
            status = Path(f"/proc/{self.server.pid}/status").read_text()
        except OSError:
            return None
        kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), None)
        return None if kib is None else kib / 2**20

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The last `chars` characters of the server's log (read from the end: SGLang logs grow large)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 4 * chars))
                return log.read().decode(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        with self._lock:
            if self.server is not None:
                self.server.stop()

    def close(self) -> None:
        """Stop the server for good."""
        with self._lock:
            self.closed = True
            if self.server is not None:
                self.server.stop()

    def _choose_port(self) -> int:
        # The same port again after a restart keeps the server's URL, so routers and clients need no update.
        preferred = [self.port] if self.port is not None else []
        if self.spec.port is not None:
            preferred.append(self.spec.port + self.index)
        for port in preferred:
            if port_is_free(self.address, port):
                return port
        return free_port(self.address)

    def _secrets(self) -> Path | None:
        """The `--config` file holding the API key (only its owner may read it); None without a key."""
        if not self.spec.api_key:
            return None
        return secrets_path_for(self.log_path)

    def _command(self) -> tuple[list[str], dict[str, str]]:
        spec = self.spec
        config = write_secrets(self._secrets(), {"api-key": spec.api_key}) if spec.api_key else None
        if spec.backend == "cpu":
            command = cpu_engine_command(
                spec.model_path, host=self.address, port=self.port, config=config, threads=spec.threads,
                tokenizer_path=spec.tokenizer_path, weight_version=spec.weight_version, seed=spec.seed,
                enable_memory_saver=spec.enable_memory_saver, enable_weights_cpu_backup=spec.enable_weights_cpu_backup,
                enable_lora=spec.lora_max_rank is not None, max_lora_rank=spec.lora_max_rank,
                lora_target_modules=list(spec.lora_target_modules) or None,
                deterministic=spec.deterministic, max_sequences=spec.max_sequences,
            )
            # Each engine owns `threads` cores at most; more OpenMP threads only thrash shared CPUs.
            return command, {"OMP_NUM_THREADS": str(spec.threads)}
        # Imported here: its flag checks load the recipe schema (pydantic), which a host of CPU engines, a Ray
        # actor started for each server, would import for nothing.
        from megarl.rollout.sglang_launcher import sglang_server_argv

        command = sglang_server_argv(
            model_path=spec.model_path, host=self.address, port=self.port, tp_size=spec.tp,
            mem_fraction_static=spec.mem_fraction, config=config, weight_version=spec.weight_version,
            skip_tokenizer_init=spec.skip_tokenizer_init, enable_memory_saver=spec.enable_memory_saver,
            enable_weights_cpu_backup=spec.enable_weights_cpu_backup, deterministic=spec.deterministic,
            extra=spec.sglang_args, lora_max_rank=spec.lora_max_rank,
            lora_target_modules=spec.lora_target_modules,
        )
        # /health without its one-token generation: a probe must never generate on a server paused for a sync
        # (it would block, then fail) or on memory released to a colocated trainer.
        env = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
        if self.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in self.gpu_ids)
        return command, env


class LocalHost:
    """A host object in the driver process, called like a Ray actor."""

    def __init__(self, host: ServerHost):
        self._host = host

    def call(self, method: Callable, *args: Any) -> Any:
        """`method` (a method of `ServerHost`, named by itself: `host.call(ServerHost.exit_code)`) on the host."""
        return getattr(self._host, _host_method(method))(*args)

    def close(self) -> None:
        self._host.close()


class RayHost:
    """Server `index`'s `ServerHost` Ray actor; `call` blocks for the result."""

    def __init__(self, actor: Any, index: int):
        self._actor, self.index = actor, index

    def call(self, method: Callable, *args: Any, timeout_s: float = 120.0) -> Any:
        """`method` (a method of `ServerHost`, named by itself) on the actor, waiting at most `timeout_s`;
        `RoleOutOfMemory` if the actor was killed for memory."""
        import ray

        name = _host_method(method)
        try:
            return ray.get(getattr(self._actor, name).remote(*args), timeout=timeout_s)
        except ray.exceptions.RayError as error:
            kill = memory_kill(error, names=(f"ServerHost.{name}",))
            if kill is None:
                raise
            raise RoleOutOfMemory(kill, role="rollout server", rank=self.index, method=f"ServerHost.{name}") from error

    def close(self) -> None:
        import ray

        try:
            self.call(ServerHost.close, timeout_s=60.0)
        except Exception:  # noqa: BLE001 - the actor may already be gone; killing it below is what matters
            pass
        ray.kill(self._actor)


def _host_method(method: Callable) -> str:
    """The name of `method` once it is known to be a method of `ServerHost` (a string is refused)."""
    name = getattr(method, "__name__", None)
    if not isinstance(name, str) or getattr(ServerHost, name, None) is not method:
        raise TypeError(f"a server host is called with a method of ServerHost (e.g. ServerHost.start), got {method!r}")
    return name


def start_hosts(spec: ServerSpec, num_servers: int, *, use_ray: bool,
                placements: list[HostPlacement] | None = None) -> list[LocalHost | RayHost]:
    """One host per server; with `use_ray`, server i's host is a Ray actor with `placements[i]`'s options."""
    if not use_ray:
        if placements:
            raise ValueError("start_hosts: placements need use_ray=True")
        return [LocalHost(ServerHost(spec, index)) for index in range(num_servers)]
    import ray

    if not ray.is_initialized():
        raise RuntimeError("start_hosts: use_ray=True needs a running Ray (ray.init first), or use_ray=False")
    placements = placements or [HostPlacement()] * num_servers
    if len(placements) != num_servers:
        raise ValueError(f"start_hosts: {num_servers} servers need {num_servers} placements, got {len(placements)}")
    remote_host = ray.remote(ServerHost)
    return [
        RayHost(remote_host.options(**{"num_cpus": 0, **placement.actor_options, "max_restarts": 0})
                .remote(spec, index, list(placement.gpu_ids) if placement.gpu_ids is not None else None), index)
        for index, placement in enumerate(placements)
    ]
