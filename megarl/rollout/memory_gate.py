"""When a restarted server may take device memory: only while the fleet holds its own, never while a colocated
trainer uses the devices.

A colocated fleet releases its memory (`/release_memory_occupation`) before the
trainer's phases and resumes it after the weight sync. A server process that starts
in between would allocate its weights and KV cache next to the trainer's state (and
size its cache from what the trainer left free), so a restart waits here until
nothing is released; and a release waits for the starts in progress to finish, so
that every server it reaches is running and lets go of its memory. Both waits are
bounded by the caller's timeout. A fleet that never releases never waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

TAGS = ("weights", "kv_cache", "cuda_graph")


class MemoryGate:
    """The fleet's released memory tags and its server starts in progress, behind one condition."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._released: set[str] = set()
        self._starting = 0

    @property
    def released(self) -> frozenset[str]:
        with self._cond:
            return frozenset(self._released)

    def begin_start(self, *, timeout_s: float | None, stop: Callable[[], bool]) -> None:
        """Wait until the fleet holds all its memory, then count a start in progress (end it with `end_start`).
        TimeoutError after `timeout_s` (None: no limit); RuntimeError, nothing counted, when `stop()` becomes
        true (after `wake`)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._released or stop(), timeout=timeout_s):
                raise TimeoutError(f"the fleet's memory stayed released ({sorted(self._released)}) for "
                                   f"{timeout_s} s: the restart could not begin")
            if stop():
                raise RuntimeError("the fleet is shutting down")
            self._starting += 1

    def wake(self) -> None:
        """Let waiting starts look at their `stop()` again (the fleet is shutting down)."""
        with self._cond:
            self._cond.notify_all()

    def end_start(self) -> None:
        with self._cond:
            self._starting -= 1
            self._cond.notify_all()

    def release(self, tags: list[str] | None, *, timeout_s: float) -> None:
        """Wait for the starts in progress to finish, then mark `tags` (all when None) released."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._starting == 0, timeout=timeout_s):
                raise TimeoutError(f"a restarting server did not come up within {timeout_s:.0f} s; its memory "
                                   f"could not be released")
            self._released |= set(tags or TAGS)

    def resume(self, tags: list[str] | None) -> None:
        """Mark `tags` (all when None) held again; restarts waiting for the memory begin once nothing is released."""
        with self._cond:
            self._released -= set(tags or TAGS)
            self._cond.notify_all()
