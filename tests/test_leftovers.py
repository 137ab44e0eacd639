"""A run's leftovers on its host (`megarl.cluster.leftovers`): what a failed run's processes left in /dev/shm goes
when the run ends, and the next start of a run directory removes what a dead previous driver of that directory
left (its segments and its Ray temp dir), and only those: never what a live driver, another host or another
process owns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megarl.cluster.leftovers import FOOTPRINT, SHM_DIR, Footprint, clear_dead_previous, host_identity

pytestmark = pytest.mark.robust

# A process that puts a tensor into torch's named shared memory (as the weight-sync buckets are). torch's
# shm manager (a process of its own session) unlinks a dead client's segments, unless it is killed too, as a
# sweep of everything a run started does: then the segment stays.
LEAKER = """
import os, sys, torch, torch.multiprocessing
torch.multiprocessing.set_sharing_strategy("file_system")
tensor = torch.zeros(1024)
tensor.share_memory_()
print(os.getpid(), flush=True)
sys.stdin.readline()
"""


def _segments(pid: int) -> list[str]:
    return [name for name in os.listdir(SHM_DIR) if name.startswith(f"torch_{pid}_")]


def _dead_pid() -> tuple[int, float]:
    """The pid and start time of a process that has exited (and whose pid nothing reused yet)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(process.pid).create_time()
    process.wait()
    return process.pid, started


def _zombie() -> subprocess.Popen:
    """A child that has exited and that nothing has collected yet (what a killed run's process stays while the
    host's init is slow to reap it)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while psutil.Process(process.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    return process


def test_a_run_removes_the_segments_its_killed_processes_left(tmp_path):
    footprint = Footprint(tmp_path)
    leaker = subprocess.Popen([sys.executable, "-c", LEAKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        pid = int(leaker.stdout.readline())
        footprint.refresh()  # (the run's watch thread does this every few seconds)
        assert pid in json.loads((tmp_path / FOOTPRINT).read_text())["pids"]
        assert _segments(pid), "torch made no named segment"
        for process in [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]:
            process.send_signal(signal.SIGKILL)  # the manager first, so nothing unlinks the segment
        assert leaker.wait(timeout=60) == -signal.SIGKILL
    finally:
        leaker.kill()
    assert _segments(pid), "SIGKILL left nothing to clean up: the test shows nothing"
    removed = footprint.release()
    assert _segments(pid) == [] and all(f"torch_{pid}_" in name for name in removed) and removed
    assert not (tmp_path / FOOTPRINT).exists()


def test_the_next_start_removes_what_a_dead_driver_left_and_only_that(tmp_path):
    driver, started = _dead_pid()
    worker, _ = _dead_pid()
    stranger, _ = _dead_pid()  # dead too, but not of this run
    zombie = _zombie()  # exited, not yet collected: dead too
    temp_dir = tmp_path / "megarl-ray-dead"
    (temp_dir / "session_latest").mkdir(parents=True)
    segments = {pid: SHM_DIR / f"torch_{pid}_1234_0" for pid in (worker, zombie.pid, stranger, os.getpid())}
    for segment in segments.values():
        segment.write_bytes(b"x")
    record = {"host": host_identity(), "driver": [driver, started], "ray_temp_dir": str(temp_dir),
              "pids": [driver, worker, zombie.pid, os.getpid()]}
    try:
        # Another host's footprint (a run directory on a shared disk): its /dev/shm is not this one.
        (tmp_path / FOOTPRINT).write_text(json.dumps({**record, "host": "elsewhere/0"}))
        assert clear_dead_previous(tmp_path) == [] and temp_dir.is_dir()
        # A live driver: a run of this directory is going on; nothing of it is touched.
        (tmp_path / FOOTPRINT).write_text(json.dumps({**record, "driver": [os.getpid(),
                                                                          psutil.Process().create_time()]}))
        assert clear_dead_previous(tmp_path) == [] and temp_dir.is_dir()
        # The dead driver's: its dead worker's segment and its temp dir go; a live process's (this one, listed
        # too) and a stranger's stay.
        (tmp_path / FOOTPRINT).write_text(json.dumps(record))
        assert sorted(clear_dead_previous(tmp_path)) == sorted([str(segments[worker]), str(segments[zombie.pid]),
                                                                str(temp_dir)])
        assert not segments[worker].exists() and not segments[zombie.pid].exists()
        assert not temp_dir.exists() and not (tmp_path / FOOTPRINT).exists()
        assert segments[stranger].exists() and segments[os.getpid()].exists()
    finally:
        zombie.wait()
        for segment in segments.values():
            segment.unlink(missing_ok=True)


def test_an_unreadable_footprint_is_ignored(tmp_path):
    (tmp_path / FOOTPRINT).write_text("{not json")
    assert clear_dead_previous(tmp_path) == []
    assert clear_dead_previous(Path(tmp_path / "no-such-run")) == []


def test_release_waits_only_for_processes_that_made_segments(tmp_path):
    # A run inside a longer-lived process (a test session's Ray) has children that never exit and made no
    # segment: nothing of theirs is to be removed, so release does not wait for them. Played in a process of its
    # own, whose one child is that bystander: this test process's other children (the session's Ray workers and
    # servers) may own segments of their own, which release waits for (CI of 54e18b8 waited the full 30 s).
    code = f"""
import json, subprocess, sys, time
from pathlib import Path
from megarl.cluster.leftovers import FOOTPRINT, Footprint
run = Path({str(tmp_path)!r})
footprint = Footprint(run)
bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
try:
    footprint.refresh()
    recorded = bystander.pid in json.loads((run / FOOTPRINT).read_text())["pids"]
    started = time.monotonic()
    removed = footprint.release(wait_s=30)
    print(json.dumps([recorded, removed, time.monotonic() - started, bystander.poll() is None, (run / FOOTPRINT).exists()]))
finally:
    bystander.kill()
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    recorded, removed, waited_s, bystander_alive, footprint_left = json.loads(result.stdout)
    assert recorded and removed == [] and bystander_alive and not footprint_left
    assert waited_s < 10  # 30 s if it waited; a loaded machine's scheduling stays far below