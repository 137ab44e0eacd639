"""Seconds this thread spends in `Batch` operations, for the controller's overhead budget (`megarl bench`).

`measure_batch_ops()` opens a measurement on the calling thread; every `Batch`
method decorated with `timed` adds its wall time to it. A call made from inside
another timed call (`__getitem__` calling `select`) is not counted twice. Without
an open measurement a timed call costs one thread-local lookup.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

F = TypeVar("F", bound=Callable)
_local = threading.local()


class BatchOpTimer:
    """What one measurement saw: `seconds` in Batch operations over `calls` outermost calls."""

    def __init__(self) -> None:
        self.seconds, self.calls, self.depth = 0.0, 0, 0


@contextmanager
def measure_batch_ops() -> Iterator[BatchOpTimer]:
    """Count the Batch operations of this thread while inside (a measurement opened inside takes over)."""
    timer, previous = BatchOpTimer(), getattr(_local, "timer", None)
    _local.timer = timer
    try:
        yield timer
    finally:
        _local.timer = previous


def timed(method: F) -> F:
    """Decorator: the method's wall time counts towards the open measurement of the calling thread."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        timer = getattr(_local, "timer", None)
        if timer is None or timer.depth:
            return method(*args, **kwargs)
        timer.depth += 1
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            timer.seconds += time.perf_counter() - start
            timer.calls += 1
            timer.depth -= 1

    return wrapper  # type: ignore[return-value]
