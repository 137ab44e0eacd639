"""The bench's progress line on stderr: the step (warm-up or measured), the phase, the time elapsed and left.

`BenchProgress` is the `on_phase(step, phase)` callback of `megarl.controller.run.train`.
The time left is the median wall time of the steps finished so far times the steps
still to run, less what the current step has already taken. On a terminal the line is
redrawn in place; into a file or pipe every phase gets a line of its own.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class BenchProgress:
    def __init__(self, *, warmup: int, steps: int, stream: TextIO | None = None):
        self.warmup, self.steps = warmup, steps
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.monotonic()
        self._step_started: float | None = None
        self._durations: list[float] = []
        self._in_place = bool(getattr(self.stream, "isatty", lambda: False)())

    @property
    def total(self) -> int:
        return self.warmup + self.steps

    def __call__(self, step: int, phase: str) -> None:
        now = time.monotonic()
        if phase == "step":
            if self._step_started is not None:
                self._durations.append(now - self._step_started)
            self._step_started = now
        self.show(self.line(step, phase, now))

    def line(self, step: int, phase: str, now: float) -> str:
        kind = (f"warm-up {step}/{self.warmup}" if step <= self.warmup
                else f"measured {step - self.warmup}/{self.steps}")
        return (f"bench: step {step}/{self.total} ({kind}) {phase:<14} elapsed {_clock(now - self.started)}, "
                f"left {self.time_left(step, now)}")

    def time_left(self, step: int, now: float) -> str:
        if not self._durations:
            return "?"
        typical = statistics.median(self._durations)
        in_step = now - self._step_started if self._step_started is not None else 0.0
        return "~" + _clock(typical * (self.total - step) + max(0.0, typical - in_step))

    def show(self, text: str) -> None:
        if self._in_place:
            self.stream.write("\r\x1b[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self, text: str) -> None:
        """End the line (on a terminal) and print `text` on its own."""
        if self._in_place:
            self.stream.write("\n")
        self.show(text)
        if self._in_place:
            self.stream.write("\n")
            self.stream.flush()
