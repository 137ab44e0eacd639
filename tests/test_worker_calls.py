"""Typed remote calls: every call on a worker group or a server host names the method itself.

`group.run(MegatronWorker.offload, weights=True)`, never `group.run("offload", ...)`. An ast
walk of megarl/ finds every such call, refuses a string-named one, and resolves each named
method on its class with the call's keywords bound to its signature, so a misspelt method or
keyword fails here rather than on a live cluster. The groups and hosts themselves refuse a
string or another class's method before anything reaches Ray.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from megarl.cluster.engine_worker import MegatronWorker
from megarl.cluster.worker_group import WorkerGroup
from megarl.rollout.server_host import LocalHost, ServerHost

ROOT = Path(__file__).resolve().parents[1]
# The calling methods of WorkerGroup and of the server hosts (LocalHost, RayHost), and where each takes
# the method it calls: group.run(method, ...), group.run_rank(rank, method, ...), host.call(method, ...).
METHOD_ARGUMENT = {"run": 0, "dispatch_dp": 0, "call": 0, "run_rank": 1}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _remote_calls():
    """(where, module, call node, method expression) of every call on a group or host in megarl/.

    Also `callback(group.run, method, ...)` (a call handed to an ExitStack): the method is the next argument.
    """
    for path in sorted((ROOT / "megarl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Call):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in METHOD_ARGUMENT:
                index = METHOD_ARGUMENT[func.attr]
                if len(node.args) > index and not _is_other_run(func):
                    method = node.args[index]
                    # `ServerHost.restart if restart else ServerHost.start`: both branches are named methods
                    for branch in ([method.body, method.orelse] if isinstance(method, ast.IfExp) else [method]):
                        yield where, _module_name(path), node, branch
            for position, arg in enumerate(node.args[:-1]):
                if isinstance(arg, ast.Attribute) and arg.attr in ("run", "call"):
                    yield where, _module_name(path), None, node.args[position + 1]


def _is_other_run(func: ast.Attribute) -> bool:
    """`subprocess.run(...)`, `asyncio.run(...)`: not a group's `run`."""
    return isinstance(func.value, ast.Name) and func.value.id in ("subprocess", "asyncio")


def test_no_remote_call_names_its_method_by_a_string():
    named = [f"{where}: {ast.unparse(method)}" for where, _, _, method in _remote_calls()
             if isinstance(method, ast.Constant) and isinstance(method.value, str)]
    assert not named, "\n".join(named)


def test_every_named_method_exists_and_takes_the_calls_keywords():
    checked, problems = 0, []
    for where, module_name, call, method in _remote_calls():
        if not (isinstance(method, ast.Attribute) and isinstance(method.value, ast.Name)):
            continue  # e.g. `self.worker_cls.parallel_layout`: the group's own class, resolved at run time
        owner = getattr(importlib.import_module(module_name), method.value.id, None)
        if not inspect.isclass(owner):
            continue
        function = getattr(owner, method.attr, None)
        if not inspect.isfunction(function):
            problems.append(f"{where}: {owner.__name__} has no method {method.attr!r}")
            continue
        checked += 1
        parameters = inspect.signature(function).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        unknown = [kw.arg for kw in (call.keywords if call is not None else []) if kw.arg is not None
                   and kw.arg not in parameters and kw.arg != "timeout_s"]
        if unknown and not takes_any:
            problems.append(f"{where}: {owner.__name__}.{method.attr} takes no {unknown}")
    assert not problems, "\n".join(problems)
    assert checked >= 25, f"only {checked} typed calls found: is the walk still finding them?"


def _group() -> WorkerGroup:
    group = WorkerGroup.__new__(WorkerGroup)  # no Ray: only the call checks are under test
    group.name, group.worker_cls = "actor", MegatronWorker
    return group


def test_a_group_refuses_a_string_or_another_classes_method_before_ray():
    group = _group()
    with pytest.raises(TypeError, match="call a method of MegatronWorker by itself"):
        group.run("offload", weights=True)
    with pytest.raises(TypeError, match="call a method of MegatronWorker by itself"):
        group.run(ServerHost.close)
    with pytest.raises(TypeError, match="MegatronWorker.offload: missing a required argument: 'weights'"):
        group.run(MegatronWorker.offload, weight=True)
    with pytest.raises(TypeError, match="MegatronWorker.update: missing a required argument: 'settings'"):
        group.dispatch_dp(MegatronWorker.update, None)
    assert group._method_name(MegatronWorker.offload, (), {"weights": True}) == "offload"


def test_a_server_host_is_called_with_a_method_of_server_host():
    calls = []

    class Recording(ServerHost):
        def __init__(self):
            pass

        def exit_code(self):
            calls.append("exit_code")
            return 3

    host = LocalHost(Recording())
    assert host.call(ServerHost.exit_code) == 3 and calls == ["exit_code"]
    with pytest.raises(TypeError, match="a method of ServerHost"):
        host.call("exit_code")
    with pytest.raises(TypeError, match="a method of ServerHost"):
        host.call(MegatronWorker.offload)
