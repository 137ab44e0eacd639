"""The tool sandbox pool: worker processes that run tool calls behind limits, called from asyncio.

`SandboxPool.call(tool, arguments)` waits for a free worker, hands it the call and awaits its
answer without blocking the event loop, so the tool calls of many trajectories run while
others generate. Each worker (`megarl.agent.sandbox_worker`) runs every call in a fresh
confined child with the per-call limits (`isolation.Limits`: wall clock, CPU time, memory,
output bytes, processes, file size), an empty scratch directory, no network and no view of
the run directory where the platform allows (`isolation`; what is in force is logged once,
and a missing wall as a warning). A call that hangs, crashes, runs out of memory, prints too
much or forks without end comes back as a `ToolResult` whose `kind` says so and whose `text`
is the message the model reads; the worker that ran it is replaced. A worker that stops
answering is killed and replaced too. Nothing a tool does raises here.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megarl.agent.isolation import Isolation, Limits

logger = logging.getLogger(__name__)

# Kinds after which the worker that served the call is replaced (the call was cut off or died).
REPLACE_AFTER = frozenset({"timeout", "memory", "output", "crashed"})
WORKER_GRACE_S = 10.0  # beyond the call's wall clock, how long a worker may take to answer before it is killed
READY_TIMEOUT_S = 60.0


class SandboxError(RuntimeError):
    """The pool itself cannot run (a worker does not start); never raised for what a tool does."""


@dataclass(frozen=True)
class ToolResult:
    """How one call ended (`kind`: ok, error, memory, timeout, output, crashed), what the model reads, and the
    wall time the call took from the pool's side."""

    tool: str
    kind: str
    text: str
    latency_s: float

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process, isolation: Isolation):
        self.process, self.isolation = process, isolation

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


class SandboxPool:
    """`size` sandbox workers for the tools `tools` (registered names or "package.module:function" paths)."""

    def __init__(self, *, tools: list[str], size: int, limits: Limits, hidden: list[str | Path] = (),
                 log_path: str | Path | None = None):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.tools, self.size, self.limits = list(tools), size, limits
        self.hidden = [str(Path(path).resolve()) for path in hidden]
        self.log_path = log_path
        self.isolation: Isolation | None = None
        self._scratch_root: str | None = None
        self._slots: asyncio.Queue | None = None
        self._ids = itertools.count()
        self._closed = False

    @property
    def names(self) -> list[str]:
        from megarl.agent.tools import tool_name

        return [tool_name(spec) for spec in self.tools]

    async def start(self) -> None:
        """Start every worker (on the running event loop, which every later call must use); logs the isolation."""
        if self.log_path:
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        self._scratch_root = tempfile.mkdtemp(prefix="megarl-sandbox-")
        os.chmod(self._scratch_root, 0o711)  # a dropped-privilege call must reach its own scratch dir
        self._slots = asyncio.Queue()
        workers = await asyncio.gather(*(self._start_worker() for _ in range(self.size)), return_exceptions=True)
        failed = [worker for worker in workers if isinstance(worker, BaseException)]
        for worker in workers:
            if isinstance(worker, _Worker):
                self._slots.put_nowait(worker)
        if failed:
            await self.close()
            raise SandboxError(f"tool sandbox: a worker did not start: {failed[0]}")
        self.isolation = workers[0].isolation
        line = f"tool sandbox: {self.size} workers; {self.isolation.describe()}"
        (logger.warning if self.isolation.missing else logger.info)(line)

    async def _start_worker(self) -> _Worker:
        config = json.dumps({"tools": self.tools, "limits": asdict(self.limits), "hidden": self.hidden,
                             "scratch_root": self._scratch_root})
        stderr = open(self.log_path, "ab") if self.log_path else asyncio.subprocess.DEVNULL  # noqa: SIM115
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "megarl.agent.sandbox_worker", config,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=stderr,
                limit=8 * self.limits.max_output_bytes + (1 << 16),  # JSON escapes grow text
            )
        finally:
            if self.log_path:
                stderr.close()
        try:
            line = await asyncio.wait_for(process.stdout.readline(), READY_TIMEOUT_S)
            ready = json.loads(line)
            isolation = Isolation.from_json(ready["isolation"])
        except (asyncio.TimeoutError, ValueError, KeyError, TypeError) as error:
            process.kill()
            await process.wait()
            raise SandboxError(f"sandbox worker did not report ready ({type(error).__name__}: {error}); "
                               f"see {self.log_path or 'its stderr'}") from None
        return _Worker(process, isolation)

    async def call(self, tool: str, arguments: dict) -> ToolResult:
        """Run `tool(**arguments)` in a worker; the result says how it ended (never raises for the tool)."""
        if self._slots is None:
            raise SandboxError("SandboxPool.call before start()")
        started = time.perf_counter()
        worker = await self._slots.get()
        kind, text = "crashed", "the sandbox worker failed"
        try:
            if worker is None or worker.process.returncode is not None:
                worker = await self._start_worker()
            request = json.dumps({"id": next(self._ids), "tool": tool, "arguments": arguments}) + "\n"
            worker.process.stdin.write(request.encode())
            await worker.process.stdin.drain()
            line = await asyncio.wait_for(worker.process.stdout.readline(), self.limits.wall_s + WORKER_GRACE_S)
            answer = json.loads(line)
            kind, text = answer["kind"], answer["text"]
        except (asyncio.TimeoutError, ConnectionError, ValueError, KeyError, asyncio.LimitOverrunError) as error:
            logger.warning("sandbox worker failed on %s (%s: %s); replacing it", tool, type(error).__name__, error)
            kind, text = "crashed", "the sandbox worker stopped answering and was replaced"
        finally:
            # Cancelled, failed or cut off: the worker is not trusted again; the next call starts a fresh one.
            if worker is not None and (kind in REPLACE_AFTER or worker.process.returncode is not None):
                worker.kill()
                await _reap(worker)
                worker = None
            self._slots.put_nowait(worker)
        return ToolResult(tool, kind, text, time.perf_counter() - started)

    async def close(self) -> None:
        """Stop every worker (idempotent) and remove the scratch root."""
        if self._closed:
            return
        self._closed = True
        while self._slots is not None and not self._slots.empty():
            worker = self._slots.get_nowait()
            if worker is not None:
                worker.process.stdin.close()
                worker.kill()
                await _reap(worker)
        if self._scratch_root:
            shutil.rmtree(self._scratch_root, ignore_errors=True)


async def _reap(worker: _Worker) -> None:
    try:
        await asyncio.wait_for(worker.process.wait(), 5)
    except asyncio.TimeoutError:
        logger.warning("sandbox worker %d did not exit after SIGKILL", worker.process.pid)
