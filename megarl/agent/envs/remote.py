"""`remote`: an environment that lives in the user's HTTP service, with the remote reward's failure rules.

Three routes under `url`, JSON in and out (HTTP 200):

    POST <url>/start      {"uid", "sample", "data_source", "prompt", "ground_truth", "extra_info"}
                          -> {"episode_id": "<string>"}
    POST <url>/step       {"episode_id", "turn": 1, "text": "<the model's turn>", "finish_reason": "stop",
                           "tool_calls": [{"name", "arguments"}], "malformed_tool_calls": ["<message>"]}
                          -> {"messages": [{"role": "user" | "tool", "content": "..."}],
                              "reward": <number or null>, "done": <bool>}
    POST <url>/truncated  {"episode_id", "unread_text": "<the turn the budget cut off>" or null}
                          -> {"reward": <number>}
                          (asked only with rollout.multi_turn.on_truncation: environment)

Failures follow the remote reward (`megarl.rewards.remote`): a connection error, a timeout, or
HTTP 408, 429 or 5xx is retried after `backoff_s`, doubling, up to `retries` times; any other
status or an answer without the fields above fails at once. An episode that fails fails the
step, naming its uid and sample (`RemoteEnvironmentError`); it is never rewarded 0 in silence.
At most `max_concurrency` requests are in flight; each may take `timeout_s`.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import aiohttp

from megarl.agent.env_base import Environment, EpisodeRow, Reply, Turn
from megarl.rewards.remote import RequestFailed, post_json


class RemoteEnvironmentError(RuntimeError):
    """An episode the remote environment could not play; names its uid and sample and the last error."""

    def __init__(self, uid: str, sample: int, route: str, error: str):
        self.uid, self.sample = uid, sample
        super().__init__(f"remote environment failed for uid {uid} sample {sample} at /{route}: {error}")


@dataclass
class _Episode:
    row: EpisodeRow
    episode_id: str


def _number(value: Any) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"non-finite reward {number}")
    return number


def _read_start(answer: Any) -> str:
    if not isinstance(answer, dict) or not isinstance(answer.get("episode_id"), str):
        raise ValueError("no string 'episode_id'")
    return answer["episode_id"]


def _read_step(answer: Any) -> Reply:
    if not isinstance(answer, dict) or not isinstance(answer.get("done"), bool):
        raise ValueError("no boolean 'done'")
    messages = answer.get("messages", [])
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ValueError("'messages' must be a list of {role, content} strings")
    reward = answer.get("reward")
    return Reply([{"role": m["role"], "content": m["content"]} for m in messages],
                 None if reward is None else _number(reward), answer["done"])


def _read_truncated(answer: Any) -> float:
    if not isinstance(answer, dict) or "reward" not in answer:
        raise ValueError("no numeric 'reward'")
    return _number(answer["reward"])


class RemoteEnvironment(Environment):
    """Episodes played by the service at `url` (see the module docstring for routes and failure rules)."""

    def __init__(self, *, tools=None, url: str, max_concurrency: int = 32, timeout_s: float = 30.0,
                 retries: int = 3, backoff_s: float = 0.5, headers: dict[str, str] | None = None):
        super().__init__(tools=tools)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http:// or https:// URL, got {url!r}")
        self.url, self.retries, self.backoff_s = url.rstrip("/"), int(retries), float(backoff_s)
        self._timeout = aiohttp.ClientTimeout(total=float(timeout_s))
        self._max_concurrency, self._headers = int(max_concurrency), dict(headers or {})
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None

    async def _post(self, row: EpisodeRow, route: str, body: dict, read):
        if self._session is None:  # made on the loop that plays the episodes
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
            self._slots = asyncio.Semaphore(self._max_concurrency)
        try:
            return await post_json(self._session, f"{self.url}/{route}", body, slots=self._slots,
                                   retries=self.retries, backoff_s=self.backoff_s, read=read)
        except RequestFailed as failure:
            raise RemoteEnvironmentError(row.uid, row.sample, route, str(failure)) from None

    async def start(self, row: EpisodeRow) -> _Episode:
        body = {"uid": row.uid, "sample": row.sample, "data_source": row.data_source, "prompt": row.prompt,
                "ground_truth": row.ground_truth, "extra_info": row.extra_info}
        return _Episode(row, await self._post(row, "start", body, _read_start))

    async def step(self, episode: _Episode, turn: Turn) -> Reply:
        body = {"episode_id": episode.episode_id, "turn": turn.number, "text": turn.text,
                "finish_reason": turn.finish_reason,
                "tool_calls": [{"name": call.name, "arguments": call.arguments} for call in turn.parsed.calls],
                "malformed_tool_calls": [error.message for error in turn.parsed.errors]}
        return await self._post(episode.row, "step", body, _read_step)

    async def truncated(self, episode: _Episode, unread: Turn | None) -> float:
        body = {"episode_id": episode.episode_id, "unread_text": None if unread is None else unread.text}
        return await self._post(episode.row, "truncated", body, _read_truncated)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
