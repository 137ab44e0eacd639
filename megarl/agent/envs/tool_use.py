"""`tool_use`: GSM8K-style problems solved with tools; the episode ends with the model's final answer.

A turn with tool calls is answered with the tools' results (role `tool`); the first turn
without a tool call is the final answer, scored by the GSM8K rule (`#### <number>`, strict or
flexible) against the row's ground truth, which ends the episode with that reward. Episodes
cut off are scored on their last turn's text (the cut one too) when the recipe leaves
truncation to the environment (`truncated`).

Its demonstration, for arithmetic rows ("12345+67890=?"), calls the calculator on the
expression (written in the run's tool-call format) and answers with the result: the
supervised traces that teach the call format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megarl.agent.env_base import Environment, EpisodeRow, Reply, Turn
from megarl.agent.tool_calls import ToolCall
from megarl.rewards import gsm8k

_EXPRESSION = re.compile(r"([0-9][0-9+\-*/() ]*[0-9)])\s*=\s*\?\s*$")


@dataclass
class _Episode:
    row: EpisodeRow
    last_text: str = ""


class ToolUseEnvironment(Environment):
    """Tools until an answer; reward = the GSM8K rule score of the answer (`method`: strict or flexible)."""

    def __init__(self, *, tools=None, method: str = "strict"):
        super().__init__(tools=tools)
        if method not in ("strict", "flexible"):
            raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
        self.method = method

    async def start(self, row: EpisodeRow) -> _Episode:
        return _Episode(row)

    async def step(self, episode: _Episode, turn: Turn) -> Reply:
        episode.last_text = turn.text
        if turn.parsed.has_calls and self.tools is not None:
            return Reply(messages=await self.tools.run(turn.parsed))
        return Reply(reward=self._score(episode), done=True)

    async def truncated(self, episode: _Episode, unread: Turn | None) -> float:
        if unread is not None:
            episode.last_text = unread.text
        return self._score(episode)

    def _score(self, episode: _Episode) -> float:
        truth = str(episode.row.ground_truth)
        return gsm8k.compute_score(episode.last_text, truth, method=self.method, format_score=0.0, score=1.0)

    def demonstration(self, row: EpisodeRow) -> list[str] | None:
        match = _EXPRESSION.search(str(row.extra_info.get("question") or ""))
        if match is None or self.tools is None:
            return None
        call = self.tools.format.render(ToolCall("calculator", {"expression": match.group(1).replace(" ", "")}))
        return [call, f"#### {row.ground_truth}"]
