"""The tool sandbox: every way a tool can misbehave is cut off with a message, and the worker is replaced.

The limits are small (2 s wall clock, 1 s CPU) so that each cut-off costs a second or two. The
namespaces are asserted where this machine grants them (root here); the degraded path, where
`unshare` is refused, is forced by making it fail, and still keeps the rlimits and the kill.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import socket
import tempfile
import threading
import time

import pytest

from megarl.agent import isolation as isolation_module
from megarl.agent.isolation import Isolation, Limits, probe
from megarl.agent.sandbox import SandboxPool
from megarl.agent.sandbox_worker import run_call

LIMITS = Limits(wall_s=2.0, cpu_s=1, memory_mb=512, max_output_bytes=65536, max_processes=32, max_file_mb=4)
GRANTED = probe([])


def _run(coroutine):
    return asyncio.run(coroutine)


async def _with_pool(calls, *, size=1, hidden=(), limits=LIMITS):
    pool = SandboxPool(tools=["calculator", "python"], size=size, limits=limits, hidden=list(hidden))
    await pool.start()
    try:
        return pool, [await pool.call(tool, arguments) for tool, arguments in calls]
    finally:
        await pool.close()


def _python(code: str):
    return ("python", {"code": code})


def test_a_normal_call_and_an_exception():
    _, (total, error, bad_argument) = _run(_with_pool([
        ("calculator", {"expression": "123456+654321"}),
        _python("print('before')\nraise KeyError('boom')"),
        ("calculator", {"expr": "1"}),
    ]))
    assert (total.kind, total.text) == ("ok", "777777")
    assert error.kind == "error" and error.text == "before\nKeyError: 'boom'"
    assert bad_argument.kind == "error" and "unexpected keyword argument 'expr'" in bad_argument.text


@pytest.mark.parametrize("code, kind, message", [
    ("import time\ntime.sleep(60)", "timeout", "ran longer than 2 s"),
    ("while True:\n    pass", "timeout", "s and was stopped"),  # the CPU limit or the wall clock, whichever first
    ("x = bytearray(2 << 30)", "memory", "more than 512 MB"),
    ("import sys\nsys.stdout.write('y' * 100_000_000)", "output", "more than 65536 bytes"),
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "timeout", "stopped"),
    ("import ctypes\nctypes.string_at(0)", "crashed", "died (signal SIGSEGV)"),
])
def test_misbehaving_tools_are_cut_off_and_their_worker_replaced(code, kind, message):
    async def scenario():
        pool = SandboxPool(tools=["python"], size=1, limits=LIMITS)
        await pool.start()
        try:
            first = pool._slots._queue[0].process.pid
            started = time.perf_counter()
            bad = await pool.call("python", {"code": code})
            elapsed = time.perf_counter() - started
            after = await pool.call("python", {"code": "print(6 * 7)"})
            return bad, elapsed, first, pool._slots._queue[0].process.pid, after
        finally:
            await pool.close()

    bad, elapsed, first_pid, second_pid, after = _run(scenario())
    assert bad.kind == kind and message in bad.text, bad
    assert elapsed < LIMITS.wall_s + 5
    assert second_pid != first_pid  # the worker that ran the bad call is gone
    assert (after.kind, after.text) == ("ok", "42")


@pytest.fixture
def scratch(monkeypatch):
    """A temp dir of the test's own, where its pools put their scratch roots: every call runs in a dir below it,
    which tells this test's calls from those another worker of the test suite runs as the same user meanwhile.
    Open to the sandbox's user on the way down, as /tmp is."""
    root = tempfile.mkdtemp(prefix="megarl-sandbox-test-")
    os.chmod(root, 0o711)
    monkeypatch.setattr(tempfile, "tempdir", root)
    yield root + os.sep
    shutil.rmtree(root, ignore_errors=True)


