"""The rollout fleet: N generation servers, routing, generating a Batch, and recovering dead servers.

Lifecycle: each server's process is owned by a `ServerHost`, one Ray actor
per server with the options of its `HostPlacement` (built by the controller;
with `use_ray=False` the hosts live in the driver).
The host reports the server's URL; the fleet waits on `/health`; logs go to
`<log_dir>/rollout-<i>.log`, and a server that never becomes healthy fails
the fleet with its log tail.

Routing: with `routing="client"` the fleet spreads requests itself (least
loaded, at most `max_concurrency` in flight per server, one request per prompt
group); with `routing="router"` the servers are registered with an
`sglang-router` and generation goes through it (one request per sample: the
router takes only one `sampling_params`). Weight updates and control calls
always go to every server directly; the router does not forward them.

Colocated memory: with `ServerSpec.enable_memory_saver` the servers start with
`--enable-memory-saver`; `release_memory()` frees their weights and KV cache
before the trainer uses the GPUs, `resume_memory()` takes them back (resume
`weights`, sync, then `kv_cache`: resumed weights are undefined until pushed,
unless the servers keep a host copy). A server that does not answer these calls
is taken as dead (below) and the call goes on with the others.

Faults: a request whose server died is re-sent to the others (`dispatch`); the
dead server is restarted (at most `max_restarts` times) by the fleet's event loop,
but only while the fleet holds its memory (`memory_gate`: never while a colocated
trainer uses the devices). Once healthy it is *stale*: running, without the
current weights, serving nothing. Weights only ever reach it from the driver's own
thread, between the driver's calls on the actor's worker group (the push is one
such call, collective over the actor's ranks: made from another thread it could
reach two ranks in another order than the driver's calls, and NCCL would hang):
at the next `sync_weights` (every running server gets the version), at the start
of the next `generate`, or inside a `generate` left with no serving server, which
hands the driver the re-sync (`set_resync`; by default a push of the current
version to the stale servers). When no server is left, `FleetError` names each
with its cause and log tail.

Stopping: `stop_generating()` (thread-safe; the controller calls it on SIGTERM) cancels
the generation in flight, which then raises `GenerationInterrupted`, and refuses new ones.

Security: every server gets the run's API key, which `/generate`, weight
updates and control calls require (only `/health` is open); servers bind to
loopback or their node's own address, never 0.0.0.0 unless the recipe says
so. Nothing in the fleet, client or router unpickles data from the network;
the one pickle that travels is SGLang's documented `/update_weights_from_tensor`
format on the colocated path, loaded by a server from its own trainer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Coroutine, TypeVar

from megarl.config.settings import SamplingSettings
from megarl.errors import InputError
from megarl.oom import find_role_oom
from megarl.protocol import Batch
from megarl.rollout.batching import prompt_groups, prompt_token_lists, rollout_batch
from megarl.rollout.client import RolloutClient, RolloutError
from megarl.rollout.dispatch import FleetError, generate_rows
from megarl.rollout.fleet_member import DEAD, RESTARTING, STALE, UP, FleetMember
from megarl.rollout.memory_gate import MemoryGate
from megarl.rollout.results import GenerationResult
from megarl.rollout.router import RouterError, RouterHandle, start_router
from megarl.rollout.server_host import (
    LOOPBACK,
    HostPlacement,
    ServerHost,
    ServerSpec,
    bind_address,
    current_node_id,
    start_hosts,
)
from megarl.rollout.sglang_launcher import passthrough_args
from megarl.rollout.weight_wire import lora_adapter_name

# push(urls=[...], version=v) loads the trainer's current weights into those servers under version v;
# on GPUs it also gets devices=[per server, the UUID of each TP rank's GPU] (the tensor transport needs them).
WeightSource = Callable[..., Any]
T = TypeVar("T")
STALL_POLL_S = 0.05  # how often the driver, waiting for a generation, looks for a stall to serve


class GenerationInterrupted(RuntimeError):
    """`stop_generating()` cancelled this generation (or came before it): the run is stopping."""


@dataclass
class _RouterTarget:
    url: str
    assigned: int = 0
    slots: asyncio.Semaphore | None = None


class RolloutFleet:
    """Servers + generation of a Batch + weight-version bookkeeping; see the module docstring."""

    def __init__(
        self,
        spec: ServerSpec,
        *,
        num_servers: int,
        pad_token_id: int,
        seed: int = 0,
        max_concurrency: int = 256,
        routing: str = "client",
        router_policy: str = "cache_aware",
        use_ray: bool = True,
        placements: list[HostPlacement] | None = None,
        startup_timeout_s: float = 900.0,
        max_restarts: int = 2,
        max_attempts: int = 4,
        lora_adapters: bool = False,
    ):
        if routing not in ("client", "router"):
            raise ValueError(f"routing must be 'client' or 'router', got {routing!r}")
        if num_servers < 1 or max_concurrency < 1 or max_attempts < 1:
            raise ValueError(f"num_servers={num_servers}, max_concurrency={max_concurrency} and "
                             f"max_attempts={max_attempts} must be >= 1")
        if spec.backend == "sglang":
            passthrough_args(spec.sglang_args)  # a bad recipe block fails before any process starts
        self.spec = spec
        self.pad_token_id = pad_token_id
        self.seed, self.max_concurrency = seed, max_concurrency
        # Adapter-only weight sync: each sync loads the version's LoRA adapter, which every generation names.
        self.lora_adapters = lora_adapters
        self.max_restarts, self.max_attempts, self.startup_timeout_s = max_restarts, max_attempts, startup_timeout_s
        self._weight_lock = threading.Lock()
        self._source: WeightSource | str | Path | None = None
        self._resync_hook: Callable[[], Any] | None = None
        self._stall: concurrent.futures.Future | None = None  # a generation waiting for the driver's re-sync
        self._memory = MemoryGate()
        self._version, self._version_arg = spec.weight_version, None
        self._recoveries: set[asyncio.Task] = set()
        self._changed: asyncio.Event | None = None
        self._closed = False
        self._generation_lock = threading.Lock()
        self._generation: concurrent.futures.Future | None = None
        self._background: set[concurrent.futures.Future] = set()
        self._generation_stopped = False
        self._client: RolloutClient | None = None
        self._router: RouterHandle | None = None
        self._router_target: _RouterTarget | None = None
        self._devices = [placement.device_uuids for placement in placements] if placements else None
        hosts = start_hosts(spec, num_servers, use_ray=use_ray, placements=placements)
        self._servers = [FleetMember(index, host, api_key=spec.api_key) for index, host in enumerate(hosts)]
        try:
            self._start_all()
            self._client = RolloutClient(self.urls, api_key=spec.api_key, max_concurrency=max_concurrency)
            if routing == "router":
                self._router = start_router(self.urls, log_path=Path(spec.log_dir) / "router.log",
                                            policy=router_policy, api_key=spec.api_key)
                self._router_target = _RouterTarget(self._router.url)
        except BaseException:
            self.shutdown()
            raise

    # ---- what callers see --------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """URLs of the servers that serve now (weight updates go to these)."""
        return [server.url for server in self._servers if server.state == UP]

    @property
    def router(self) -> RouterHandle | None:
        """The sglang-router in front of the servers (routing="router"), else None."""
        return self._router

    @property
    def weight_version(self) -> str:
        """The version every serving server holds (the servers' start version until the first sync)."""
        return self._version

    def status(self) -> list[dict[str, Any]]:
        """Per server: index, url, pid, state (up/restarting/stale/dead), restarts, failure."""
        return [{"index": s.index, "url": s.url, "pid": s.pid, "state": s.state, "restarts": s.restarts,
                 "failure": s.failure} for s in self._servers]

    def generate(self, gen_batch: Batch, sampling: SamplingSettings, *, seed: int,
                 on_rows: Callable[[list[int], list[GenerationResult]], None] | None = None) -> Batch:
        """Responses (at most `sampling.max_new_tokens`, right-padded to it), full sequences, engine log-probs and
        finish reasons for every row of `gen_batch`, sampled with `sampling`; `seed` and the fleet's own seed
        give every row its sampling seed.

        `on_rows(rows, results)` is told about rows as soon as they finish (the reward loop scores them
        while the others generate); it runs on the client's event loop and must only queue work."""
        prompts = prompt_token_lists(gen_batch)
        groups = [[row] for row in range(len(prompts))] if self._router else prompt_groups(prompts)
        results = self.run_generation(generate_rows(
            prompts, groups, sampling=sampling, seed=self.call_seed(seed), targets=self,
            request=self._client.request, max_attempts=self.max_attempts, on_rows=on_rows, lora_path=self.lora_path,
        ))
        return rollout_batch(gen_batch, results, pad_id=self.pad_token_id,
                             max_response_length=sampling.max_new_tokens)

    def start_generation(self, gen_batch: Batch, sampling: SamplingSettings, *, seed: int,
                         on_rows: Callable[[list[int], list[GenerationResult]], None],
                         per_token_versions: bool = False, partial: bool = False) -> concurrent.futures.Future:
        """`generate` without waiting (asynchronous RL): each row's result goes to `on_rows` as it finishes (on
        the client's loop), the future ends with the call (its exception, if any). Seeds as `generate`'s, so a
        batch generated this way draws the samples `generate` would. `per_token_versions`: stream the requests,
        so each result lists its tokens' weight versions (in-flight updates); `partial`: a sample a weight update
        aborts goes on from its tokens (partial rollouts). `stop_generating()` cancels it."""
        prompts = prompt_token_lists(gen_batch)
        groups = [[row] for row in range(len(prompts))] if self._router else prompt_groups(prompts)
        with self._generation_lock:
            if self._generation_stopped:
                raise GenerationInterrupted("generation was stopped: the run is shutting down")
            future = self._client.submit(generate_rows(
                prompts, groups, sampling=sampling, seed=self.call_seed(seed), targets=self,
                request=self._client.request, max_attempts=self.max_attempts, on_rows=on_rows,
                lora_path=self.lora_path, stream=self._client.stream if per_token_versions else None, partial=partial,
            ))
            self._background.add(future)
        future.add_done_callback(self._background.discard)
        return future

    def call_seed(self, seed: int) -> int:
        """The seed of a generation call numbered `seed` (the step) in this run; rows derive theirs from it."""
        return self.seed * 100_003 + seed

    def run_generation(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a generation `coroutine` on the fleet's event loop and wait for it, on the driver's thread;
        servers found dead before or after are restarted, restarted ones are re-synced first or when the
        generation stalls for them (module docstring, "Faults"). `stop_generating()` cancels it
        (GenerationInterrupted)."""
        if self._stale():
            self._resync()  # restarted servers back with the current weights before they are needed
        with self._generation_lock:
            if self._generation_stopped:
                coroutine.close()
                raise GenerationInterrupted("generation was stopped: the run is shutting down")
            self._generation = self._client.submit(self._checked(coroutine))
        try:
            return self._result_serving_stalls(self._generation)
        except concurrent.futures.CancelledError:
            raise GenerationInterrupted("generation was stopped: the run is shutting down") from None
        finally:
            self._generation = None

    async def generate_one(self, input_ids: list[int], sampling: SamplingSettings, *,
                           seed: int | None) -> GenerationResult:
        """One sample continuing `input_ids` exactly, sent through the fleet with its retries (on the fleet's loop,
        inside `run_generation`): a turn of a multi-turn episode."""
        (result,) = await generate_rows([list(input_ids)], [[0]], sampling=sampling, seed=seed, targets=self,
                                        request=self._client.request, max_attempts=self.max_attempts,
                                        lora_path=self.lora_path)
        return result

    @property
    def lora_path(self) -> str | None:
        """The LoRA adapter every generation names (the current version's, with the adapter-only sync), or None."""
        return lora_adapter_name(self._version) if self.lora_adapters else None

    def on_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the fleet's event loop, where generation runs (what generation coroutines use, e.g.
        a tool sandbox, is started and stopped there)."""
        return self._client.run(coroutine)

    def stop_generating(self) -> None:
        """Cancel the generation in flight and refuse later ones (from any thread)."""
        with self._generation_lock:
            self._generation_stopped = True
            if self._generation is not None:
                self._generation.cancel()
            for future in list(self._background):
                future.cancel()

    def _result_serving_stalls(self, generation: concurrent.futures.Future) -> Any:
        """The generation's results; meanwhile, whenever it stalls with no server left to serve but restarted
        (stale) ones, this thread (the driver's) re-syncs them and lets it go on."""
        while True:
            try:
                return generation.result(timeout=STALL_POLL_S)
            except concurrent.futures.TimeoutError:
                self.serve_stalled()

    def serve_stalled(self) -> None:
        """When a generation stalls with no server left to serve but restarted (stale) ones, re-sync them and let it
        go on; call it on the driver's thread while waiting for a generation (`start_generation`'s too)."""
        stall = self._stall
        if stall is None or stall.done():
            return
        try:
            self._resync()
        except BaseException as error:  # noqa: BLE001 - the waiting requests raise it
            stall.set_exception(error)
        else:
            stall.set_result(None)

    async def _checked(self, coroutine: Coroutine[Any, Any, T]) -> T:
        # Checks before and after: a server may have died while idle, and the router
        # re-sends a dead worker's requests itself, so only a check can see that death.
        await self._check_all()
        result = await coroutine
        await self._check_all()
        return result

    # ---- weights -----------------------------------------------------------------------------

    def set_weight_source(self, source: WeightSource | str | Path) -> None:
        """Where current weights come from: `push(urls=..., version=...)`, or an HF checkpoint dir to load."""
        self._source = source

    def set_resync(self, resync: Callable[[], Any]) -> None:
        """How restarted (stale) servers get the current weights, called on the driver's thread (module
        docstring, "Faults"); by default `resync_stale`. A colocated run wakes its actor around a full sync."""
        self._resync_hook = resync

    @property
    def synced_version(self) -> Any:
        """The version of the last `sync_weights` as it was given; None before the first."""
        return self._version_arg

    def sync_weights(self, *, version: Any) -> Any:
        """Push the source's weights under `version` to every running server (serving, and restarted since
        the last sync, which then serve); returns the source's result, {} when every server is restarting
        (they are synced when they are back). A server found dead is taken out and restarted."""
        if self._source is None:
            raise RuntimeError("sync_weights: no weight source; call set_weight_source first")
        with self._weight_lock:
            targets = self._running_urls()
            try:
                result = self._push(targets, version) if targets else {}
            except Exception:
                if not self._client.run(self._check_all()):
                    raise
                targets = self._running_urls()
                result = self._push(targets, version) if targets else {}
            self._version, self._version_arg = str(version), version
            self._serve([server for server in self._servers if server.state == STALE and server.url in targets])
        return result

    def resync_stale(self) -> None:
        """Push the current version to the restarted (stale) servers alone, then let them serve."""
        with self._weight_lock:
            stale = [server for server in self._servers if server.state == STALE]
            if stale:
                self._push([server.url for server in stale], self._version_arg)
                self._serve(stale)

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the running servers' GPU memory of `tags` (weights, kv_cache, cuda_graph; all when None)
        before the trainer uses the same GPUs; needs `enable_memory_saver` and no generation running. Waits
        for a restart in progress first (it must let go of its memory too); none begins until `resume_memory`
        has taken every tag back."""
        self._memory.release(tags, timeout_s=self.startup_timeout_s)
        self._memory_call(lambda client: client.release_memory_occupation(tags))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take the memory of `tags` back (all when None) before syncing weights (`weights`) and generating."""
        self._memory_call(lambda client: client.resume_memory_occupation(tags))
        self._memory.resume(tags)

    def peak_memory_gb(self) -> float | None:
        """The largest peak resident memory of a CPU-engine server process; None for SGLang, whose memory is on
        its GPUs, and when no server reports."""
        if self.spec.backend != "cpu":
            return None
        peaks = [peak for server in self._servers if (peak := server.host.call(ServerHost.peak_memory_gb)) is not None]
        return max(peaks, default=None)

    def server_devices(self, urls: list[str]) -> list[list[str]] | None:
        """For each of `urls`, the UUID of each TP rank's GPU; None when the placement gave none (CPU)."""
        if self._devices is None or any(devices is None for devices in self._devices):
            return None
        by_url = {server.url: self._devices[server.index] for server in self._servers}
        return [list(by_url[url]) for url in urls]

    def wait_for_restarts(self, timeout_s: float = 300.0) -> bool:
        """Block until no restart is in progress; False on timeout."""
        return self._client.run(self._await_recoveries(timeout_s))

    def _stale(self) -> list[FleetMember]:
        return [server for server in self._servers if server.state == STALE]

    def _running_urls(self) -> list[str]:
        """Servers that take memory and weight calls: serving or stale. FleetError when none is left at all."""
        if all(server.state == DEAD for server in self._servers):
            raise self._no_server_left()
        return [server.url for server in self._servers if server.state in (UP, STALE)]

    def _resync(self) -> None:
        (self._resync_hook or self.resync_stale)()

    def _serve(self, servers: list[FleetMember]) -> None:
        """Restarted servers that now hold the current weights serve again (driver thread)."""
        for server in servers:
            if self._router is not None:
                self._router.add_worker(server.url)
            server.state = UP
        if servers:
            self._client.run(self._notified())

    async def _notified(self) -> None:
        self._notify()

    def _memory_call(self, call: Callable[[RolloutClient], Any]) -> None:
        """`call` on every running server; one that fails because it died is taken out, the others get it again."""
        for attempt in range(2):
            urls = self._running_urls()
            if not urls:
                return
            try:
                with RolloutClient(urls, api_key=self.spec.api_key) as client:
                    call(client)
                return
            except RolloutError:
                if attempt or not self._client.run(self._check_all()):
                    raise

    def _push(self, urls: list[str], version: Any) -> Any:
        if callable(self._source):
            devices = self.server_devices(urls)
            return self._source(urls=urls, version=version, **({"devices": devices} if devices else {}))
        with RolloutClient(urls, api_key=self.spec.api_key) as client:
            client.update_weights_from_disk(str(self._source), weight_version=str(version))
        return None

    # ---- Targets protocol, used by dispatch.generate_rows on the client's loop ----------------

    async def acquire(self) -> Any:
        while True:
            live = [server for server in self._servers if server.state == UP]
            if not live:
                states = {server.state for server in self._servers}
                if states == {DEAD}:
                    raise self._no_server_left()
                if STALE in states and RESTARTING not in states:
                    await self._driver_resync()  # only the driver may push weights (module docstring)
                else:
                    await self._wait_changed()
                continue
            target = self._router_target or min(live, key=lambda server: server.assigned)
            if target.slots is None:
                bound = self.max_concurrency * (len(self._servers) if target is self._router_target else 1)
                target.slots = asyncio.Semaphore(bound)
            target.assigned += 1
            try:
                await target.slots.acquire()
            except BaseException:
                target.assigned -= 1
                raise
            if target is self._router_target or target.state == UP:
                return target
            # It died while this request waited for a slot: pick again without spending an attempt.
            self.release(target)

    def release(self, target: Any) -> None:
        target.slots.release()
        target.assigned -= 1

    async def _driver_resync(self) -> None:
        """Wait for the driver's thread, parked in `generate`, to re-sync the stale servers."""
        if self._stall is None or self._stall.done():
            self._stall = concurrent.futures.Future()
        await asyncio.wrap_future(self._stall)

    async def report_failure(self, target: Any, error: RolloutError) -> None:
        if isinstance(target, FleetMember):
            if target.state == UP and not await asyncio.to_thread(target.alive):
                await self._mark_down(target, f"failed during generation: {error}")
            return
        if self._router.exit_code() is not None:
            raise FleetError(f"sglang-router at {self._router.url} exited; log tail:\n{self._router.log_tail()}")
        await self._check_all()

    # ---- start, check, restart ---------------------------------------------------------------

    def _start_all(self) -> None:
        driver_node = current_node_id()
        for server in self._servers:
            info = server.start()
            if bind_address(self.spec.bind) == LOOPBACK and info["node"] != driver_node:
                raise InputError(f"rollout.host: {self.spec.bind!r} (loopback) but rollout server {server.index} "
                                 f"runs on another node; use 'node' so the controller can reach it")
        # All processes boot together; then wait for each in turn.
        for server in self._servers:
            server.wait_ready(timeout_s=self.startup_timeout_s, what=self._what(server), api_key=self.spec.api_key)
            server.state = UP

    def _what(self, server: FleetMember) -> str:
        return f"rollout server {server.index} ({self.spec.backend})"

    async def _check_all(self) -> list[FleetMember]:
        """Find running (serving or stale) servers that are dead and start their recovery; returns them."""
        serving = [server for server in self._servers if server.state in (UP, STALE)]
        alive = await asyncio.gather(*(asyncio.to_thread(server.alive) for server in serving))
        dead = [server for server, ok in zip(serving, alive) if not ok]
        for server in dead:
            await self._mark_down(server, "found dead")
        return dead

    async def _mark_down(self, server: FleetMember, reason: str) -> None:
        if server.state not in (UP, STALE):
            return
        if server.restarts >= self.max_restarts:
            server.state = DEAD
            tail = await asyncio.to_thread(server.log_tail)
            server.failure = f"{reason}; not restarted again after {server.restarts} restarts; log tail:\n{tail}"
            self._notify()
            return
        server.state = RESTARTING
        server.restarts += 1
        task = asyncio.ensure_future(self._recover(server, reason))
        self._recoveries.add(task)
        task.add_done_callback(self._recoveries.discard)

    async def _recover(self, server: FleetMember, reason: str) -> None:
        try:
            if self._router is not None:
                # A router that cannot drop the record is no reason to retire the server: the
                # restarted server usually comes back on the same URL, which re-registering checks.
                with contextlib.suppress(RouterError):
                    await asyncio.to_thread(self._router.remove_worker, server.url)
            # Colocated: not while the trainer uses the devices (the fleet's memory is released then).
            # However long the trainer's phases last: the restart waits for their end.
            await asyncio.to_thread(self._memory.begin_start, timeout_s=None, stop=lambda: self._closed)
            try:
                await asyncio.to_thread(server.start, restart=True)
                await asyncio.to_thread(server.wait_ready, timeout_s=self.startup_timeout_s,
                                        what=self._what(server), api_key=self.spec.api_key)
                if self._closed:
                    raise FleetError("fleet shut down during the restart")
                if self._version_arg is None:  # nothing synced yet: the checkpoint it loaded is current
                    if self._router is not None:
                        await asyncio.to_thread(self._router.add_worker, server.url)
                    server.state = UP
                else:
                    server.state = STALE
            finally:
                self._memory.end_start()
        except Exception as error:  # noqa: BLE001 - a failed restart retires the server, the others go on
            server.state = DEAD
            tail = await asyncio.to_thread(server.log_tail)
            server.failure = f"{reason}; restart {server.restarts} failed: {error}; log tail:\n{tail}"
            server.killed = find_role_oom(error) or server.killed
        finally:
            self._notify()

    def _no_server_left(self) -> FleetError:
        """Every server is dead: a FleetError listing why, caused by the first memory kill among them if any
        (so the CLI says that in one line)."""
        lines = [f"no rollout server is serving ({len(self._servers)} started):"]
        lines += [f"- server {s.index} at {s.url}: {s.state}; {s.failure or 'no failure recorded'}"
                  for s in self._servers]
        error = FleetError("\n".join(lines))
        killed = [server.killed for server in self._servers if server.killed is not None]
        if killed:
            error.__cause__ = killed[0]
        return error

    async def _wait_changed(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()

    async def _await_recoveries(self, timeout_s: float) -> bool:
        if not self._recoveries:
            return True
        _, pending = await asyncio.wait(list(self._recoveries), timeout=timeout_s)
        return not pending

    # ---- teardown ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the router and every server (by PID, through their hosts); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._memory.wake()  # a restart waiting for the memory gives up
        if self._router is not None:
            self._router.stop()
        for server in self._servers:
            server.host.close()
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> RolloutFleet:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
