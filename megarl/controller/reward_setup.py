"""Building the run's reward loop from a recipe: the rule manager plus the model side it configures.

The model side is the reward model (a frozen Megatron engine group on its pool, with
its tokenizer: the policy's token ids when they tokenize alike, re-templated text
otherwise), the LLM judge (its own rollout fleet), or the remote reward client.
Everything started here registers its teardown on `cleanup`.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from megarl.cluster.engine_worker import start_engine_group
from megarl.cluster.fleet import start_fleet
from megarl.config import Recipe
from megarl.config.schema import read_hf_config
from megarl.config.settings import (
    combine_options,
    engine_settings,
    judge_fleet_settings,
    judge_sampling,
    reward_scoring_batching,
)
from megarl.controller.judge import JudgeScorer
from megarl.controller.reward_loop import ModelSide, RewardLoop
from megarl.controller.roles import RewardModelRole
from megarl.data.rm_inputs import RewardModelInputs
from megarl.data.tokenizer import load_tokenizer
from megarl.models.spec import arch_from_hf
from megarl.registry import REWARD_COMBINE_MODES
from megarl.rewards.remote import RemoteRewardClient

logger = logging.getLogger(__name__)


def _reward_model_side(recipe: Recipe, *, pool, tokenizer: Any, log_dir: Path, cleanup: ExitStack) -> ModelSide:
    rm = recipe.reward_model
    hf_config = read_hf_config(rm.path, key="reward_model.path")
    group = start_engine_group(pool, name="reward_model", settings=engine_settings(recipe, "reward_model"),
                               hf_config=hf_config, weights=rm.path, log_dir=log_dir)
    cleanup.callback(group.kill)
    inputs = RewardModelInputs(load_tokenizer(rm.tokenizer or rm.path), tokenizer,
                               max_length=arch_from_hf(hf_config).max_position_embeddings)
    logger.info("reward model %s: %s", rm.path, "responses re-templated with its own chat template"
                if inputs.retemplate else "scores the policy's token ids (same tokenization)")
    return ModelSide(reward_model=RewardModelRole(group, batching=reward_scoring_batching(recipe)), rm_inputs=inputs,
                     batch_rows=rm.batch_rows)


def _judge_side(recipe: Recipe, *, pool, api_key: str, log_dir: Path, cleanup: ExitStack) -> ModelSide:
    judge = recipe.reward.judge
    tokenizer = load_tokenizer(judge.tokenizer or judge.model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    fleet = start_fleet(judge_fleet_settings(recipe), pool=pool, weights=None, pad_token_id=pad, api_key=api_key,
                        log_dir=log_dir)
    cleanup.callback(fleet.shutdown)
    fail_score = judge.parse_fail_score if judge.parse_fail_score is not None else judge.score_range[0]
    return ModelSide(judge=JudgeScorer(fleet, tokenizer, template=judge.prompt_template, parser=judge.parser,
                                       score_range=judge.score_range, fail_score=fail_score,
                                       sampling=judge_sampling(recipe, eos_token_id=tokenizer.eos_token_id)))


def start_reward_loop(recipe: Recipe, *, pools: dict, tokenizer: Any, manager: Any, api_key: str, run_dir: Path,
                      cleanup: ExitStack) -> RewardLoop:
    """The reward loop of `megarl train`: rule scorers (`manager`), the configured model side, `reward.combine`."""
    reward = recipe.reward
    side = ModelSide()
    if recipe.reward_model is not None:
        side = _reward_model_side(recipe, pool=pools["reward_model"], tokenizer=tokenizer,
                                  log_dir=run_dir / "logs", cleanup=cleanup)
    elif reward.judge is not None:
        side = _judge_side(recipe, pool=pools["judge"], api_key=api_key, log_dir=run_dir / "logs" / "judge",
                           cleanup=cleanup)
    elif reward.remote is not None and REWARD_COMBINE_MODES.get(reward.combine).uses_rm:
        remote = reward.remote
        side = ModelSide(remote=RemoteRewardClient(remote.url, max_concurrency=remote.max_concurrency,
                                                   timeout_s=remote.timeout_s, retries=remote.retries,
                                                   backoff_s=remote.backoff_s, headers=remote.headers),
                         remote_on_failure=remote.on_failure)
    elif reward.remote is not None:
        logger.info("reward.remote %s: not called, reward.combine %r does not use the model-side score",
                    reward.remote.url, reward.combine)
    loop = RewardLoop(manager=manager, tokenizer=tokenizer, combine=reward.combine,
                      combine_options=combine_options(recipe), model_side=side)
    cleanup.callback(loop.close)
    return loop
