"""An `sglang-router` subprocess in front of the fleet: start, register/remove workers, stop by PID.

The router (sglang-router 0.3.2, a Rust gateway) forwards `/generate` to its
workers by a policy (`cache_aware` keeps a prompt's samples on one server's
prefix cache). It does not forward weight updates or control calls, so the
fleet sends those to every server directly. Workers are managed through
`POST /workers {"url"}` (202, registered asynchronously), `GET /workers` and
`DELETE /workers/{id}`; `add_worker`/`remove_worker` wait until the change
shows in the listing. The router binds to loopback: only the driver talks to it.
With an API key, the router requires it from clients and sends it to workers; the
key reaches it through the environment (`router_main`), never its command line.
The router's own health checks are off: liveness is the fleet's (`/model_info`).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from megarl.ports import free_port
from megarl.rollout.router_main import ROUTER_API_KEY_ENV
from megarl.rollout.server import ServerHandle, spawn_server, wait_healthy

POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")


class RouterError(RuntimeError):
    """The router refused or did not finish a worker change; names the router, the worker and the reply."""


def router_argv(worker_urls: list[str], *, policy: str, host: str, port: int) -> list[str]:
    """The router's command line: no key on it (`router_main` takes it from the environment), and no health
    checks of its own (they GET /health, which on SGLang generates a token: on a server paused for a sync it
    fails after 20 s, and three failures would drop the worker; the fleet watches its servers itself)."""
    if policy not in POLICIES:
        raise ValueError(f"router policy must be one of {POLICIES}, got {policy!r}")
    argv = [sys.executable, "-m", "megarl.rollout.router_main", "--worker-urls", *worker_urls]
    argv += ["--policy", policy, "--host", host, "--port", str(port), "--log-level", "warn", "--disable-health-check"]
    return argv


class RouterHandle:
    """A running router: its URL and process; worker changes over its HTTP API."""

    def __init__(self, server: ServerHandle, *, api_key: str | None):
        self.server = server
        self.url = server.url
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    @property
    def pid(self) -> int:
        return self.server.pid

    def exit_code(self) -> int | None:
        return self.server.process.poll()

    def log_tail(self) -> str:
        return self.server.log_tail()

    def workers(self) -> list[dict[str, Any]]:
        """The router's worker records (`id`, `url`, `is_healthy`, ...)."""
        return self._call("GET", "/workers")["workers"]

    def worker_urls(self) -> list[str]:
        return [worker["url"] for worker in self.workers()]

    def add_worker(self, url: str, *, timeout_s: float = 60.0) -> None:
        """Register `url` and wait until the router lists it as healthy."""
        self._call("POST", "/workers", {"url": url})
        self._wait(lambda: any(w["url"] == url and w.get("is_healthy", True) for w in self.workers()),
                   f"add worker {url}", timeout_s)

    def remove_worker(self, url: str, *, timeout_s: float = 30.0) -> None:
        """Deregister every record of `url` (a no-op when it is not registered) and wait until it is gone."""
        for worker in self.workers():
            if worker["url"] == url:
                self._call("DELETE", f"/workers/{worker['id']}")
        self._wait(lambda: url not in self.worker_urls(), f"remove worker {url}", timeout_s)

    def stop(self) -> None:
        self.server.stop()

    def _wait(self, done, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise RouterError(f"router {self.url}: {what} not done after {timeout_s:.0f} s; "
                                  f"workers: {self.workers()}")
            time.sleep(0.1)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.url}{path}", data=data, headers=self._headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            raise RouterError(f"router {self.url}{path}: HTTP {error.code}: {error.read().decode()[:500]}") from None
        except (urllib.error.URLError, OSError) as error:
            raise RouterError(f"router {self.url}{path}: unreachable: {error}") from None
        return json.loads(text) if text.strip() else None


def start_router(
    worker_urls: list[str],
    *,
    log_path: str | Path,
    policy: str = "cache_aware",
    api_key: str | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    startup_timeout_s: float = 60.0,
) -> RouterHandle:
    """Start the router on `worker_urls` and wait until it is up and lists them all."""
    port = port if port is not None else free_port(host)
    argv = router_argv(worker_urls, policy=policy, host=host, port=port)
    env = {ROUTER_API_KEY_ENV: api_key} if api_key else None
    server = spawn_server(argv, url=f"http://{host}:{port}", log_path=log_path, env=env, api_key=api_key)
    router = RouterHandle(server, api_key=api_key)
    try:
        wait_healthy(router.url, exit_code=router.exit_code, log_tail=router.log_tail,
                     timeout_s=startup_timeout_s, what="sglang-router")
        router._wait(lambda: sorted(router.worker_urls()) == sorted(worker_urls), "register the initial workers",
                     startup_timeout_s)
    except BaseException:
        router.stop()
        raise
    return router
