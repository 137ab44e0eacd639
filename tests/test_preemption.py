"""The driver's signal handling, in this process: a first signal only requests a stop, a second one (or the
timeout) exits at once, and the previous handlers come back afterwards."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from megarl.controller.preemption import Preemption


def _wait_for_exit(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)


def test_first_signal_requests_a_stop_and_runs_the_interrupters_second_exits_at_once():
    previous = signal.getsignal(signal.SIGTERM)
    interrupted = threading.Event()
    with pytest.raises(SystemExit) as stopped:
        with Preemption(timeout_s=60) as preemption:
            preemption.on_request(interrupted.set)
            assert not preemption.requested
            os.kill(os.getpid(), signal.SIGTERM)
            assert interrupted.wait(5) and preemption.requested
            late = threading.Event()
            preemption.on_request(late.set)  # registered after the signal: called at once
            assert late.wait(5)
            os.kill(os.getpid(), signal.SIGINT)
            _wait_for_exit(5)
    assert stopped.value.code == 128 + signal.SIGINT
    assert signal.getsignal(signal.SIGTERM) == (previous if previous is not None else signal.SIG_DFL)


def test_no_checkpoint_within_the_timeout_exits_as_a_second_signal_would():
    started = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        with Preemption(timeout_s=0.3):
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for_exit(10)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert time.monotonic() - started < 5
