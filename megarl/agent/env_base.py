"""The environment interface: what an episode sees of the model's turns and what it answers.

An environment is built once per run (`Environment(tools=..., **options)`) and plays many
episodes at once, one per trajectory, on one event loop:

- `start(row)` makes an episode's state from its data row (its prompt is the episode's first
  observation, already in the batch);
- `step(episode, turn)` answers one model turn with a `Reply`: the messages the model reads
  next (role `tool` for tool results, `user` for anything else), an optional reward for this
  turn (placed on the turn's last token), and `done` (the last reply's reward ends the episode);
- `truncated(episode, unread)` is asked for the reward of an episode cut off by the response
  budget or `max_turns`, when the recipe leaves that to the environment; `unread` is the turn
  the budget cut off (never stepped on), or None;
- `demonstration(row)` optionally gives the model turns of a reference episode (texts), which
  the supervised warm-up plays against the environment to get tool-use traces.

Turns arrive as text decoded only for parsing (and their tool calls as parsed by the recipe's
format); an environment never returns token ids, so it can never change what the model generated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megarl.agent.tool_calls import ParsedTurn


@dataclass(frozen=True)
class Turn:
    """One model turn: its text (special tokens dropped), its tool calls, why generation stopped, its number
    (from 1)."""

    text: str
    parsed: ParsedTurn
    finish_reason: str
    number: int


@dataclass(frozen=True)
class Reply:
    """The environment's answer to a turn."""

    messages: list[dict[str, str]] = field(default_factory=list)
    reward: float | None = None
    done: bool = False


@dataclass(frozen=True)
class EpisodeRow:
    """What an episode knows of its data row: the prompt's uid and sample number, data source, messages,
    ground truth and extra_info."""

    uid: str
    sample: int
    data_source: str
    prompt: list[dict[str, str]]
    ground_truth: Any
    extra_info: dict[str, Any]


class Environment:
    """Base class of environments (see the module docstring); `tools` is the run's `ToolBox` (or None)."""

    def __init__(self, *, tools=None, **options: Any):
        if options:
            raise TypeError(f"{type(self).__name__} takes no options (got {sorted(options)})")
        self.tools = tools

    async def start(self, row: EpisodeRow) -> Any:
        return row

    async def step(self, episode: Any, turn: Turn) -> Reply:
        raise NotImplementedError

    async def truncated(self, episode: Any, unread: Turn | None) -> float:
        return 0.0

    def demonstration(self, row: EpisodeRow) -> list[str] | None:
        return None

    async def close(self) -> None:
        return None
