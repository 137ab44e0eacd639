"""What every transport shares: the error type, sync statistics, phase-named HTTP calls, the update session.

A sync is one update session on every server: generation paused in place,
`/begin_weight_update`, the transport's updates, `/update_weight_version` with the
new version (`abort_all_requests: false`, SGLang's default aborts every request),
`/end_weight_update`, a cache flush, generation continued. Running requests never
see half-updated weights, and a failed sync still closes the session and resumes
generation; a session a failed sync left open is ended before the next begins,
and when only some servers begin, those are ended again. Transports send `flush_cache: false`: SGLang asserts that the flush
after an update succeeds, and it fails (killing the server) while requests paused
in place are still running; the session's own `/flush_cache` is allowed to fail
then (those requests keep their KV cache, new ones start after the flush of the
next idle sync). Every HTTP call is bounded by the client's timeout; a failure
becomes a `WeightSyncError` naming the phase, the endpoint and the server URL.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from megarl.rollout.client import RolloutClient, RolloutError


# How SGLang 0.5.23 (and megarl's CPU engine, in the same words) answers `/end_weight_update` when no session is
# open, with HTTP 400 (`srt/managers/scheduler_components/weight_updater.py`, `end_weight_update`).
NO_SESSION_OPEN = "no weight-update session is open; call begin_weight_update() first"


class WeightSyncError(RuntimeError):
    """A sync that failed or timed out; the message names the phase and the peer (server URL or trainer rank)."""


@dataclass
class SyncStats:
    num_tensors: int
    num_bytes: int
    seconds: float
    checksums: dict[str, str] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Payload gigabytes per second (the `perf/weight_sync_gbps` metric)."""
        return self.num_bytes / 1e9 / self.seconds if self.seconds > 0 else float("nan")

    def metrics(self) -> dict[str, float]:
        return {"perf/weight_sync_gbps": self.gbps, "weight_sync/seconds": self.seconds,
                "weight_sync/bytes": float(self.num_bytes), "weight_sync/tensors": float(self.num_tensors)}


def call_servers(client: RolloutClient, method: str, endpoint: str, bodies: list[Any] | Any = None, *,
                 phase: str) -> list[Any]:
    """The same call on every server of `client` (a list gives one body per server), concurrently.

    Raises WeightSyncError naming `phase`, the endpoint and each failing server. A
    reply `{"success": false}` counts as a failure even with HTTP 200.
    """
    urls = client.urls
    bodies = bodies if isinstance(bodies, list) else [bodies] * len(urls)

    async def all_servers() -> list[Any]:
        calls = (client.request(url, method, endpoint, body) for url, body in zip(urls, bodies))
        return await asyncio.gather(*calls, return_exceptions=True)

    replies = client.run(all_servers())
    problems = []
    for url, reply in zip(urls, replies):
        if isinstance(reply, RolloutError):
            problems.append(f"{url}: {reply.message} (HTTP {reply.status if reply.status is not None else 'no response'})")
        elif isinstance(reply, BaseException):
            problems.append(f"{url}: {type(reply).__name__}: {reply}")
        elif isinstance(reply, dict) and reply.get("success") is False:
            problems.append(f"{url}: {reply.get('message', 'success: false')}")
    if problems:
        raise WeightSyncError(f"{phase}: {method} {endpoint} failed on " + "; ".join(problems))
    return replies


def server_tp_sizes(client: RolloutClient, *, phase: str) -> list[int]:
    """Each server's TP size (`RolloutClient.tp_sizes`); WeightSyncError naming `phase` when a server fails."""
    try:
        return client.tp_sizes()
    except RolloutError as error:
        raise WeightSyncError(f"{phase}: {error}") from error


