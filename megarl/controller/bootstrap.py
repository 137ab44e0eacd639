"""What a run needs before any worker starts: tokenizer, data, reward function, initial weights.

Data problems (a missing file, a row without ground truth, a data_source with
no scorer) surface here as `InputError`, before Ray or any engine is started.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from megarl import atomic
from megarl.agent.tools import schemas
from megarl.algorithms.kl import AdaptiveKLController, FixedKLController
from megarl.config import Recipe
from megarl.config.settings import multi_turn_settings
from megarl.data.dataset import PromptLoader, RLDataset
from megarl.data.guessing import write_guessing_dataset
from megarl.data.random_digits import write_random_digits_dataset
from megarl.data.synthetic import write_arithmetic_dataset
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import InputError
from megarl.protocol import Batch
from megarl.rewards.manager import RewardManager, reward_metrics
from megarl.rewards.registry import build_scorers, check_data_sources


@dataclass
class RunData:
    tokenizer: Any
    train_dataset: RLDataset
    train_batches: PromptLoader
    val_dataset: RLDataset | None
    val_batch_size: int
    reward_manager: RewardManager  # the rule scorers by data_source
    # The outcome reward of a whole batch: the rule scorers', or the environment's with rollout.multi_turn.
    reward_fn: Callable[[Batch], tuple[torch.Tensor, dict[str, float]]]
    kl_ctrl: Any

    def val_batches(self) -> Iterator[Batch]:
        if self.val_dataset is None:
            return iter(())
        loader = PromptLoader(self.val_dataset, self.val_batch_size, shuffle=False, seed=0, drop_last=False)
        return (Batch.from_dict(next(loader)) for _ in range(loader.batches_per_epoch))


def prepare_data(recipe: Recipe, run_dir: Path) -> RunData:
    data = recipe.data
    tokenizer = load_tokenizer(recipe.model.tokenizer)
    train_files, val_files = list(data.train_files), list(data.val_files)
    if not train_files and data.synthetic is not None:
        synth = data.synthetic
        if synth.task == "guessing":
            train_path, val_path = write_guessing_dataset(run_dir / "data", synth.num_train, synth.num_val,
                                                          synth.seed, high=synth.max_operand)
        elif synth.task == "random_digits":
            train_path, val_path = write_random_digits_dataset(
                run_dir / "data", num_train=synth.num_train, num_val=synth.num_val, seed=synth.seed,
                prompt_length=synth.prompt_length or data.max_prompt_length, tokenizer=tokenizer,
            )
        else:
            train_path, val_path = write_arithmetic_dataset(
                run_dir / "data", synth.num_train, synth.num_val, synth.seed, synth.max_operand
            )
        train_files, val_files = [str(train_path)], [str(val_path)] if val_path else []
    multi_turn = multi_turn_settings(recipe)
    tools = schemas(list(multi_turn.tools)) if multi_turn is not None else None
    train_dataset = RLDataset(train_files, tokenizer, max_prompt_length=data.max_prompt_length,
                              prompt_key=data.prompt_key, tools=tools)
    val_dataset = (
        RLDataset(val_files, tokenizer, max_prompt_length=data.max_prompt_length, prompt_key=data.prompt_key,
                  tools=tools)
        if val_files else None
    )
    reward = recipe.reward
    scorers = build_scorers(reward.scorers, gsm8k_method=reward.gsm8k_method, format_score=reward.format_score,
                            score=reward.score)
    if multi_turn is None:  # episodes are rewarded by their environment
        check_data_sources(set(train_dataset.data_sources) | set(val_dataset.data_sources if val_dataset else ()),
                           scorers)
    manager = RewardManager(tokenizer, scorers, num_workers=reward.num_workers)

    def reward_fn(batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        if multi_turn is not None:
            return batch["env_scores"], {}
        output = manager(batch)
        return output.token_level_scores, reward_metrics(output)

    ctrl = recipe.algorithm.kl_ctrl
    kl_ctrl = (
        AdaptiveKLController(ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
        if ctrl.type == "adaptive" else FixedKLController(ctrl.kl_coef)
    )
    loader = PromptLoader(train_dataset, data.train_batch_size, shuffle=data.shuffle, seed=recipe.seed)
    return RunData(
        tokenizer=tokenizer,
        train_dataset=train_dataset,
        train_batches=loader,
        val_dataset=val_dataset,
        val_batch_size=data.val_batch_size or max(len(val_dataset), 1) if val_dataset else 1,
        reward_manager=manager,
        reward_fn=reward_fn,
        kl_ctrl=kl_ctrl,
    )


def prepare_initial_weights(recipe: Recipe, run_dir: Path, tokenizer) -> Path:
    """An HF checkpoint dir both the trainer and the rollout engines start from."""
    if recipe.model.path is not None:
        return Path(recipe.model.path)
    from transformers import AutoConfig, AutoModelForCausalLM

    out = run_dir / "hf_init"
    if not out.exists():  # written atomically: present means complete
        hf_config = dict(recipe.model.hf_config())
        config = AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)
        torch.manual_seed(recipe.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        needed = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
        free = shutil.disk_usage(run_dir).free
        if free < needed + (16 << 20):  # the weights, plus the tokenizer and the config with room to spare
            raise InputError(f"trainer.output_dir: the initial weights need {needed >> 20} MiB in {out}, the disk "
                             f"has {free >> 20} MiB free (got {recipe.trainer.output_dir!r})")
        with atomic.new_directory(out) as partial:
            model.save_pretrained(partial, safe_serialization=True)
            tokenizer.save_pretrained(partial)
    return out