def _sandboxed(scratch: str, *, zombies: bool) -> list[int]:
    """The processes running as the sandbox's user that this test started: below this process (zombies too,
    while a parent of ours has not collected them), or, once orphaned, working in one of its calls' scratch dirs
    (as a call's forks do). Not those of another test running calls at the same time."""
    import psutil

    ours = {process.pid for process in psutil.Process().children(recursive=True)}
    found = []
    for process in psutil.process_iter(["uids", "status"]):
        try:
            if (process.info["uids"] is None or process.info["uids"].real != GRANTED.drop_to[0]
                    or (not zombies and process.info["status"] == psutil.STATUS_ZOMBIE)):
                continue
            if process.pid in ours or process.cwd().startswith(scratch):
                found.append(process.pid)
        except psutil.Error:
            continue  # exited meanwhile
    return sorted(found)


def test_a_fork_bomb_leaves_no_process_behind(scratch):
    if not (GRANTED.pid and GRANTED.drop_to):
        pytest.skip(f"no PID namespace or no separate user on this machine: {GRANTED.describe()}")

    def sandboxed() -> list[int]:  # the calls run as their own user: count this test's processes of that user
        return _sandboxed(scratch, zombies=True)

    before = sandboxed()
    _, (bomb,) = _run(_with_pool([_python("import os\nwhile True:\n    try:\n        os.fork()\n"
                                          "    except OSError:\n        pass")]))
    assert bomb.kind == "timeout"
    # At once, no waiting: the worker answers only after the namespace is torn down and its last process reaped.
    assert sandboxed() == before


def test_a_killed_worker_takes_its_call_with_it(scratch):
    """The call's process runs as another user, which makes the kernel forget a parent-death signal set before the
    switch: it must be set after, or a worker killed mid-call leaves the tool running (here: for a minute)."""
    if not (GRANTED.pid and GRANTED.drop_to):
        pytest.skip(f"no PID namespace or no separate user on this machine: {GRANTED.describe()}")

    def running_as_sandbox() -> list[int]:  # zombies excluded: who reaps an orphan is the system's init's business
        return _sandboxed(scratch, zombies=False)

    async def scenario():
        pool = SandboxPool(tools=["python"], size=1, limits=Limits(**{**vars(LIMITS), "wall_s": 120, "cpu_s": 120}))
        await pool.start()
        try:
            worker = pool._slots._queue[0]
            call = asyncio.ensure_future(pool.call("python", {"code": "import time\ntime.sleep(60)"}))
            started = time.monotonic()
            while not running_as_sandbox() and time.monotonic() < started + 30:
                await asyncio.sleep(0.05)
            assert running_as_sandbox(), "the tool never started"
            worker.process.kill()
            return await call
        finally:
            await pool.close()

    assert _run(scenario()).kind == "crashed"
    # The parent-death signals fire as the worker dies; the namespace's teardown takes a moment after that.
    deadline = time.monotonic() + 30
    while running_as_sandbox() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running_as_sandbox() == []


def test_no_network_and_no_run_dir(tmp_path):
    if not (GRANTED.network and GRANTED.mounts):
        pytest.skip(f"namespaces not granted on this machine: {GRANTED.describe()}")
    run_dir = tmp_path / "runs" / "exp"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("secret\n")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    socket.create_connection(("127.0.0.1", port), timeout=2).close()  # the host can reach it
    try:
        _, (net, listing, scratch) = _run(_with_pool([
            _python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"),
            _python(f"import os\nprint(os.listdir({str(run_dir)!r}))"),
            _python("import os\nopen('note.txt', 'w').write('x')\nprint(os.getcwd(), os.listdir('.'))"),
        ], hidden=[run_dir]))
    finally:
        server.close()
    assert net.kind == "error" and "Network is unreachable" in net.text
    assert listing.kind == "error" and "metrics.jsonl" not in listing.text
    assert scratch.kind == "ok" and "megarl-sandbox-" in scratch.text and "['note.txt']" in scratch.text


def test_a_slow_call_does_not_hold_up_the_others():
    async def scenario():
        pool = SandboxPool(tools=["calculator", "python"], size=2, limits=LIMITS)
        await pool.start()
        try:
            slow = asyncio.ensure_future(pool.call("python", {"code": "import time\ntime.sleep(0.8)"}))
            await asyncio.sleep(0.05)
            fast = await pool.call("calculator", {"expression": "2+2"})
            fast_done = slow.done()
            return await slow, fast, fast_done
        finally:
            await pool.close()

    slow, fast, slow_done_when_fast_returned = _run(scenario())
    assert fast.text == "4" and fast.latency_s < 0.6 and not slow_done_when_fast_returned
    assert slow.kind == "ok"


