"""What walls a sandboxed tool call runs behind, found once by a probe, and the system calls that raise them.

Always, on any Linux: a session and process group of its own (the whole group is killed at
the end of the call), rlimits (CPU seconds, address space, file size, open files, no core
dumps, processes), an empty scratch directory as working directory and HOME, a bare
environment, and no new privileges.

Where the platform allows, also Linux namespaces (`unshare(2)`, through libc):
- a network namespace: only a loopback device that is down, so no address is reachable;
- a PID namespace: the tool's first process is PID 1 there, and when it ends the kernel kills
  everything it started (fork bombs included), even processes that left its process group;
- a mount namespace: the run directory (and any other hidden path) is covered by an empty
  tmpfs, and /proc shows only the namespace's processes.
As root the call then runs as user `nobody`, which makes the process-count rlimit bite (root
ignores it). Unprivileged, megarl asks for a user namespace too (`CLONE_NEWUSER`, mapped to
the caller's uid), which many distributions allow; where none is allowed the call runs
without namespaces, and the pool says so (`Isolation.describe`, logged as a warning): the
tool then has the network, and the run directory is protected only by file permissions.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import pwd
import resource
import signal
from dataclasses import asdict, dataclass

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


@dataclass(frozen=True)
class Limits:
    """Per-call limits: wall clock, CPU time, address space, captured output, processes, file size."""

    wall_s: float
    cpu_s: int
    memory_mb: int
    max_output_bytes: int
    max_processes: int
    max_file_mb: int


@dataclass(frozen=True)
class Isolation:
    """The walls the probe found: namespaces unshared (flags), whether a user namespace is among them, whether
    hidden paths can be covered and /proc remounted, the uid/gid calls switch to (root only), and why a wall
    is missing."""

    flags: int = 0
    user_namespace: bool = False
    mounts: bool = False
    proc: bool = False
    drop_to: tuple[int, int] | None = None
    missing: str = ""

    @property
    def network(self) -> bool:
        return bool(self.flags & CLONE_NEWNET)

    @property
    def pid(self) -> bool:
        return bool(self.flags & CLONE_NEWPID)

    def describe(self) -> str:
        """One line for the log: what is in force and what is not."""
        walls = [
            "network namespace (no network)" if self.network else "NO network isolation",
            "PID namespace" if self.pid else "process group only",
            "run dir hidden (mount namespace)" if self.mounts else "run dir NOT hidden (file permissions only)",
            f"uid {self.drop_to[0]}" if self.drop_to else ("user namespace" if self.user_namespace else "same user"),
        ]
        return ", ".join(walls) + (f"; missing because: {self.missing}" if self.missing else "")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Isolation:
        data = json.loads(text)
        data["drop_to"] = tuple(data["drop_to"]) if data["drop_to"] else None
        return cls(**data)


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
           f"mount {target}")


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (a killed worker takes its call with it). The kernel forgets
    this on a change of uid or gid, so it is set after any."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def adopt_orphans() -> None:
    """Make this process the parent of every process its descendants orphan (a child subreaper), so that what a
    call leaves behind can be found and waited for here rather than by the system's init."""
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")


def enter_namespaces(isolation: Isolation) -> None:
    """In the call's first process: a session of its own, then the namespaces the probe found (the next child
    is PID 1 of the new PID namespace)."""
    os.setsid()
    die_with_parent()
    if not isolation.flags:
        return
    uid, gid = os.getuid(), os.getgid()
    unshare(isolation.flags)
    if isolation.user_namespace:  # map the caller to root inside, so mounts are allowed there
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {gid} 1")


def _write(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def apply_mounts(isolation: Isolation, hidden: list[str]) -> None:
    """In the new mount namespace: cover each hidden directory with an empty tmpfs, mount this PID namespace's
    /proc; nothing propagates back to the host."""
    if not isolation.mounts:
        return
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    for path in hidden:
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=000")
    if isolation.proc:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def confine(isolation: Isolation, *, scratch: str, hidden: list[str], limits: Limits) -> None:
    """In the process that runs the tool: hide paths, enter the scratch dir, set rlimits, drop privileges."""
    apply_mounts(isolation, hidden)
    if isolation.drop_to:
        os.chown(scratch, *isolation.drop_to)
    os.chdir(scratch)
    megabyte = 1 << 20
    for kind, value in ((resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
                        (resource.RLIMIT_AS, (limits.memory_mb * megabyte,) * 2),
                        (resource.RLIMIT_FSIZE, (limits.max_file_mb * megabyte,) * 2),
                        (resource.RLIMIT_NOFILE, (64, 64)),
                        (resource.RLIMIT_CORE, (0, 0)),
                        (resource.RLIMIT_NPROC, (limits.max_processes,) * 2)):
        resource.setrlimit(kind, value)
    if isolation.drop_to:
        uid, gid = isolation.drop_to
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    die_with_parent()  # after the uid change, which would clear it
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    os.environ.clear()
    os.environ.update({"HOME": scratch, "TMPDIR": scratch, "PATH": "/usr/local/bin:/usr/bin:/bin",
                       "LANG": "C.UTF-8"})


def _nobody() -> tuple[int, int] | None:
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        return None
    return entry.pw_uid, entry.pw_gid


def probe(hidden: list[str]) -> Isolation:
    """Try the namespaces (and the mounts in them) in a throw-away child; the strongest set that works."""
    root = os.geteuid() == 0
    drop_to = _nobody() if root else None
    wanted = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWNS | (0 if root else CLONE_NEWUSER)
    candidate = Isolation(flags=wanted, user_namespace=not root, mounts=True, proc=True, drop_to=drop_to)
    error = _try_in_child(candidate, hidden)
    if error is None:
        return candidate
    without_proc = Isolation(flags=wanted, user_namespace=not root, mounts=True, drop_to=drop_to,
                             missing=f"/proc not remounted ({error})")
    if _try_in_child(without_proc, hidden) is None:
        return without_proc
    return Isolation(drop_to=drop_to, missing=error)


def _try_in_child(isolation: Isolation, hidden: list[str]) -> str | None:
    """None when a child can enter `isolation` (its namespaces, and the mounts of its PID-1 grandchild); else
    the error."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(read_end)
        try:
            enter_namespaces(isolation)
            grandchild = os.fork()
            if grandchild == 0:
                apply_mounts(isolation, hidden)
                os._exit(0)
            _, status = os.waitpid(grandchild, 0)
            os._exit(os.waitstatus_to_exitcode(status))
        except OSError as error:
            os.write(write_end, str(error).encode())
        finally:
            os._exit(1)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        message = reader.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return None if code == 0 else (message or f"probe exited with status {code}")
