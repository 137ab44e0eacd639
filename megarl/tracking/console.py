"""The run's progress on stderr: a live bar on a terminal, one plain line per step into a file or a pipe.

`progress_console(total_steps, resume_step)` picks by what stderr is. On a terminal,
`BarConsole` redraws a rich progress bar in place; anywhere else (`megarl train ... > log
2>&1`, a Slurm job's `slurm-<id>.out`) `LineConsole` writes one line per step as it ends,
so a log file shows the run as it goes:

    step 12/60  score 0.512  val 0.580 (step 10)  3.2 s/step  elapsed 0:02:41  ETA 0:02:34  gen 41% ...

(step/total, the training score `critic/score/mean`, the latest validation `val/score/mean`
and its step, wall seconds per step, time since the run started, time left at the mean
pace of this session's steps, and each phase's share of the step). The SFT warm-up has its
own progress: its step against its limit and the loss against its target (a line every
`SFT_EVERY` steps in a file). Messages (the banner, checkpoints, stops) go to the same
stream, above the bar.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TextIO

from megarl.algorithms.metrics import OVERLAPPED_TIMINGS, TIMING_PHASES

SCORE_KEY = "critic/score/mean"
VAL_KEY = "val/score/mean"
# Warm-up lines in a file: one every this many steps (and the first and last).
SFT_EVERY = 50
# Phases below this share of the step are left out of the line.
MIN_SHARE = 0.01


def clock(seconds: float) -> str:
    """H:MM:SS."""
    minutes, secs = divmod(int(round(max(seconds, 0.0))), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def phase_shares(metrics: Mapping[str, float]) -> str:
    """`gen 41% update_actor 35% ...`: each phase timer's share of `timing_s/step`, in step order; timers that
    overlap other phases (`reward_total`) are not a share of the step and are left out."""
    step = metrics.get("timing_s/step")
    if not step or step <= 0:
        return ""
    shares = []
    for phase in TIMING_PHASES:
        seconds = metrics.get(f"timing_s/{phase}")
        if phase == "step" or phase in OVERLAPPED_TIMINGS or seconds is None or seconds / step < MIN_SHARE:
            continue
        shares.append(f"{phase} {100 * seconds / step:.0f}%")
    return " ".join(shares)


class Pace:
    """Elapsed time since the run started and the time left at the mean wall time of the steps seen so far."""

    def __init__(self, total: int):
        self.total, self.started = total, time.monotonic()
        self._previous: float | None = None
        self._seconds: list[float] = []

    def tick(self, first_step_seconds: float | None) -> None:
        """A step ended now; the first one of a session lasted `first_step_seconds` (its own timer)."""
        now = time.monotonic()
        seconds = now - self._previous if self._previous is not None else first_step_seconds
        if seconds is not None:
            self._seconds.append(seconds)
        self._previous = now

    def per_step(self) -> float | None:
        return sum(self._seconds) / len(self._seconds) if self._seconds else None

    def elapsed(self) -> str:
        return clock(time.monotonic() - self.started)

    def eta(self, done: int) -> str:
        per_step = self.per_step()
        return clock(per_step * (self.total - done)) if per_step is not None else "?"


class LineConsole:
    """Progress as plain lines: one per step, one every `SFT_EVERY` warm-up steps."""

    def __init__(self, total: int, resume_step: int | None, stream: TextIO):
        self.total, self.stream = total, stream
        self.pace = Pace(total - (resume_step or 0))
        self._done_at_start = resume_step or 0
        self._sft_pace: Pace | None = None
        self._last_val: tuple[float, int] | None = None

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        self._write(text)

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        if VAL_KEY in metrics:
            self._last_val = (metrics[VAL_KEY], step)
        if "timing_s/step" not in metrics:  # validation before training: no step ran
            return
        self.pace.tick(metrics["timing_s/step"])
        parts = [f"step {step}/{self.total}"]
        if SCORE_KEY in metrics:
            parts.append(f"score {metrics[SCORE_KEY]:.3f}")
        if self._last_val is not None:
            parts.append(f"val {self._last_val[0]:.3f} (step {self._last_val[1]})")
        parts += [f"{metrics['timing_s/step']:.1f} s/step", f"elapsed {self.pace.elapsed()}",
                  f"ETA {self.pace.eta(step - self._done_at_start)}", phase_shares(metrics)]
        self._write("  ".join(part for part in parts if part))

    def sft(self, step: int, limit: int, summary: str) -> None:
        if self._sft_pace is None:
            self._sft_pace = Pace(limit)
        self._sft_pace.tick(None)
        if step == 1 or step % SFT_EVERY == 0 or step == limit:
            self._write(f"sft warm-up {step}/{limit}  {summary}  elapsed {self.pace.elapsed()}  "
                        f"ETA {self._sft_pace.eta(step)}")

    def close(self) -> None:
        self.stream.flush()


class BarConsole:
    """Progress as rich bars redrawn in place: the warm-up's while it runs, then the steps'."""

    def __init__(self, total: int, resume_step: int | None, stream: TextIO):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("{task.description} {task.completed}/{task.total}"), BarColumn(),
            TextColumn("{task.fields[summary]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=Console(file=stream), transient=False,
        )
        self._progress.start()
        self._total, self._resume_step = total, resume_step or 0
        self._task = None
        self._sft_task = None
        self._last_val: tuple[float, int] | None = None

    def message(self, text: str) -> None:
        self._progress.console.print(text, highlight=False, markup=False)

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._task is None:  # after the warm-up, so its bar does not sit at 0 while the warm-up runs
            self._task = self._progress.add_task("step", total=self._total, completed=self._resume_step, summary="")
        if VAL_KEY in metrics:
            self._last_val = (metrics[VAL_KEY], step)
        parts = []
        if SCORE_KEY in metrics:
            parts.append(f"score {metrics[SCORE_KEY]:.3f}")
        if self._last_val is not None:
            parts.append(f"val {self._last_val[0]:.3f} (step {self._last_val[1]})")
        if "timing_s/step" in metrics:
            parts.append(f"{metrics['timing_s/step']:.1f} s/step")
        self._progress.update(self._task, completed=step, summary="  ".join(parts))

    def sft(self, step: int, limit: int, summary: str) -> None:
        if self._sft_task is None:
            self._sft_task = self._progress.add_task("sft warm-up", total=limit, summary="")
        self._progress.update(self._sft_task, completed=step, summary=summary)

    def close(self) -> None:
        self._progress.stop()


def progress_console(total: int, resume_step: int | None, stream: TextIO | None = None) -> LineConsole | BarConsole:
    """A `BarConsole` when `stream` (default stderr) is a terminal, else a `LineConsole`."""
    stream = stream if stream is not None else sys.stderr
    is_terminal = bool(getattr(stream, "isatty", lambda: False)())
    return (BarConsole if is_terminal else LineConsole)(total, resume_step, stream)