def test_where_unshare_is_refused_the_probe_says_so_and_limits_still_hold(monkeypatch, tmp_path):
    def refuse(flags):
        raise OSError(errno.EPERM, "unshare: Operation not permitted")

    monkeypatch.setattr(isolation_module, "unshare", refuse)
    degraded = probe([])
    assert degraded.flags == 0 and not degraded.network and "Operation not permitted" in degraded.missing
    assert "NO network isolation" in degraded.describe() and "run dir NOT hidden" in degraded.describe()
    tools = {"python": __import__("megarl.agent.tools", fromlist=["python"]).python}
    # Forked from this test process (torch loaded: gigabytes of address space), so no memory limit here.
    limits = Limits(**{**vars(LIMITS), "memory_mb": 1 << 20})
    common = dict(tools=tools, isolation=degraded, limits=limits, scratch_root=str(tmp_path), hidden=[])
    hang = run_call({"tool": "python", "arguments": {"code": "import time\ntime.sleep(30)"}}, **common)
    flood = run_call({"tool": "python", "arguments": {"code": "print('z' * 10**7)"}}, **common)
    fine = run_call({"tool": "python", "arguments": {"code": "1 + 1"}}, **common)
    assert hang["kind"] == "timeout" and flood["kind"] == "output" and (fine["kind"], fine["text"]) == ("ok", "2")
    assert list(tmp_path.iterdir()) == []  # every scratch dir removed


def test_isolation_round_trips_through_the_ready_line():
    assert Isolation.from_json(GRANTED.to_json()) == GRANTED


def test_an_unprivileged_worker_gets_a_user_namespace_or_says_why():
    """The same calls from a process that is not root (here: a child that dropped to `nobody`): with user
    namespaces allowed the walls stand (mapped root inside, nothing outside); without, the probe names
    what is missing."""
    import json
    import os
    import shutil
    import tempfile
    import traceback
    from pathlib import Path

    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user for the test")
    from megarl.agent.tools import python

    root = Path(tempfile.mkdtemp(prefix="megarl-unprivileged-"))  # pytest's tmp dirs are private to root
    scratch, hidden = root / "scratch", root / "run"
    scratch.mkdir()
    hidden.mkdir()
    (hidden / "metrics.jsonl").write_text("secret")
    os.chmod(root, 0o755)
    os.chmod(scratch, 0o777)
    limits = Limits(**{**vars(LIMITS), "memory_mb": 1 << 20})  # forked from this process: no memory limit here
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the unprivileged child
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            isolation_module._libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: as an exec'd unprivileged process is
            granted = probe([str(hidden)])
            calls = {name: run_call({"tool": "python", "arguments": {"code": code}}, tools={"python": python},
                                    isolation=granted, limits=limits, scratch_root=str(scratch), hidden=[str(hidden)])
                     for name, code in (("net", "import socket\nsocket.socket().connect(('127.0.0.1', 9))"),
                                        ("run_dir", f"import os\nprint(os.listdir({str(hidden)!r}))"))}
            os.write(write_end, json.dumps({"isolation": granted.to_json(), "calls": calls}).encode())
        except BaseException:  # noqa: BLE001 - the parent shows it
            os.write(write_end, json.dumps({"error": traceback.format_exc()}).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        report = json.loads(reader.read())
    os.waitpid(pid, 0)
    shutil.rmtree(root, ignore_errors=True)
    assert "error" not in report, report.get("error")
    granted = Isolation.from_json(report["isolation"])
    if granted.user_namespace:
        assert granted.network and granted.pid and granted.mounts and granted.drop_to is None
        assert "Network is unreachable" in report["calls"]["net"]["text"]
        assert report["calls"]["run_dir"] == {"kind": "ok", "text": "[]"}
    else:
        assert granted.flags == 0 and granted.missing and "NO network isolation" in granted.describe()
