"""The async client for a fleet of SGLang-protocol servers, with a blocking facade for the controller.

It speaks only SGLang's HTTP protocol, so the same code drives real SGLang
servers and megarl's CPU engine. Each prompt is one `/generate` request
carrying its n samples as a batch of n copies (n samples of a prompt are
consecutive in the result, prompts in order). Requests go to the server with
the fewest requests assigned (round-robin on ties), with at most
`max_concurrency` in flight per server.

Determinism: with `seed`, sample j of prompt i is row i * n + j of the call and
gets that row's own `sampling_seed` (`megarl.rollout.sampling`), so results do not
depend on how requests are spread over servers or batched inside them.

All network work runs on a private event loop in a background thread: the
blocking methods work from plain code and from inside other event loops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from dataclasses import dataclass
from typing import Any, Coroutine, TypeVar

import aiohttp
import torch

from megarl.config.settings import SamplingSettings
from megarl.rollout.results import GenerationResult, parse_output, results_to_tensors
from megarl.rollout.sampling import generate_body
from megarl.rollout.weight_wire import LOAD_FORMATS, entries_for_tp_ranks, flatten_bucket

# results_to_tensors is re-exported: callers take the client and its packing helper from one place.
__all__ = ["GenerationResult", "RolloutClient", "RolloutError", "results_to_tensors"]

T = TypeVar("T")
# How long an idle connection to a server is kept for reuse: below the servers' keep-alive (uvicorn's 5 s).
IDLE_CONNECTION_S = 2.0


class RolloutError(RuntimeError):
    """A server answered with an error (or not at all); names the server URL, endpoint, status and message."""

    def __init__(self, url: str, endpoint: str, status: int | None, message: str):
        self.url, self.endpoint, self.status, self.message = url, endpoint, status, message
        status_text = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"{url}{endpoint}: {status_text}: {message}")


@dataclass
class _Server:
    url: str
    slots: asyncio.Semaphore | None = None
    assigned: int = 0


class RolloutClient:
    """Generation and weight-update calls over a list of server URLs."""

    def __init__(
        self,
        urls: list[str],
        *,
        api_key: str | None = None,
        max_concurrency: int = 256,
        timeout_s: float = 600.0,
    ):
        if not urls:
            raise ValueError("RolloutClient needs at least one server URL")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self._servers = [_Server(url.rstrip("/")) for url in urls]
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_concurrency = max_concurrency
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._next_server = 0
        self._tp_sizes: list[int] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self._servers]

    # ---- generation --------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings, *, n: int = 1, seed: int | None = None,
                 return_logprob: bool = True) -> list[GenerationResult]:
        """Generate `n` samples per prompt with `sampling` (each with its own seed when `seed` is given); returns
        len(prompts) * n results, prompt-major. Raises RolloutError when a server fails."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return self.run(self._generate(prompts, sampling, n=n, seed=seed, return_logprob=return_logprob))

    async def _generate(self, prompts: list[list[int]], sampling: SamplingSettings, *, n: int, seed: int | None,
                        return_logprob: bool) -> list[GenerationResult]:
        async def one(index: int, prompt: list[int]) -> list[GenerationResult]:
            body = generate_body(prompt, range(index * n, index * n + n), sampling=sampling, seed=seed,
                                 return_logprob=return_logprob)
            server = self._pick_server()
            try:
                async with server.slots:
                    reply = await self.request(server.url, "POST", "/generate", body)
            finally:
                server.assigned -= 1
            items = reply if isinstance(reply, list) else [reply]
            if len(items) != n:
                raise RolloutError(server.url, "/generate", 200, f"expected {n} outputs, got {len(items)}")
            try:
                return [parse_output(item, return_logprob=return_logprob) for item in items]
            except (KeyError, TypeError, ValueError) as error:
                raise RolloutError(server.url, "/generate", 200, f"malformed response: {error!r}") from error

        tasks = [asyncio.ensure_future(one(index, prompt)) for index, prompt in enumerate(prompts)]
        try:
            per_prompt = await asyncio.gather(*tasks)
        except BaseException:
            # One failure fails the call: stop sending the rest.
            for task in tasks:
                task.cancel()
            raise
        return [result for results in per_prompt for result in results]

    def _pick_server(self) -> _Server:
        """The server with the fewest assigned requests, starting the search after the last pick."""
        order = self._servers[self._next_server :] + self._servers[: self._next_server]
        chosen = min(order, key=lambda server: server.assigned)
        self._next_server = (self._servers.index(chosen) + 1) % len(self._servers)
        if chosen.slots is None:
            chosen.slots = asyncio.Semaphore(self._max_concurrency)
        chosen.assigned += 1
        return chosen

    # ---- control: every call goes to all servers ---------------------------------------------

    def health(self) -> list[bool]:
        """Per server: does `/health` answer 200?"""
        return self.run(self._health())

    def model_info(self) -> list[dict]:
        return self.run(self._all("GET", "/model_info"))

    def flush_cache(self) -> None:
        self.run(self._all("POST", "/flush_cache"))

    def begin_weight_update(self, selector: str = "all") -> None:
        self.run(self._all("POST", "/begin_weight_update", {"selector": selector}))

    def end_weight_update(self) -> None:
        self.run(self._all("POST", "/end_weight_update", {}))

    def update_weight_version(self, new_version: str, *, abort_all_requests: bool = True) -> None:
        """Publish `new_version`; SGLang aborts every request unless `abort_all_requests` is False."""
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        self.run(self._all("POST", "/update_weight_version", body))

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the servers' memory of `tags` (weights, kv_cache, cuda_graph; all when None).

        Needs servers started with `--enable-memory-saver` and no request running.
        """
        self.run(self._all("POST", "/release_memory_occupation", {"tags": tags}))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take the memory of `tags` back (all when None). Resumed weights hold undefined values unless the
        server keeps a host copy (`--enable-weights-cpu-backup`): push weights before generating."""
        self.run(self._all("POST", "/resume_memory_occupation", {"tags": tags}))

    def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None) -> None:
        body = {"model_path": str(model_path), "weight_version": weight_version}
        self.run(self._all("POST", "/update_weights_from_disk", body))

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        *,
        weight_version: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """Send tensors (HF names) to every server; call between begin/end_weight_update.

        Each server gets one entry per TP rank (its `/server_info` `tp_size`), a separate pickle
        each: every pickle holds one reference on the shared buffers, which one receiver releases.
        `flush_cache` true fails (and kills an SGLang server) while requests run or wait.
        """
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
        payload = flatten_bucket(named_tensors) if load_format == "flattened_bucket" else list(named_tensors)
        bodies = [
            {
                "serialized_named_tensors": entries_for_tp_ranks(payload, tp_size),
                "load_format": load_format,
                "flush_cache": flush_cache,
                "weight_version": weight_version,
            }
            for tp_size in self.tp_sizes()
        ]
        self.run(self._all("POST", "/update_weights_from_tensor", bodies))

    def load_lora_adapter_from_tensors(self, name: str, config: dict, named_tensors: list[tuple[str, torch.Tensor]],
                                       *, checksums: dict[str, str] | None = None) -> None:
        """Load a PEFT adapter (its `adapter_config.json` as `config`, tensors with PEFT's names) on every server
        as `name`: one pickle per server TP rank, as for weight updates; `checksums` ({tensor: digest,
        `weight_wire.tensor_checksum`}) are checked by the server."""
        bodies = [{"lora_name": name, "config_dict": config,
                   "serialized_named_tensors": entries_for_tp_ranks(list(named_tensors), tp_size),
                   "expected_checksums": checksums}
                  for tp_size in self.tp_sizes()]
        self.run(self._all("POST", "/load_lora_adapter_from_tensors", bodies))

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the PEFT adapter directory `path` (which every server must see) on every server as `name`."""
        self.run(self._all("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}))

    def unload_lora_adapter(self, name: str) -> None:
        """Unload adapter `name` on every server (each waits for the requests that still use it)."""
        self.run(self._all("POST", "/unload_lora_adapter", {"lora_name": name}))

    def tp_sizes(self) -> list[int]:
        """Each server's TP size from `/server_info` (a server that does not say has 1), asked once."""
        if self._tp_sizes is None:
            infos = self.run(self._all("GET", "/server_info"))
            self._tp_sizes = [int(info.get("tp_size", 1)) if isinstance(info, dict) else 1 for info in infos]
        return self._tp_sizes

    # ---- plumbing ----------------------------------------------------------------------------

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._session is not None:
            self.run(self._session.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the client's private loop and block for its result (the fleet's dispatcher runs here)."""
        return self.submit(coroutine).result()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coroutine` on the client's loop; cancelling the returned future cancels it there."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    async def _all(self, method: str, endpoint: str, body: Any = None) -> list[Any]:
        """The same call on every server (a list `body` gives one body per server); raises naming each failure."""
        bodies = body if isinstance(body, list) else [body] * len(self._servers)
        replies = await asyncio.gather(
            *(self.request(server.url, method, endpoint, item) for server, item in zip(self._servers, bodies)),
            return_exceptions=True,
        )
        errors = [reply for reply in replies if isinstance(reply, BaseException)]
        if len(errors) > 1 and all(isinstance(error, RolloutError) for error in errors):
            urls = ", ".join(error.url for error in errors)
            raise RolloutError(urls, endpoint, None, " | ".join(str(error) for error in errors))
        if errors:
            raise errors[0]
        return replies

    async def _health(self) -> list[bool]:
        async def check(server: _Server) -> bool:
            try:
                async with self._ensure_session().get(f"{server.url}/health") as response:
                    return response.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False

        return list(await asyncio.gather(*(check(server) for server in self._servers)))

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Concurrency is bounded per server by the semaphores, not by the connector. An idle connection is
            # dropped here before the server drops it (uvicorn's keep-alive, SGLang's and the CPU engine's, is
            # 5 s; aiohttp keeps one 15 s): reusing one the server is closing at that moment fails with
            # "Connection reset by peer", as a weight sync's /pause_generation once did 5.0 s after the last call.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=IDLE_CONNECTION_S)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, headers=self._headers)
        return self._session

    async def request(self, url: str, method: str, endpoint: str, body: Any = None) -> Any:
        """One HTTP call with the API key, on the client's loop: parsed JSON (or text, or None when empty).

        Raises RolloutError with status None when the server cannot be reached, else with its HTTP status.
        """
        try:
            async with self._ensure_session().request(method, f"{url}{endpoint}", json=body) as response:
                text = await response.text()
                if response.status >= 400:
                    raise RolloutError(url, endpoint, response.status, _error_message(text))
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            raise RolloutError(url, endpoint, None, f"{type(error).__name__}: {error}") from error
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except ValueError:
            return text


    async def stream(self, url: str, endpoint: str, body: Any) -> list[Any]:
        """A streamed POST (`stream: true` in `body`): every `data:` event's JSON, in order, until `data: [DONE]`.

        Errors as `request`'s; an event carrying `error` (SGLang streams a failure that way) raises it."""
        events: list[Any] = []
        try:
            async with self._ensure_session().post(f"{url}{endpoint}", json=body) as response:
                if response.status >= 400:
                    raise RolloutError(url, endpoint, response.status, _error_message(await response.text()))
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":
                        return events
                    event = json.loads(payload)
                    if isinstance(event, dict) and "error" in event:
                        raise RolloutError(url, endpoint, 500, _error_message(payload))
                    events.append(event)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
            raise RolloutError(url, endpoint, None, f"{type(error).__name__}: {error}") from error
        raise RolloutError(url, endpoint, None, "the stream ended without data: [DONE]")


def _error_message(text: str) -> str:
    """The message inside SGLang's error bodies (`{"error": {"message"}}`, `{"message"}`, a LoRA reply's
    `{"error_message"}`), else the raw text."""
    try:
        payload = json.loads(text)
    except ValueError:
        return text.strip()[:2000]
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "message" in payload:
            return str(payload["message"])
        if payload.get("error_message"):
            return str(payload["error_message"])
        if "detail" in payload:
            return str(payload["detail"])
    return text.strip()[:2000]
