"""What a run needs before any worker starts: tokenizer, data, reward function, initial weights.

Data problems (a missing file, a row without ground truth, a data_source with
no scorer) surface here as `InputError`, before Ray or any engine is started.
"""

from __future__ import annotations

import functools
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from megarl import atomic
from megarl.agent.tools import schemas
from megarl.algorithms.kl import AdaptiveKLController, FixedKLController
from megarl.config import Recipe
from megarl.config.schema import read_hf_config
from megarl.config.settings import multi_turn_settings
from megarl.data.dataset import PromptLoader, RLDataset
from megarl.data.guessing import guessing_splits
from megarl.data.random_digits import random_digits_splits
from megarl.data.rows import write_rows
from megarl.data.synthetic import arithmetic_splits
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import InputError
from megarl.protocol import Batch
from megarl.rewards.manager import RewardManager, reward_metrics
from megarl.rewards.registry import build_scorers, check_data_sources, ground_truth_checks

logger = logging.getLogger(__name__)


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


def _generated_splits(recipe: Recipe, tokenizer) -> dict[str, list[dict]]:
    data, synth = recipe.data, recipe.data.synthetic
    if synth.task == "guessing":
        return guessing_splits(synth.num_train, synth.num_val, synth.seed, high=synth.max_operand)
    if synth.task == "random_digits":
        return random_digits_splits(num_train=synth.num_train, num_val=synth.num_val, seed=synth.seed,
                                    prompt_length=synth.prompt_length or data.max_prompt_length, tokenizer=tokenizer)
    return arithmetic_splits(synth.num_train, synth.num_val, synth.seed, synth.max_operand, synth.solution)


def build_datasets(recipe: Recipe, tokenizer) -> tuple[RLDataset, RLDataset | None, dict[str, list[dict]]]:
    """The training and validation prompts exactly as a run sees them (files read and checked row by row, or
    the synthetic task generated; prompts over data.max_prompt_length dropped), and the generated splits to write.
    `megarl validate` builds them too, so what it accepts a run accepts."""
    data, multi_turn = recipe.data, multi_turn_settings(recipe)
    # A multi-turn run's prompts show its tools where the chat template shows tools (Qwen: the system prompt).
    tools = schemas(list(multi_turn.tools)) if multi_turn is not None else None
    common = dict(max_prompt_length=data.max_prompt_length, prompt_key=data.prompt_key, tools=tools)
    if data.synthetic is not None:
        generated = _generated_splits(recipe, tokenizer)
        train, val = (RLDataset(generated[split], tokenizer, source="data.synthetic", **common)
                      if generated.get(split) else None for split in ("train", "test"))
        return train, val, generated
    checks = ground_truth_checks(recipe.reward.scorers)
    datasets, problems = {}, []
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        try:
            datasets[key] = (RLDataset.from_files(files, tokenizer, ground_truth_checks=checks, **common)
                             if files else None)
        except InputError as error:
            problems += [f"{key}: {problem}" for problem in error.problems]
    if problems:
        raise InputError(problems)
    return datasets["data.train_files"], datasets["data.val_files"], {}


def dataset_size_problems(recipe: Recipe, train: RLDataset, val: RLDataset | None) -> list[str]:
    """Batches the prompts that fit data.max_prompt_length cannot fill (a run's data loaders would refuse them)."""
    data, problems = recipe.data, []
    for key, dataset in (("data.train_files", train), ("data.val_files", val)):
        if dataset is not None and dataset.num_rows == 0:
            problems.append(f"{key}: the files hold no prompts (got {getattr(data, key.split('.')[1])})")
    if problems:
        return problems
    fit = f"{len(train)} of the {train.num_rows} training prompts fit data.max_prompt_length = {data.max_prompt_length}"
    batches = [("data.train_batch_size", data.train_batch_size)]
    if recipe.sft_warmup.steps:
        batches.append(("sft_warmup.batch_size", recipe.sft_warmup.batch_size))
    for key, batch in batches:
        if len(train) < batch:
            problems.append(f"{key}: more than the prompts a step can draw: {fit} (got {batch})")
    if val is not None and len(val) == 0:
        problems.append(f"data.max_prompt_length: none of the {val.num_rows} validation prompts fits "
                        f"(got {data.max_prompt_length})")
    return problems


def demonstration_problems(recipe: Recipe, train: RLDataset, val: RLDataset | None, tokenizer) -> list[str]:
    """Reference solutions the SFT warm-up would cut: it teaches each one with an EOS after it, within
    data.max_response_length tokens. A multi-turn run's warm-up replays its environment's demonstrations instead."""
    if not recipe.sft_warmup.steps or multi_turn_settings(recipe) is not None:
        return []
    room, problems = recipe.data.max_response_length - 1, []
    for split, dataset in (("training", train), ("validation", val)):
        if dataset is None or len(dataset) == 0:
            continue
        answers = [str(info.get("answer", "")) for info in dataset.extra_infos]
        lengths = [len(ids) for ids in tokenizer(answers, add_special_tokens=False)["input_ids"]]
        longer = [position for position, length in enumerate(lengths) if length > room]
        if longer:
            problems.append(
                f"data.max_response_length: {len(longer)} of the {len(answers)} {split} reference solutions that "
                f"sft_warmup teaches take more than {room} tokens (the room left for EOS); prompt {longer[0]}'s takes "
                f"{lengths[longer[0]]} (got {recipe.data.max_response_length})")
    return problems


def vocabulary_problems(recipe: Recipe, tokenizer) -> list[str]:
    """A model whose embedding has fewer rows than the tokenizer has ids would index past it."""
    size, problems = len(tokenizer), []
    configs = [("model.config.vocab_size" if recipe.model.path is None else "model.path", recipe.model.hf_config)]
    if recipe.critic is not None and recipe.critic.model_path is not None:
        critic_path = recipe.critic.model_path
        configs.append(("critic.model_path", functools.partial(read_hf_config, critic_path, key="critic.model_path")))
    for key, read_config in configs:
        vocab = read_config().get("vocab_size")
        if isinstance(vocab, int) and vocab < size:
            where = key if key.endswith("vocab_size") else f"{key}: config.json vocab_size"
            problems.append(f"{where}: smaller than the {size} ids of the tokenizer {recipe.model.tokenizer!r} "
                            f"(got {vocab})")
    return problems


def prepare_data(recipe: Recipe, run_dir: Path) -> RunData:
    data = recipe.data
    tokenizer = load_tokenizer(recipe.model.tokenizer)
    train_dataset, val_dataset, generated = build_datasets(recipe, tokenizer)
    problems = (vocabulary_problems(recipe, tokenizer) + dataset_size_problems(recipe, train_dataset, val_dataset)
                + demonstration_problems(recipe, train_dataset, val_dataset, tokenizer))
    if problems:
        raise InputError(problems)
    for dataset in (train_dataset, val_dataset):
        if dataset is not None and dataset.num_dropped:
            logger.warning("dropped %d of %d prompts longer than data.max_prompt_length=%d tokens (%s)",
                           dataset.num_dropped, dataset.num_rows, data.max_prompt_length, dataset.source)
    if generated:  # kept with the run: the data set it trained on
        atomic.write_files({run_dir / "data" / f"{split}.parquet": functools.partial(write_rows, rows)
                            for split, rows in generated.items()})
    reward, multi_turn = recipe.reward, multi_turn_settings(recipe)
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
