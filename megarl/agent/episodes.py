"""Playing episodes: the model's turns, the environment's replies, token-exact, many episodes at once.

`play` runs one episode. Each turn sends the trajectory's ids so far (prompt, every generated
token, every environment token) to the server with the budget left as `max_new_tokens`,
appends the generated ids as they came back, decodes them only to parse and to let the
environment read them, and appends the environment's reply rendered once by the chat template
(`ChatSegments`). The ids sent each turn are therefore always the previous turn's ids plus
what came since, and the trained ids are the generated ids.

An episode ends when the environment says `done` (its reward on the model's last token), or is
truncated: by the budget (a turn used the last tokens without ending, or the reply would leave
the model no token), or by `max_turns` (the last reply would never be read, so it is not
added). A truncated episode's reward follows `on_truncation`: `fixed` gives
`truncation_reward`, `environment` asks the environment (`Environment.truncated`, with the turn
the budget cut off, which it never stepped on). A turn's own reward sits on that turn's last
token.

`play_all` runs every episode of a batch as its own task on one event loop: while one waits for
a tool or the environment, the others generate, so one slow tool holds up only its episode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from megarl.agent.chat import ChatSegments
from megarl.agent.env_base import Environment, EpisodeRow, Turn
from megarl.agent.trajectory import Trajectory
from megarl.config.settings import EpisodeSettings
from megarl.rollout.results import GenerationResult

# generate(ids, max_new_tokens, seed) -> one sample continuing `ids`
Generate = Callable[[list[int], int, "int | None"], Awaitable[GenerationResult]]
SEED_STRIDE = 1009  # turns of one episode get seeds row_seed * SEED_STRIDE + turn


async def play(*, row: EpisodeRow, prompt_ids: list[int], env: Environment, chat: ChatSegments, parse,
               generate: Generate, settings: EpisodeSettings, seed: int | None) -> Trajectory:
    """One episode from `prompt_ids` (see the module docstring); `parse` is the tool-call format's parser."""
    trajectory = Trajectory(list(prompt_ids))
    episode = await env.start(row)
    unread = None  # a turn cut off by the budget: the environment never stepped on it
    tokenizer = chat.tokenizer
    while True:
        left = settings.budget - len(trajectory.response_ids)
        if settings.max_tokens_per_turn is not None:
            left = min(left, settings.max_tokens_per_turn)
        turn_seed = None if seed is None else seed * SEED_STRIDE + trajectory.turns
        result = await generate(trajectory.ids, left, turn_seed)
        if not result.output_ids:
            raise RuntimeError(f"the server generated no token for uid {row.uid} sample {row.sample}")
        text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
        trajectory.add_model_turn(list(result.output_ids), list(result.logprobs or ()), text)
        ended_with_eos = result.output_ids[-1] == chat.eos_id
        turn = Turn(text, parse(text), result.finish_reason, trajectory.turns)
        if not ended_with_eos and len(trajectory.response_ids) >= settings.budget:
            trajectory.truncated, unread = "budget", turn
            break
        reply = await env.step(episode, turn)
        if reply.reward is not None:
            trajectory.reward_last_model_token(reply.reward)
        if reply.done:
            return trajectory
        if trajectory.turns >= settings.max_turns:
            trajectory.truncated = "max_turns"
            break
        ids = chat.encode(reply.messages, turn_ended_with_eos=ended_with_eos)
        if len(ids) >= settings.budget - len(trajectory.response_ids):
            trajectory.truncated = "budget"
            break
        who = "+".join(dict.fromkeys(message["role"] for message in reply.messages)) or "environment"
        trajectory.add_environment(ids, who, "\n".join(message["content"] for message in reply.messages))
    if settings.on_truncation == "environment":
        reward = await env.truncated(episode, unread)
    else:
        reward = settings.truncation_reward
    trajectory.reward_last_model_token(reward)
    return trajectory


async def play_all(rows: Sequence[EpisodeRow], prompts: Sequence[list[int]], *, seeds: Sequence[int | None],
                   on_done: Callable[[int, Trajectory], Any] | None = None, **common: Any) -> list[Trajectory]:
    """Every episode as its own task (`common`: play's other arguments); results in row order. `on_done(row,
    trajectory)` hears about each as it ends. One failing episode (a remote environment that gave up) fails
    the call and cancels the rest."""

    async def one(index: int) -> Trajectory:
        trajectory = await play(row=rows[index], prompt_ids=prompts[index], seed=seeds[index], **common)
        if on_done is not None:
            on_done(index, trajectory)
        return trajectory

    tasks = [asyncio.ensure_future(one(index)) for index in range(len(rows))]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
