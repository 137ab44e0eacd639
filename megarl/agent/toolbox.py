"""The tools an environment may call for a model: a turn's parsed calls in, the tool messages out, counted.

`ToolBox.run(parsed)` runs a turn's well-formed calls concurrently in the sandbox pool and
answers each call with one `tool` message, in the order the model wrote them, followed by one
error message per malformed call. A call to a tool the run does not have, or with arguments
that are not an object, is answered with an error the model can read and counted in
`multi_turn/invalid_tool_calls`; nothing a model writes raises. Per tool the box counts calls,
errors (every call that did not end normally: the tool raised, or was cut off), timeouts (wall
clock or CPU time) and the seconds they took, read per step as `tool/<name>/{calls,errors,
timeouts,latency_s}` (`latency_s`: the mean over that step's calls).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from megarl.agent.sandbox import SandboxPool, ToolResult
from megarl.agent.tool_calls import ParsedTurn, ToolCall


@dataclass
class ToolCounts:
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0


class ToolBox:
    """The run's tools behind `pool`, with counters; `format` is the run's tool-call format (environments write
    demonstrated calls with it)."""

    def __init__(self, pool: SandboxPool, *, format: Any):
        self.pool, self.format = pool, format
        self.names = pool.names
        self.counts: dict[str, ToolCounts] = defaultdict(ToolCounts)
        self.invalid_calls = 0

    async def run(self, parsed: ParsedTurn) -> list[dict[str, str]]:
        """One `tool` message per call of the turn (calls in order, then the malformed ones)."""
        answers = await asyncio.gather(*(self._call(call) for call in parsed.calls))
        self.invalid_calls += len(parsed.errors)
        answers += [f"Error: malformed tool call: {error.message}: {error.text}" for error in parsed.errors]
        return [{"role": "tool", "content": answer} for answer in answers]

    async def _call(self, call: ToolCall) -> str:
        if call.name not in self.names:
            self.invalid_calls += 1
            return f"Error: unknown tool {call.name!r}; the tools are: {', '.join(self.names)}"
        result: ToolResult = await self.pool.call(call.name, call.arguments)
        counts = self.counts[call.name]
        counts.calls += 1
        counts.seconds += result.latency_s
        counts.errors += not result.ok
        counts.timeouts += result.kind == "timeout"
        return result.text if result.ok else f"Error: {result.text}"

    def snapshot(self) -> tuple[dict[str, ToolCounts], int]:
        """The counters now, to subtract later (`metrics_since`)."""
        return {name: ToolCounts(**vars(counts)) for name, counts in self.counts.items()}, self.invalid_calls

    def metrics_since(self, snapshot: tuple[dict[str, ToolCounts], int]) -> dict[str, float]:
        """`tool/<name>/*` for every tool of the run (zeros when unused) and `multi_turn/invalid_tool_calls`,
        over the calls made since `snapshot`."""
        before, invalid = snapshot
        metrics: dict[str, float] = {"multi_turn/invalid_tool_calls": float(self.invalid_calls - invalid)}
        for name in self.names:
            now, then = self.counts[name], before.get(name, ToolCounts())
            calls = now.calls - then.calls
            metrics[f"tool/{name}/calls"] = float(calls)
            metrics[f"tool/{name}/errors"] = float(now.errors - then.errors)
            metrics[f"tool/{name}/timeouts"] = float(now.timeouts - then.timeouts)
            metrics[f"tool/{name}/latency_s"] = (now.seconds - then.seconds) / calls if calls else 0.0
        return metrics
