"""A sandbox worker process: reads tool calls, runs each in a fresh confined child, answers with its result.

Started by `megarl.agent.sandbox.SandboxPool` as `python -m megarl.agent.sandbox_worker CONFIG`
(JSON: the tools to load, the limits, the paths to hide, the scratch root). It imports only
light modules (no torch), probes the isolation once and reports it on its first line, then
serves one JSON request per stdin line with one JSON answer per stdout line.

Each call forks: the child enters the namespaces (`isolation.enter_namespaces`) and forks the
process that runs the tool (PID 1 of the new PID namespace), which hides the run directory,
sets the rlimits, drops privileges (`isolation.confine`) and calls the tool with its stdout
and stderr on a pipe and its result on another. This worker reads both pipes with a cap on
the bytes, and kills the call's process group when the wall clock runs out or the output
grows past the cap. Before it answers, it kills and waits for every process the call left
(it adopts them as a child subreaper), so a call's processes never outlive its answer; the
scratch directory is removed after every call. The answer's `kind`
says how the call ended: ok, error (the tool raised), memory, timeout (wall clock or CPU
time), output (too much), crashed (killed by a signal or gone without a result).
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from megarl.agent.isolation import Isolation, Limits, adopt_orphans, confine, enter_namespaces, probe

# Imported before any call: a call that runs as `nobody` may not be able to read the interpreter's own files
# (an interpreter installed under /root), but modules already loaded here are inherited by every fork.
PRELOADED = ("array", "bisect", "cmath", "collections", "copy", "csv", "dataclasses", "datetime", "decimal",
             "encodings.idna", "enum",
             "fractions", "functools", "hashlib", "heapq", "itertools", "math", "numbers", "operator", "random", "re",
             "socket", "statistics", "string", "textwrap", "time", "typing", "unicodedata")
TOOL_EXIT_BAD = 70  # the tool process could not report (confinement failed): a crash of the sandbox, not the tool


def _load_tools(specs: list[str]) -> dict[str, Any]:
    from megarl.agent.tools import tool_name
    from megarl.registry import TOOLS

    return {tool_name(spec): TOOLS.resolve(spec).target for spec in specs}


def _run_tool(function, arguments: dict, result_fd: int) -> None:
    """In the confined process: call the tool and write {"value"} or {"error", "type"} to `result_fd`."""
    try:
        value = function(**arguments)
        answer = {"value": None if value is None else str(value)}
    except MemoryError:
        answer = {"error": "MemoryError", "type": "MemoryError"}
    except BaseException as error:  # noqa: BLE001 - whatever the tool raises is its answer
        answer = {"error": f"{type(error).__name__}: {error}", "type": type(error).__name__}
    sys.stdout.flush()
    sys.stderr.flush()
    payload = json.dumps(answer).encode()
    view = memoryview(payload)
    while view:
        view = view[os.write(result_fd, view):]


def _child(function, arguments, *, isolation, limits, scratch, hidden, out_fd, result_fd) -> None:
    """The call's first process (never returns): namespaces, then the tool's process, whose exit it relays."""
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        enter_namespaces(isolation)
        tool_pid = os.fork()
        if tool_pid == 0:
            try:
                confine(isolation, scratch=scratch, hidden=hidden, limits=limits)
                # The streams the tool prints to are the pipe, whatever this process's Python streams were.
                sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
                sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
            except BaseException:  # noqa: BLE001
                os._exit(TOOL_EXIT_BAD)
            _run_tool(function, arguments, result_fd)
            os._exit(0)
        os.close(result_fd)
        os.close(out_fd)
        _, status = os.waitpid(tool_pid, 0)
        code = os.waitstatus_to_exitcode(status)
        os._exit(128 - code if code < 0 else code)  # a signal -S becomes 128 + S, as a shell reports it
    finally:
        os._exit(TOOL_EXIT_BAD)


class _Reader:
    """Both pipes of a call, read as they fill, with one cap on their bytes together."""

    def __init__(self, out_fd: int, result_fd: int, cap: int):
        self.cap, self.over = cap, False
        self.data = {out_fd: bytearray(), result_fd: bytearray()}
        self.selector = selectors.DefaultSelector()
        for fd in self.data:
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ)

    def poll(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            self._drain(key.fd)

    def drain_all(self) -> None:
        for fd in list(self.data):
            if fd in self.selector.get_map():
                self._drain(fd)

    def _drain(self, fd: int) -> None:
        while not self.over:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                self.selector.unregister(fd)
                return
            self.data[fd] += chunk
            if sum(len(buffer) for buffer in self.data.values()) > self.cap:
                self.over = True

    def close(self) -> None:
        for fd in self.data:
            os.close(fd)
        self.selector.close()


def run_call(request: dict, *, tools: dict, isolation: Isolation, limits: Limits, scratch_root: str,
             hidden: list[str]) -> dict:
    """One call, start to end: {"kind", "text"}."""
    function = tools.get(request["tool"])
    if function is None:
        return {"kind": "error", "text": f"unknown tool {request['tool']!r}; tools: {', '.join(sorted(tools))}"}
    scratch = tempfile.mkdtemp(dir=scratch_root, prefix="call-")
    out_read, out_write = os.pipe()
    result_read, result_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(out_read)
        os.close(result_read)
        _child(function, request["arguments"], isolation=isolation, limits=limits, scratch=scratch, hidden=hidden,
               out_fd=out_write, result_fd=result_write)
    os.close(out_write)
    os.close(result_write)
    reader = _Reader(out_read, result_read, limits.max_output_bytes)
    deadline, status, cut = time.monotonic() + limits.wall_s, None, None
    try:
        while status is None:
            reader.poll(min(0.02, max(0.0, deadline - time.monotonic())))
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(raw)
                reader.drain_all()
            elif reader.over:
                cut = "output"
            elif time.monotonic() >= deadline:
                cut = "timeout"
            if cut is not None:
                _kill_group(pid)
                _, raw = os.waitpid(pid, 0)
                status = os.waitstatus_to_exitcode(raw)
        if reader.over:
            cut = "output"
    finally:
        _kill_group(pid)  # whatever the call left behind in its process group
        reader.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return _answer(status, cut, reader.data[out_read], reader.data[result_read], limits)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap_leftovers() -> None:
    """Kill and wait for every process the call left running. They are all children of this worker by now: it
    adopts orphans (`isolation.adopt_orphans`), and the call's first process is reaped. With a PID namespace the
    one left is the namespace's PID 1, whose exit the kernel completes only once every process in the namespace
    is gone; waiting for it here, before the answer, means no process of the call outlives the call (the system's
    init, which would otherwise inherit it, may reap it late or never)."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0]:
                continue
        except ChildProcessError:
            return
        for child in _children():  # not yet reaped, so the pid cannot have been reused
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.waitpid(-1, 0)