class UpdateSession:
    """Rank 0's side of one sync on every server: open, then publish the version and close (or abort)."""

    def __init__(self, client: RolloutClient, *, pause_mode: str | None = "in_place"):
        self.client = client
        self.pause_mode = pause_mode

    def open(self) -> None:
        """Pause, end any session a failed sync left open, and begin one on every server. When some server
        cannot begin, the sessions that did open are ended again: none is left to refuse the next sync."""
        if self.pause_mode is not None:
            call_servers(self.client, "POST", "/pause_generation", {"mode": self.pause_mode}, phase="pause generation")
        try:
            self._end_stale()
            outcomes = self._each("POST", "/begin_weight_update", {"selector": "all"})
            failed = [f"{url}: {_text(error)}" for url, error in outcomes if error is not None]
            if failed:
                opened = [url for url, error in outcomes if error is None]
                try:
                    self._each("POST", "/end_weight_update", {}, urls=opened)  # best effort; reported below
                finally:
                    raise WeightSyncError("begin weight update: POST /begin_weight_update failed on "
                                          + "; ".join(failed))
        except WeightSyncError:
            self._resume()
            raise

    def close(self, *, weight_version: str) -> None:
        """Publish `weight_version` and end the session (generation continues even if publishing fails)."""
        try:
            call_servers(self.client, "POST", "/update_weight_version",
                         {"new_version": weight_version, "abort_all_requests": False}, phase="publish weight version")
        finally:
            self.abort()

    def abort(self) -> None:
        """End the session, flush the cache and resume generation, whatever state the servers are in."""
        try:
            call_servers(self.client, "POST", "/end_weight_update", {}, phase="end weight update")
        finally:
            try:
                self._flush_cache()
            finally:
                self._resume()

    def _end_stale(self) -> None:
        """End a session a crashed or failed sync left open; a server without one refuses (400, `NO_SESSION_OPEN`),
        which is fine; any other refusal is not."""
        failed = [f"{url}: {_text(error)}" for url, error in self._each("POST", "/end_weight_update", {})
                  if error is not None and not _no_session_open(error)]
        if failed:
            raise WeightSyncError("end stale weight update: POST /end_weight_update failed on " + "; ".join(failed))

    def _each(self, method: str, endpoint: str, body: Any, *, urls: list[str] | None = None
              ) -> list[tuple[str, BaseException | str | None]]:
        """(url, None or what went wrong) of one call on each server (all of the client's unless `urls`)."""
        urls = self.client.urls if urls is None else urls

        async def all_servers() -> list:
            calls = (self.client.request(url, method, endpoint, body) for url in urls)
            return await asyncio.gather(*calls, return_exceptions=True)

        outcomes = []
        for url, reply in zip(urls, self.client.run(all_servers())):
            if isinstance(reply, BaseException):
                outcomes.append((url, reply))
            elif isinstance(reply, dict) and reply.get("success") is False:
                outcomes.append((url, str(reply.get("message", "success: false"))))
            else:
                outcomes.append((url, None))
        return outcomes

    def _flush_cache(self) -> None:
        """Drop KV computed with the old weights; a server with requests still in flight refuses (400)."""
        async def flush(url: str) -> None:
            try:
                await self.client.request(url, "POST", "/flush_cache")
            except RolloutError as error:
                if error.status != 400:
                    raise

        async def all_servers() -> list:
            return await asyncio.gather(*(flush(url) for url in self.client.urls), return_exceptions=True)

        failed = [f"{url}: {error}" for url, error in zip(self.client.urls, self.client.run(all_servers()))
                  if isinstance(error, BaseException)]
        if failed:
            raise WeightSyncError("flush cache: POST /flush_cache failed on " + "; ".join(failed))

    def _resume(self) -> None:
        if self.pause_mode is not None:
            call_servers(self.client, "POST", "/continue_generation", {}, phase="continue generation")


def _no_session_open(error: BaseException | str) -> bool:
    return isinstance(error, RolloutError) and error.status == 400 and NO_SESSION_OPEN in error.message


def _text(error: BaseException | str) -> str:
    return error.message if isinstance(error, RolloutError) else str(error)
