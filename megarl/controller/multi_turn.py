"""`rollout.multi_turn` in a run: the agent's parts built from the recipe, the environment's rewards as the
step's reward phase, and supervised tool-use traces for the warm-up.

`start_agent` builds, on the fleet's event loop (where episodes are played), the sandbox pool of
the recipe's tools (the run directory hidden from it, its log `logs/sandbox.log`), the
environment, and the `MultiTurnRollout` that generates the step's and validation's batches.
`EpisodeRewards` stands where the reward loop stands in a single-turn run: the environment has
rewarded every episode while it was played, so the reward phase puts those rewards
(`env_scores`) into `token_level_scores` and reports the `multi_turn/*` and `tool/*` metrics.
`demonstration_batch` plays each row's reference episode (`Environment.demonstration`, the
row's answer when it has none) against the environment, so the warm-up trains on traces laid
out exactly as rollouts are: the model's turns (in the loss), the tools' replies (out of it).
"""

from __future__ import annotations

import asyncio
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megarl.agent.chat import ChatSegments
from megarl.agent.episodes import play
from megarl.agent.isolation import Limits
from megarl.agent.rollout import MultiTurnRollout, episode_rows
from megarl.agent.sandbox import SandboxPool
from megarl.agent.toolbox import ToolBox
from megarl.algorithms.metrics import multi_turn_metrics
from megarl.config.settings import MultiTurnSettings, SandboxSettings
from megarl.controller.phases import assemble_rollout, prompt_token_lists, split_generation_batch
from megarl.protocol import Batch
from megarl.registry import ENVIRONMENTS, TOOL_CALL_FORMATS
from megarl.rollout.results import GenerationResult


def sandbox_limits(sandbox: SandboxSettings) -> Limits:
    return Limits(wall_s=sandbox.wall_s, cpu_s=sandbox.cpu_s, memory_mb=sandbox.memory_mb,
                  max_output_bytes=sandbox.max_output_bytes, max_processes=sandbox.max_processes,
                  max_file_mb=sandbox.max_file_mb)


async def _agent_parts(settings: MultiTurnSettings, *, run_dir: Path) -> tuple[Any, ToolBox | None]:
    """(environment, toolbox) started on the running loop."""
    toolbox = None
    if settings.tools:
        pool = SandboxPool(tools=list(settings.tools), size=settings.sandbox.workers,
                           limits=sandbox_limits(settings.sandbox), hidden=[run_dir],
                           log_path=run_dir / "logs" / "sandbox.log")
        await pool.start()
        toolbox = ToolBox(pool, format=TOOL_CALL_FORMATS.get(settings.tool_call_format).target)
    env = ENVIRONMENTS.resolve(settings.environment).target(tools=toolbox, **settings.environment_options)
    return env, toolbox


async def _close(env: Any, toolbox: ToolBox | None) -> None:
    await env.close()
    if toolbox is not None:
        await toolbox.pool.close()


def start_agent(settings: MultiTurnSettings, *, fleet: Any, tokenizer: Any, run_dir: Path,
                cleanup: ExitStack) -> MultiTurnRollout:
    """The multi-turn generation of the run on `fleet`; its sandbox and environment stop with the run (before the
    fleet: register this after the fleet's shutdown)."""
    env, toolbox = fleet.on_loop(_agent_parts(settings, run_dir=run_dir))
    cleanup.callback(fleet.on_loop, _close(env, toolbox))
    return MultiTurnRollout(fleet, env=env, toolbox=toolbox,
                            chat=ChatSegments(tokenizer, max_tokens=settings.max_tool_response_tokens),
                            parse=TOOL_CALL_FORMATS.get(settings.tool_call_format).target.parse,
                            settings=settings.episodes, pad_id=tokenizer.pad_token_id)


class EpisodeRewards:
    """The reward phase of a multi-turn run (the reward loop's interface: `begin` a step, `finish` it)."""

    def begin(self, batch: Batch, gen_batch: Batch) -> _EpisodeScoring:
        return _EpisodeScoring()

    def close(self) -> None:
        return None


