"""SIGTERM/SIGINT in the controller: stop at a safe point, checkpoint, stop everything, exit with `EXIT_PREEMPTED`.

The first signal only records the request and runs the registered interrupters in a
thread (the fleet cancels the generation in flight). The step loop looks at `requested`
at phase boundaries: a step that has not begun to update any weights is abandoned and
its controller state rolled back, one that has is finished. The run then writes a
checkpoint (unless the newest one already holds that step), stops every server and
worker, and `megarl train` exits with `EXIT_PREEMPTED`. A second signal, or
`timeout_s` passing after the first, raises `StoppedAtOnce(128 + signal)` (a SystemExit)
in the main thread at once: servers and workers are still stopped on the way out, but no
checkpoint is written (the newest complete one stays usable). Should even that take
longer than `HARD_EXIT_S`, the process exits on the spot with the same status, and so
does the CLI whatever the teardown meets on the way (`stop_status`: a worker that fails
under it must not turn the stop into a traceback and status 1). Later signals change
nothing.

Handlers are replaced only in the main thread and only from the `with` block on, which
must begin after `ray.init` (Ray installs a SIGTERM handler that ends the process). Once
a stop was requested they stay after the block while the run tears down: a signal then
is a second one too, never the default action (which would end the process by the
signal instead of with a status).
Ray starts its processes with SIGINT blocked, so a Ctrl-C in a terminal (sent to the
whole process group) reaches the driver and leaves the workers to be stopped by it.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: run the same command again to resume
HARD_EXIT_S = 60.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StoppedAtOnce(SystemExit):
    """A second signal, or the timeout after the first: exit at once with `code` = 128 + the signal."""


def stop_status(error: BaseException | None) -> int | None:
    """The exit status of the StoppedAtOnce that `error` is or was raised while handling, else None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, StoppedAtOnce):
            return error.code
        seen.add(id(error))
        error = error.__context__
    return None


class Preempted(Exception):
    """The run stopped on a signal after writing its checkpoint; `checkpoint` is the newest complete one."""

    def __init__(self, step: int | None, checkpoint: Path | None):
        self.step, self.checkpoint = step, checkpoint
        where = f"{checkpoint} holds step {step}" if checkpoint is not None else "no checkpoint was written yet"
        super().__init__(f"preempted: {where}; run the same command again to resume")


class Preemption:
    """The driver's signal handling for one run (a context manager)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._signum: int | None = None
        self._interrupters: list[Callable[[], None]] = []
        self._previous: dict[int, object] = {}
        self._timers: list[threading.Timer] = []
        self._stop_status: int | None = None

    @property
    def requested(self) -> bool:
        return self._signum is not None

    def on_request(self, interrupter: Callable[[], None]) -> None:
        """Call `interrupter` (from a helper thread) when a stop is requested, at once if it already was."""
        self._interrupters.append(interrupter)
        if self.requested:
            self._run_interrupters([interrupter])

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        for timer in self._timers:
            timer.cancel()
        if self.requested:
            return  # the run is stopping: a signal during the rest of its teardown is a second one (_handle)
        for signum, handler in self._previous.items():
            # None: the previous handler was not Python's (Ray's, installed in C); it cannot be put back.
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _start_timer(self, seconds: float, action: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, action)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def _run_interrupters(self, interrupters: list[Callable[[], None]]) -> None:
        # Not in the handler itself: the main thread it interrupted may hold a lock an interrupter needs.
        def run() -> None:
            for interrupter in interrupters:
                interrupter()

        threading.Thread(target=run, name="megarl-preemption", daemon=True).start()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self._signum is None:
            self._signum = signum
            os.write(2, f"\nmegarl: {name} received: finishing the current phase, then a checkpoint and a clean "
                        f"stop (at most {self.timeout_s:.0f} s; send it again to stop at once)\n".encode())
            self._start_timer(self.timeout_s, self._expire)
            self._run_interrupters(list(self._interrupters))
            return
        if self._stop_status is not None:
            return  # already stopping at once; the hard exit below bounds how long that takes
        self._stop_status = status = 128 + signum
        os.write(2, f"\nmegarl: {name}: stopping at once, without a new checkpoint\n".encode())
        self._start_timer(HARD_EXIT_S, lambda: os._exit(status))
        raise StoppedAtOnce(status)

    def _expire(self) -> None:
        os.write(2, f"\nmegarl: no checkpoint within {self.timeout_s:.0f} s of the signal: stopping\n".encode())
        _thread.interrupt_main(self._signum)  # runs _handle in the main thread as a second signal