def _children() -> list[int]:
    me, found = os.getpid(), []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
            except OSError:
                continue
            if int(fields[1]) == me:
                found.append(int(entry.name))
    return found


def _answer(status: int, cut: str | None, output: bytes, result: bytes, limits: Limits) -> dict:
    text = output.decode(errors="replace")
    if cut == "output":
        return {"kind": "output", "text": f"the tool printed more than {limits.max_output_bytes} bytes and was "
                                          f"stopped"}
    if cut == "timeout":
        return {"kind": "timeout", "text": f"the tool ran longer than {limits.wall_s:g} s and was stopped"}
    if status == 128 + signal.SIGXCPU:
        return {"kind": "timeout", "text": f"the tool used more than {limits.cpu_s} s of CPU time and was stopped"}
    try:
        answer = json.loads(result) if result else None
    except ValueError:
        answer = None
    if answer is None:
        how = f"signal {signal.Signals(status - 128).name}" if status > 128 else f"exit status {status}"
        return {"kind": "crashed", "text": (text + "\n" if text else "") + f"the tool process died ({how})"}
    if answer.get("type") == "MemoryError":
        return {"kind": "memory", "text": f"the tool needed more than {limits.memory_mb} MB of memory"}
    if "error" in answer:
        return {"kind": "error", "text": text + ("\n" if text and not text.endswith("\n") else "") + answer["error"]}
    value = answer.get("value")
    parts = [part for part in (text.rstrip("\n"), value) if part]
    return {"kind": "ok", "text": "\n".join(parts)}


def main(argv: list[str]) -> None:
    config = json.loads(argv[0])
    limits = Limits(**config["limits"])
    hidden = [os.path.realpath(path) for path in config["hidden"]]
    tools = _load_tools(config["tools"])
    for module in PRELOADED:
        importlib.import_module(module)
    adopt_orphans()
    isolation = probe(hidden)
    out = sys.stdout
    out.write(json.dumps({"ready": True, "isolation": isolation.to_json()}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        answer = run_call(request, tools=tools, isolation=isolation, limits=limits,
                          scratch_root=config["scratch_root"], hidden=hidden)
        _reap_leftovers()  # here, not in run_call: it waits for every child of the process, as only a worker may
        out.write(json.dumps({"id": request["id"], **answer}) + "\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
