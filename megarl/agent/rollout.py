"""Multi-turn generation of a step's batch on the rollout fleet: every row one episode, packed as one response.

`MultiTurnRollout.generate` takes the generation batch a step (or validation) would hand the
fleet, with the rows' non-tensor fields (uid, data_source, reward_model, extra_info,
raw_prompt), plays every row's episode at once on the fleet's event loop (`episodes.play_all`;
each turn is one `/generate` request through the fleet, with its retries and restarts), and
returns the batch columns of single-turn generation plus:

- `response_mask`: 1 on the model's tokens only (tool and environment tokens are attended, and
  so in `attention_mask`, but never trained on);
- `env_scores` [B, R]: the environment's rewards on their tokens (the step's `token_level_scores`);
- `num_turns`, `truncated` and `turns` (each segment's speaker, text and token count) per row;

and, in `meta["multi_turn_metrics"]`, the tool counters of this call (`ToolBox.metrics_since`).
Stopping the fleet's generation (SIGTERM) cancels every episode.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from megarl.agent.chat import ChatSegments
from megarl.agent.env_base import Environment, EpisodeRow
from megarl.agent.episodes import play_all
from megarl.agent.toolbox import ToolBox
from megarl.agent.trajectory import to_tensors
from megarl.config.settings import EpisodeSettings, SamplingSettings
from megarl.protocol import Batch
from megarl.rollout.batching import assemble_rollout, prompt_token_lists
from megarl.rollout.sampling import sample_seed


def episode_rows(batch: Batch) -> list[EpisodeRow]:
    """What each row's episode knows of it: uid, sample number within its prompt's group, data source,
    messages, ground truth and extra_info. Rows without a uid (validation) are named by their dataset index."""
    seen: dict[str, int] = {}
    rows = []
    names = batch["uid"] if "uid" in batch else batch["index"] if "index" in batch else range(len(batch))
    for index in range(len(batch)):
        uid = str(names[index])
        sample, seen[uid] = seen.get(uid, 0), seen.get(uid, 0) + 1
        reward_model = batch["reward_model"][index] or {}
        rows.append(EpisodeRow(uid=uid, sample=sample, data_source=str(batch["data_source"][index]),
                               prompt=list(batch["raw_prompt"][index]), ground_truth=reward_model.get("ground_truth"),
                               extra_info=dict(batch["extra_info"][index] or {})))
    return rows


class MultiTurnRollout:
    """Episodes on `fleet` (a `megarl.rollout.fleet.RolloutFleet`): `generate` has the fleet's signature."""

    def __init__(self, fleet: Any, *, env: Environment, toolbox: ToolBox | None, chat: ChatSegments,
                 parse: Callable, settings: EpisodeSettings, pad_id: int):
        self.fleet, self.env, self.toolbox, self.chat, self.parse = fleet, env, toolbox, chat, parse
        self.settings, self.pad_id = settings, pad_id

    def generate(self, gen_batch: Batch, sampling: SamplingSettings, *, seed: int, on_rows=None) -> Batch:
        """Episodes of every row of `gen_batch`, each turn sampled with `sampling` and at most the tokens its
        episode has left (see the module docstring). `on_rows` is not called: the environment rewards each
        episode as it ends, nothing is left to score."""
        prompts = prompt_token_lists(gen_batch)
        rows = episode_rows(gen_batch)
        call_seed = self.fleet.call_seed(seed)
        before = self.toolbox.snapshot() if self.toolbox is not None else None

        async def turn(ids: list[int], max_new_tokens: int, turn_seed: int | None):
            return await self.fleet.generate_one(ids, replace(sampling, max_new_tokens=max_new_tokens),
                                                 seed=turn_seed)

        trajectories = self.fleet.run_generation(play_all(
            rows, prompts, seeds=[sample_seed(call_seed, index) for index in range(len(rows))], env=self.env,
            chat=self.chat, parse=self.parse, generate=turn, settings=self.settings))
        packed = to_tensors(trajectories, pad_id=self.pad_id, width=self.settings.budget)
        out = assemble_rollout(gen_batch, responses=packed["responses"], response_lengths=packed["response_lengths"],
                               rollout_log_probs=packed["rollout_log_probs"])
        out["response_mask"] = packed["response_mask"].to(torch.float32)
        out["env_scores"] = packed["env_scores"]
        for key in ("num_turns", "truncated", "turns"):
            out[key] = packed[key]
        for key, column in gen_batch.non_tensors.items():
            out[key] = column
        out.meta["multi_turn_metrics"] = self.toolbox.metrics_since(before) if self.toolbox is not None else {}
        return out
