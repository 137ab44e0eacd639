"""The driver's signal handling: a first signal only requests a stop, a second one (or the timeout) exits at once
with 128 + the signal, always (in this process, and as `megarl train`'s exit status wherever the second signal
lands: in a phase, in the teardown, after the run's block), and the previous handlers come back after a run that
no signal stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

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
    # Still stopping (the teardown continues after the block): a signal now is a second one, not the default action.
    assert signal.getsignal(signal.SIGTERM) == preemption._handle
    signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def test_without_a_signal_the_previous_handlers_come_back():
    previous = signal.getsignal(signal.SIGTERM)
    with Preemption(timeout_s=60):
        assert signal.getsignal(signal.SIGTERM) != previous
    assert signal.getsignal(signal.SIGTERM) == (previous if previous is not None else signal.SIG_DFL)


def test_no_checkpoint_within_the_timeout_exits_as_a_second_signal_would():
    started = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        with Preemption(timeout_s=0.3):
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for_exit(10)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert time.monotonic() - started < 5
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


DRIVER = Path(__file__).resolve().parent / "_stop_driver.py"
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml"


def _wait_for(process: subprocess.Popen, line: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.stdout.readline().strip() == line:
            return
    pytest.fail(f"no {line!r} from the driver")


@pytest.mark.robust
@pytest.mark.parametrize("scenario, first, second", [("phase", signal.SIGTERM, signal.SIGTERM),
                                                     ("teardown", signal.SIGINT, signal.SIGINT),
                                                     ("after", signal.SIGTERM, signal.SIGINT)])
def test_a_second_signal_exits_with_128_plus_it_wherever_it_lands(scenario, first, second):
    """The same status every time: not 1 (a worker failing under the teardown, whose traceback replaced the
    stop), not death by the signal (the default action, once the run's block had restored it)."""
    process = subprocess.Popen([sys.executable, str(DRIVER), scenario, str(RECIPE)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_for(process, "ready")
        process.send_signal(first)
        _wait_for(process, "tearing down")
        process.send_signal(second)
        status = process.wait(timeout=60)
    finally:
        process.kill()
        process.wait()
    stderr = process.stderr.read()
    assert status == 128 + second, (status, stderr[-2000:])
    assert "Traceback" not in stderr and "stopping at once, without a new checkpoint" in stderr
