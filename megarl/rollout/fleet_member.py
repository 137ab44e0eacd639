"""One server of the fleet as the driver sees it: its state and the blocking calls on it.

A member wraps the server's host (a Ray actor or a local object): it starts or
restarts the process, waits for `/health` (starting once more on a port the OS
picks when another process took the chosen port first), tells whether the
server is still alive, and reads its log tail and `/model_info`. Blocking
calls run in worker threads when the fleet's event loop needs them.

Alive means the process runs and `/model_info` answers. Not `/health`: SGLang's
runs a one-token generation, which blocks (about 20 s) and then answers 503 while
generation is paused for a weight update, so a server in the middle of a sync
would be declared dead. When SGLang's scheduler dies the whole server exits,
which the process check sees.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from megarl.oom import RoleOutOfMemory, find_role_oom
from megarl.rollout.server import ServerStartError, wait_healthy
from megarl.rollout.server_host import ServerHost

UP, STARTING, RESTARTING, DEAD = "up", "starting", "restarting", "dead"
# Restarted and running, but without the current weights yet: it takes part in memory and weight calls and
# generates nothing until the driver has synced it (see `RolloutFleet`, "Faults").
STALE = "stale"
# uvicorn: "[Errno 98] ... address already in use"; other servers: "port N is already in use".
PORT_TAKEN = re.compile(r"address already in use|port \d+ is (already )?in use", re.IGNORECASE)


@dataclass
class FleetMember:
    """Server `index`: where it is, how it is doing, and its in-flight bookkeeping (owned by the fleet's loop)."""

    index: int
    host: Any
    api_key: str | None = None
    url: str = ""
    pid: int | None = None
    state: str = STARTING
    restarts: int = 0
    failure: str = ""
    assigned: int = 0
    slots: asyncio.Semaphore | None = None
    killed: RoleOutOfMemory | None = None  # its host was found killed for memory (the fleet's error says so)

    def start(self, *, restart: bool = False, any_port: bool = False) -> dict[str, Any]:
        """Start (or stop and start) the process; returns the host's `url`, `pid` and `node`."""
        info = self.host.call(ServerHost.restart if restart else ServerHost.start, any_port)
        self.url, self.pid = info["url"], info["pid"]
        return info

    def wait_ready(self, *, timeout_s: float, what: str, api_key: str | None = None) -> None:
        """Wait for `/health`; ServerStartError with the log tail if the process exits or time runs out."""
        try:
            self._wait(timeout_s, what, api_key)
        except ServerStartError as error:
            if not PORT_TAKEN.search(str(error)):
                raise
            # Another process bound the port between our check and the server's bind.
            self.start(restart=True, any_port=True)
            self._wait(timeout_s, what, api_key)

    def alive(self) -> bool:
        """The process runs and `/model_info` answers (see the module docstring for why not `/health`)."""
        try:
            if self.host.call(ServerHost.exit_code) is not None:
                return False
            self.model_info(self.api_key)
            return True
        except Exception as error:  # noqa: BLE001 - unreachable, timed out, or its actor is gone: all mean dead
            self.killed = find_role_oom(error) or self.killed
            return False

    def log_tail(self) -> str:
        try:
            return self.host.call(ServerHost.log_tail)
        except Exception as error:  # noqa: BLE001 - the host itself may be gone
            return f"(log unavailable: {error})"

    def model_info(self, api_key: str | None) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        request = urllib.request.Request(f"{self.url}/model_info", headers=headers)
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())

    def _wait(self, timeout_s: float, what: str, api_key: str | None) -> None:
        wait_healthy(self.url, exit_code=lambda: self.host.call(ServerHost.exit_code), log_tail=self.log_tail,
                     timeout_s=timeout_s, what=what, interval_s=0.25)
        # `/health` may be answered by another run's server that holds the port while ours is
        # still loading (it binds only after that): a server that refuses our key is not ours.
        if api_key is not None and not self._accepts(api_key):
            port = self.url.rsplit(":", 1)[-1]
            raise ServerStartError(f"{what} at {self.url}: port {port} is in use by a server that refuses this run's key")

    def _accepts(self, api_key: str) -> bool:
        try:
            self.model_info(api_key)
        except urllib.error.HTTPError as error:
            return error.code != 401
        return True
