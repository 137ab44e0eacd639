"""megarl.processes: a shielded command survives the SIGTERM meant for the driver, and a sweep finds and stops
everything started under a mark, a grandchild in a session of its own included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl import processes

# A parent (the shielded command) that starts a child in a session of its own, as a rollout server is
# started, prints both PIDs and waits.
FAMILY = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def _blocked(pid: int) -> set[int]:
    mask = int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("SigBlk:")), 16)
    return {number for number in range(1, 65) if mask >> (number - 1) & 1}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_shielded_family_survives_sigterm_and_the_sweep_stops_all_of_it():
    mark = f"test-{os.getpid()}"
    parent = subprocess.Popen([sys.executable, "-m", "megarl.processes", "shield", sys.executable, "-c", FAMILY],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, processes.MARK_ENV: mark})
    try:
        child = int(parent.stdout.readline())
        assert os.getsid(parent.pid) == parent.pid  # the shielded command leads a session of its own
        for pid in (parent.pid, child):
            assert {signal.SIGTERM, signal.SIGUSR2} <= _blocked(pid), pid  # inherited by the child
        assert sorted(processes.marked(mark)) == sorted([parent.pid, child])
        os.kill(parent.pid, signal.SIGTERM)
        os.kill(child, signal.SIGTERM)
        time.sleep(1.0)
        assert _alive(parent.pid) and _alive(child)
        killed = processes.sweep(mark)
        assert sorted(killed) == sorted([parent.pid, child])
        assert parent.wait(timeout=10) == -signal.SIGKILL
        assert not _alive(child) and processes.marked(mark) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_servers_start_shielded_and_stop_on_sigint_only_under_the_shield(monkeypatch):
    monkeypatch.delenv(processes.SHIELD_ENV, raising=False)
    with processes.blocked_sigterm():
        plain = subprocess.Popen(["sleep", "60"])
    assert processes.stop_signal() == signal.SIGTERM and signal.SIGTERM not in _blocked(plain.pid)
    monkeypatch.setenv(processes.SHIELD_ENV, "1")
    with processes.blocked_sigterm():
        shielded = subprocess.Popen(["sleep", "60"])
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # the caller's mask is back
    assert processes.stop_signal() == signal.SIGINT and signal.SIGTERM in _blocked(shielded.pid)
    for process in (plain, shielded):
        process.kill()
        process.wait()


def test_the_worker_hook_makes_sigterm_harmless():
    script = "from megarl.processes import ignore_sigterm; import os, signal; ignore_sigterm(); " \
             "os.kill(os.getpid(), signal.SIGTERM); print('still here')"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "still here\n", done.stderr


@pytest.mark.parametrize("argv", [[], ["sweep"], ["nonsense", "x"]])
def test_usage_errors(argv, capsys):
    assert processes.main(argv) == 2
    assert "usage: python -m megarl.processes" in capsys.readouterr().err