class _EpisodeScoring:
    busy_seconds = 0.0  # the environment scored during generation; nothing overlaps

    def add(self, rows, results) -> None:
        return None

    def finish(self, batch: Batch, *, rows: np.ndarray) -> tuple[Batch, dict[str, float]]:
        """`token_level_scores` = the environment's rewards; the step's multi_turn/* and tool/* metrics."""
        batch["token_level_scores"] = batch["env_scores"]
        width = batch["responses"].shape[1]
        metrics = multi_turn_metrics(num_turns=torch.as_tensor(list(batch["num_turns"])),
                                     truncated=torch.as_tensor(list(batch["truncated"])),
                                     response_mask=batch["response_mask"],
                                     response_span=batch["attention_mask"][:, -width:])
        return batch, {**metrics, **batch.meta.get("multi_turn_metrics", {})}


class _Script:
    """A generator that answers turn k of one episode with the ids of `turns[k]` and the end-of-turn token."""

    def __init__(self, turns: list[str], tokenizer: Any):
        self.turns, self.tokenizer, self.turn = turns, tokenizer, 0

    async def __call__(self, ids: list[int], max_new_tokens: int, seed: int | None) -> GenerationResult:
        text = self.turns[min(self.turn, len(self.turns) - 1)]
        self.turn += 1
        out = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        out = out[:max_new_tokens]
        return GenerationResult(out, [0.0] * len(out), "stop", None)


def demonstration_batch(prompts: Batch, settings: MultiTurnSettings, *, tokenizer: Any, env: Any,
                        chat: ChatSegments, loop: asyncio.AbstractEventLoop) -> Batch:
    """Supervised traces of `prompts` (a loader batch): prompt + the played reference episode, `loss_mask` on the
    model's turns only (see the module docstring)."""
    prompts["uid"] = np.array([str(index) for index in range(len(prompts))], dtype=object)
    rows = episode_rows(prompts)
    gen = split_generation_batch(prompts)
    parse = TOOL_CALL_FORMATS.get(settings.tool_call_format).target.parse

    async def play_every_row():
        return await asyncio.gather(*(
            play(row=row, prompt_ids=ids, env=env, chat=chat, parse=parse, settings=settings.episodes, seed=None,
                 generate=_Script(env.demonstration(row) or [str(row.extra_info.get("answer", ""))], tokenizer))
            for row, ids in zip(rows, prompt_token_lists(gen))))

    trajectories = loop.run_until_complete(play_every_row())
    width = settings.episodes.budget
    responses = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(len(rows), width)
    for index, trajectory in enumerate(trajectories):
        responses[index, :len(trajectory.response_ids)] = torch.tensor(trajectory.response_ids)
        response_mask[index, :len(trajectory.mask)] = torch.tensor(trajectory.mask, dtype=torch.float32)
    lengths = torch.tensor([len(trajectory.response_ids) for trajectory in trajectories])
    full = assemble_rollout(gen, responses=responses, response_lengths=lengths,
                            rollout_log_probs=torch.zeros(responses.shape))
    full["loss_mask"] = torch.cat([torch.zeros(gen["input_ids"].shape), response_mask], dim=1)
    return full.select(["input_ids", "attention_mask", "position_ids", "responses", "loss_mask"])


class Demonstrations:
    """The environment and tools of the warm-up's traces, on a loop of their own (the fleet is not up yet)."""

    def __init__(self, settings: MultiTurnSettings, *, tokenizer: Any, run_dir: Path):
        self.settings, self.tokenizer = settings, tokenizer
        self.loop = asyncio.new_event_loop()
        self.env, self.toolbox = self.loop.run_until_complete(_agent_parts(settings, run_dir=run_dir))
        self.chat = ChatSegments(tokenizer, max_tokens=settings.max_tool_response_tokens)

    def batch(self, prompts: Batch) -> Batch:
        return demonstration_batch(prompts, self.settings, tokenizer=self.tokenizer, env=self.env, chat=self.chat,
                                   loop=self.loop)

    def close(self) -> None:
        self.loop.run_until_complete(_close(self.env, self.toolbox))
        self.loop.close()
