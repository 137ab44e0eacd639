"""The processes a run starts on a node: marked so that all of them can be found and stopped, and kept out of
the way of signals meant for the driver.

Finding them: the command a launcher starts (a Ray node, this run's own Ray
head) leads a session of its own and is a child subreaper, so everything below
it stays in its session (Ray's daemons and workers, their multiprocessing
children) or, once orphaned, below it (a rollout server, which starts a session
of its own). It also runs with `MARK_ENV=<tag>` in its environment, which its
descendants inherit (though a process that sets its title, as Ray's workers
do, may no longer show it). `sweep(tag, leader)` SIGKILLs all of these: what a
killed worker's `multiprocessing` manager or resource tracker would otherwise
outlive.

Shielding, for the processes below a launched job's Ray node: Slurm signals
every process of a job step at once when it preempts or cancels a job with a
grace time (and a shell's job control signals a whole process group), but only
the driver should act on that SIGTERM: it checkpoints, then stops everything
it started. So
- `exec_leader(..., shielded=True)` runs a command (the Ray node) with SIGTERM and SIGUSR2 blocked;
  both stay blocked in everything it starts that does not unblock them itself
  (Ray's daemons keep them blocked);
- Ray's workers unblock SIGTERM and install a handler of their own when their
  loop starts, so each megarl actor calls `shield_ray_actor()` first thing;
- `blocked_sigterm()` wraps the start of a server from such a worker, so the
  server (which installs its own SIGTERM handler) never sees SIGTERM either;
  servers are then stopped with SIGINT (`stop_signal()`).
The launchers turn this on with `SHIELD_ENV=1`.

    python -m megarl.processes shield CMD ...    # exec CMD shielded, leading a new session
    python -m megarl.processes lead PID CMD ...  # the same, not blocking signals, swept once PID exits
    python -m megarl.processes sweep TAG PID     # SIGKILL what PID (the leader) and mark TAG hold
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MARK_ENV = "MEGARL_PROCESS_MARK"
SHIELD_ENV = "MEGARL_SHIELD_SIGTERM"
SHIELDED_SIGNALS = frozenset({signal.SIGTERM, signal.SIGUSR2})  # SIGUSR2: the launchers' "stop this Ray node"
_PR_SET_CHILD_SUBREAPER = 36


def shield_on() -> bool:
    return os.environ.get(SHIELD_ENV) == "1"


def shield_ray_actor() -> None:
    """First thing in a megarl Ray actor's `__init__`: under the shield, SIGTERM is the driver's, not this actor's.

    (Not Ray's worker set-up hook: Ray's worker loop installs its own SIGTERM handler after that hook ran.)
    Nothing happens outside a Ray actor, e.g. in the driver, which uses the same classes locally."""
    if not shield_on() or threading.current_thread() is not threading.main_thread():
        return
    import ray

    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
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


def _processes() -> dict[int, tuple[str, int, int]]:
    """Every live process: pid -> (state, parent pid, session id), from /proc/<pid>/stat."""
    table = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        table[int(proc.name)] = (fields[0], int(fields[1]), int(fields[3]))
    return table


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


def family(tag: str, leader: int | None = None) -> list[int]:
    """The live processes a leader started: its session, every descendant of it and of its session, and every
    process marked `tag`. This process and its ancestors are never among them."""
    table = _processes()
    members = {pid for pid in marked(tag) if pid in table}
    if leader is not None:
        members |= {pid for pid, (_, _, session) in table.items() if session == leader}
        members.add(leader)
    children: dict[int, list[int]] = {}
    for pid, (_, parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    stack = list(members)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in members:
                members.add(child)
                stack.append(child)
    spared, pid = set(), os.getpid()
    while pid in table and pid not in spared:  # this process and its ancestors
        spared.add(pid)
        pid = table[pid][1]
    return sorted(pid for pid in members - spared if pid in table and table[pid][0] != "Z")


def sweep(tag: str, leader: int | None = None, *, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL the family of `leader` and mark `tag` (see `family`) until none is left; returns the PIDs killed."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        # Again and again: a process may start a child while the first ones are being killed.
        alive = family(tag, leader)
        if not alive or time.monotonic() > deadline:
            return killed
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _watch(owner: int, tag: str, leader: int, poll_s: float = 1.0) -> None:
    """Until `owner` or `leader` exits; then sweep the leader's family."""
    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return Path(f"/proc/{pid}/stat").exists() and _processes().get(pid, ("Z",))[0] != "Z"

    while alive(owner) and alive(leader):
        time.sleep(poll_s)
    sweep(tag, leader)


def exec_leader(argv: list[str], *, shielded: bool, owner: int | None = None) -> None:
    """Replace this process by `argv`: leader of a new session, a child subreaper (orphans below it stay below
    it), with the shielded signals blocked if `shielded`. With `owner`, a watchdog in the session sweeps the
    leader's family once the owner exits (even by SIGKILL), so nothing it started outlives it."""
    if shielded:
        signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED_SIGNALS)
    try:
        os.setsid()
    except PermissionError:
        pass  # already leads its process group (a shell with job control started it): its descendants still count
    if owner is not None:
        leader = os.getpid()
        # The watchdog: in the session, but detached from the leader by a second fork (before the leader
        # becomes a subreaper), so that the leader is not its ancestor and its sweep covers the leader too.
        if os.fork() == 0:
            if os.fork() == 0:
                _watch(owner, os.environ.get(MARK_ENV, ""), leader)
            os._exit(0)
        os.wait()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    os.execvp(argv[0], argv)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) >= 2 and args[0] == "shield":
        exec_leader(args[1:], shielded=True)
    if len(args) >= 3 and args[0] == "lead" and args[1].isdigit():
        exec_leader(args[2:], shielded=False, owner=int(args[1]))
    if len(args) in (2, 3) and args[0] == "sweep" and (len(args) == 2 or args[2].isdigit()):
        sweep(args[1], int(args[2]) if len(args) == 3 else None)
        return 0
    print("usage: python -m megarl.processes shield CMD ... | lead OWNER_PID CMD ... | sweep TAG [LEADER_PID]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
