"""Tool calls in the model's text: the formats chat templates use, parsed from a turn decoded for parsing only.

A format turns the text of one model turn into the tool calls it makes, and writes a call
the way the model should (for supervised tool-use traces). Formats are registered in
`megarl.registry.TOOL_CALL_FORMATS`; the recipe names one (`rollout.multi_turn.tool_call_format`).

`hermes` (alias `qwen`) is the format of Hermes and of Qwen2.5/Qwen3's chat templates: each
call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A malformed call (no
closing tag, JSON that does not parse, no string `name`, `arguments` that are not an object)
is not a crash: it becomes a `ParseError` the environment answers with an error message, and
is counted. The text decoded here is never re-encoded: the trajectory keeps the ids the model
generated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from megarl.registry import TOOL_CALL_FORMATS


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParseError:
    """One malformed call: what was wrong, and the text of the call (shortened) for the error message."""

    message: str
    text: str


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn read by a format: its calls in order, its malformed calls, and its text outside the calls."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ParseError] = field(default_factory=list)
    content: str = ""

    @property
    def has_calls(self) -> bool:
        """Did the turn try to call a tool (well-formed or not)?"""
        return bool(self.calls or self.errors)


def _shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class HermesFormat:
    """`<tool_call>{json}</tool_call>`, any number per turn (Hermes, Qwen2.5, Qwen3)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def parse(self, text: str) -> ParsedTurn:
        calls, errors = [], []
        for body in self._CALL.findall(text):
            call = self._read(body)
            (calls if isinstance(call, ToolCall) else errors).append(call)
        rest = self._CALL.sub("", text)
        if self.OPEN in rest:  # an opening tag left after removing the complete calls: never closed
            tail = rest[rest.index(self.OPEN):]
            errors.append(ParseError(f"{self.OPEN} without {self.CLOSE}", _shorten(tail)))
            rest = rest[: rest.index(self.OPEN)]
        return ParsedTurn(calls, errors, rest.strip())

    def _read(self, body: str) -> ToolCall | ParseError:
        try:
            payload = json.loads(body)
        except ValueError as error:
            return ParseError(f"the call is not valid JSON ({error})", _shorten(body.strip()))
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
            return ParseError('the call needs a string "name"', _shorten(body.strip()))
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        if not isinstance(arguments, dict):
            return ParseError('"arguments" must be a JSON object', _shorten(body.strip()))
        return ToolCall(payload["name"], arguments)

    def render(self, call: ToolCall) -> str:
        """The text of `call` as the model should write it (compact JSON: fewer tokens to learn)."""
        payload = json.dumps({"name": call.name, "arguments": call.arguments}, separators=(",", ":"))
        return f"{self.OPEN}{payload}{self.CLOSE}"


_HERMES = HermesFormat()
TOOL_CALL_FORMATS.add("hermes", _HERMES)
TOOL_CALL_FORMATS.add("qwen", _HERMES)
