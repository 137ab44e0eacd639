"""What a run leaves on its host when it fails or dies: its Ray temp dir and its processes' shared memory.

Engine ranks keep weight-sync buckets in /dev/shm (torch names them `torch_<pid>_...`
after the process that made them), and a process that is killed cannot unlink them; a
driver that is SIGKILLed cannot remove its Ray temp dir either. So a run keeps a
footprint in its run directory (`.footprint.json`): the host, the driver (pid and start
time, which tell a live driver from a reused pid), the Ray temp dir it started, and the
pids of every process below the driver, refreshed while the run goes (`Footprint.watch`).

At its end, failed or not, the run removes the segments of its processes that are gone,
its temp dir (`megarl.cluster.ray_cluster` already does) and the footprint
(`Footprint.release`). The next start of the same run directory removes what a dead
previous driver left (`clear_dead_previous`): that footprint's segments and temp dir,
and only those; a footprint whose driver still lives, or that another host wrote, is
left alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import psutil

from megarl import atomic
from megarl.weightsync.groups import host_identity

FOOTPRINT = ".footprint.json"
SHM_DIR = Path("/dev/shm")
_TORCH_SEGMENT = re.compile(r"^torch_(\d+)_")
WATCH_EVERY_S = 2.0


def _started(pid: int) -> float | None:
    """When `pid` started; None when it is gone or a zombie. A zombie has exited (only its status waits for its
    parent or init to collect it, which on some hosts takes minutes): it holds no segment open, so it counts as
    dead."""
    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except psutil.Error:
        return None


def _segments_of(pids: set[int]) -> list[Path]:
    """The torch shared-memory segments in /dev/shm made by `pids`."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return [SHM_DIR / name for name in sorted(names)
            if (match := _TORCH_SEGMENT.match(name)) and int(match.group(1)) in pids]


def _remove(segments: list[Path], temp_dir: str | None) -> list[str]:
    removed = []
    for segment in segments:
        try:
            segment.unlink()
            removed.append(str(segment))
        except FileNotFoundError:
            pass
    if temp_dir and Path(temp_dir).is_dir():
        shutil.rmtree(temp_dir, ignore_errors=True)
        removed.append(temp_dir)
    return removed


class Footprint:
    """The footprint of the run in `run_dir` driven by this process (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / FOOTPRINT
        self.temp_dir: str | None = None
        self.pids: set[int] = {os.getpid()}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._write()

    def _write(self) -> None:
        record = {"host": host_identity(), "driver": [os.getpid(), _started(os.getpid())],
                  "ray_temp_dir": self.temp_dir, "pids": sorted(self.pids)}
        atomic.write_text(self.path, json.dumps(record))

    def set_temp_dir(self, temp_dir: str | None) -> None:
        with self._lock:
            self.temp_dir = temp_dir
            self._write()

    def refresh(self) -> None:
        """Add the processes now below this driver (Ray's daemons and workers, the servers they started)."""
        try:
            below = {child.pid for child in psutil.Process().children(recursive=True)}
        except psutil.Error:
            return
        with self._lock:
            if not below <= self.pids:
                self.pids |= below
                self._write()

    def watch(self) -> None:
        """Refresh every WATCH_EVERY_S seconds until `release` (a SIGKILL loses at most the last few)."""
        def loop() -> None:
            while not self._stop.wait(WATCH_EVERY_S):
                try:
                    self.refresh()
                except OSError:
                    pass  # a full disk: the record on disk keeps what it had

        threading.Thread(target=loop, name="megarl-footprint", daemon=True).start()

    def release(self, wait_s: float = 10.0) -> list[str]:
        """After the run stopped what it started: remove the segments of its processes that are gone (waiting up
        to `wait_s` for them to exit) and the footprint; returns what was removed."""
        self._stop.set()
        # Only processes that made segments are waited for: the others leave nothing here to remove (and a
        # driver inside a longer-lived process, a test session's, has children that never exit).
        made = _segments_of(self.pids - {os.getpid()})
        owners = {int(_TORCH_SEGMENT.match(segment.name).group(1)) for segment in made}
        deadline = time.monotonic() + wait_s
        while any(_started(pid) is not None for pid in owners) and time.monotonic() < deadline:
            time.sleep(0.1)
        gone = {pid for pid in owners if _started(pid) is None}
        removed = _remove(_segments_of(gone), None)
        self.path.unlink(missing_ok=True)
        return removed


def clear_dead_previous(run_dir: Path) -> list[str]:
    """Remove what the previous driver of `run_dir` left when it died without cleaning up (its footprint says
    what): its processes' segments and its Ray temp dir. Nothing when there is no footprint, when that driver
    still lives, or when another host wrote it. Returns what was removed."""
    path = Path(run_dir) / FOOTPRINT
    try:
        record = json.loads(path.read_text())
        pid, started = record["driver"]
        pids, temp_dir, host = set(record["pids"]), record.get("ray_temp_dir"), record["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if host != host_identity() or (started is not None and _started(pid) == started):
        return []  # another host's /dev/shm, or the driver is alive (a run of this directory is going on)
    dead = {each for each in pids if _started(each) is None}
    removed = _remove(_segments_of(dead), temp_dir)
    path.unlink(missing_ok=True)
    return removed
