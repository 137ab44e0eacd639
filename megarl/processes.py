"""The processes a run starts on a node: marked so that all of them can be found and stopped, and kept out of
the way of signals meant for the driver.

Marking: a process started with `MARK_ENV=<tag>` in its environment passes the
mark to everything it starts (Ray's daemons, its workers, their multiprocessing
children, the rollout servers), whatever session or parent each ends up in.
`sweep(tag)` SIGKILLs every process still carrying the mark: what a killed
worker's `multiprocessing` manager or resource tracker would otherwise outlive.

Shielding, for the processes below a launched job's Ray node: Slurm signals
every process of a job step at once when it preempts or cancels a job with a
grace time (and a shell's job control signals a whole process group), but only
the driver should act on that SIGTERM: it checkpoints, then stops everything
it started. So
- `shielded` runs a command (the Ray node) in a session of its own with SIGTERM
  and SIGUSR2 blocked; both stay blocked in everything it starts that does not
  unblock them itself (Ray's daemons keep them blocked);
- Ray's workers unblock SIGTERM, so `ignore_sigterm` (Ray's worker set-up hook,
  `WORKER_HOOK`) makes them ignore it;
- `blocked_sigterm()` wraps the start of a server from such a worker, so the
  server (which installs its own SIGTERM handler) never sees SIGTERM either;
  servers are then stopped with SIGINT (`stop_signal()`).
The launchers turn this on with `SHIELD_ENV=1`.

    python -m megarl.processes shield CMD ...   # exec CMD shielded, in a new session
    python -m megarl.processes sweep TAG        # SIGKILL every process marked TAG
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MARK_ENV = "MEGARL_PROCESS_MARK"
SHIELD_ENV = "MEGARL_SHIELD_SIGTERM"
SHIELDED_SIGNALS = frozenset({signal.SIGTERM, signal.SIGUSR2})  # SIGUSR2: the launchers' "stop this Ray node"
WORKER_HOOK = "megarl.processes.ignore_sigterm"


def shield_on() -> bool:
    return os.environ.get(SHIELD_ENV) == "1"


def ignore_sigterm() -> None:
    """Ray worker set-up hook (runs in the worker's main thread): SIGTERM is the driver's, not this worker's."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextmanager
def blocked_sigterm() -> Iterator[None]:
    """While shielded, processes started in this block (by this thread) begin with SIGTERM blocked."""
    if not shield_on():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def stop_signal() -> signal.Signals:
    """How to ask a server started here to stop: SIGINT while shielded (SIGTERM stays blocked in it)."""
    return signal.SIGINT if shield_on() else signal.SIGTERM


def marked(tag: str) -> list[int]:
    """PIDs of the processes whose environment carries `MARK_ENV=tag` (this process excluded)."""
    needle = f"{MARK_ENV}={tag}\0".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue  # exited while we looked, or another user's
        if needle in b"\0" + environ:
            found.append(int(proc.name))
    return found


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def sweep(tag: str, *, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process marked `tag` and wait until none is left running; returns the PIDs killed."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        # Repeat: a process may start a child while the first ones are being killed.
        alive = [pid for pid in marked(tag) if not _zombie(pid)]
        if not alive or time.monotonic() > deadline:
            return killed
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def exec_shielded(argv: list[str]) -> None:
    """Replace this process by `argv`, leader of a new session, with the shielded signals blocked."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED_SIGNALS)
    os.setsid()
    os.execvp(argv[0], argv)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) >= 2 and args[0] == "shield":
        exec_shielded(args[1:])
    if len(args) == 2 and args[0] == "sweep":
        sweep(args[1])
        return 0
    print("usage: python -m megarl.processes shield CMD ... | sweep TAG", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
