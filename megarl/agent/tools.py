"""The tool registry: the built-in tools (a calculator, a Python interpreter) and the user's, by Python path.

A tool is a function called with the keyword arguments of the model's call; it returns the
text the model reads (or None), and what it prints to stdout/stderr is read too. It always
runs inside a sandbox worker (`megarl.agent.sandbox`), never in the controller, so it may hang,
crash, print without end or fork: the sandbox cuts it off. Its metadata, `description` and
`parameters` (a JSON schema of its arguments), is what a chat template shows the model
(`schemas`).

A recipe names tools by registered name (`calculator`, `python`) or by the Python path of the
user's function, `"package.module:function"` (with an optional `registry_meta` dict attribute
for its description and parameters); `megarl validate` imports each.
"""

from __future__ import annotations

import ast
import sys
from typing import Any

from megarl.agent.calculator import evaluate, format_value
from megarl.registry import TOOLS


@TOOLS.register(
    "calculator",
    description="Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses.",
    parameters={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
)
def calculator(expression: str) -> str:
    return format_value(evaluate(expression))


@TOOLS.register(
    "python",
    description="Run a Python program and read what it prints; the value of a last bare expression is printed "
    "too. Each call starts afresh, without network, in an empty scratch directory.",
    parameters={"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
)
def python(code: str) -> None:
    if not isinstance(code, str):
        raise TypeError("code must be a string")
    module = ast.parse(code, filename="<tool>")
    last = module.body.pop() if module.body and isinstance(module.body[-1], ast.Expr) else None
    scope: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(module, "<tool>", "exec"), scope)  # noqa: S102 - the sandbox is the boundary
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)  # noqa: S307
        if value is not None:
            print(repr(value))
    sys.stdout.flush()


def schemas(specs: list[str]) -> list[dict[str, Any]]:
    """The OpenAI-style function schemas of the tools `specs` (what `apply_chat_template(tools=...)` takes)."""
    out = []
    for spec in specs:
        entry = TOOLS.resolve(spec)
        meta = dict(entry.meta)
        out.append({"type": "function", "function": {
            "name": tool_name(spec),
            "description": meta.get("description", (entry.target.__doc__ or "").strip()),
            "parameters": meta.get("parameters", {"type": "object", "properties": {}}),
        }})
    return out


def tool_name(spec: str) -> str:
    """The name the model calls a tool by: the registered name, or the function name of a Python path."""
    return spec.rpartition(":")[2]
