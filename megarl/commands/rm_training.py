"""`megarl train-rm`: fit the recipe's reward model to preference pairs and write the HF checkpoint it loads.

Order: run directory (`<output_dir>/<name>/train-rm/` holds the pairs, `metrics.jsonl`
and TensorBoard files), tokenizers and pairs (re-templated exactly as the reward-model
role will see rows in `megarl train`), the starting weights (optionally after
`sft_steps` supervised steps, run here on the reward model's pool), Ray and the
reward model's pool, one Megatron engine group of kind "reward", then epochs of shuffled
mini-batches (one Bradley-Terry optimizer step each) with validation accuracy (the
share of validation pairs scored chosen > rejected) every `val_every` steps and at
the end. The result is an HF `*ForSequenceClassification` checkpoint (num_labels 1,
the pad id, the tokenizer) written atomically to `reward_model.path`. The pad id is
the reward model tokenizer's pad token, or its EOS when it has none (the log says
so): the score is read at HF's pooling token for that pad id (the rightmost token
that is not the pad id; with pad = EOS, the token before a trailing EOS), in
training as in HF. Pairs may carry a `margin` (`megarl.data.preference`). Each rank
saves its own shards as a weights-only checkpoint (`train-rm/rm_checkpoint`, removed
after), and once the ranks are gone `megarl export`'s conversion makes the HF files
here, so no rank ever holds the whole model and this process holds it once, in its
dtype.
"""

from __future__ import annotations

import json
import logging
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megarl import atomic
from megarl.cluster.engine_worker import MegatronWorker, start_engine_group
from megarl.cluster.placement import plan_pools
from megarl.cluster.ray_cluster import ray_for_run
from megarl.commands.warmup import warmed_up_checkpoint
from megarl.config import Recipe
from megarl.config.schema import read_hf_config
from megarl.config.settings import engine_settings, preference_update_settings, reward_scoring_batching
from megarl.controller.bootstrap import prepare_data, prepare_initial_weights
from megarl.controller.preflight import check_reward_model_training, prepare_run_dir
from megarl.controller.roles import RewardModelRole
from megarl.data.preference import read_pairs, write_arithmetic_preferences
from megarl.data.rm_inputs import RewardModelInputs
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import InputError
from megarl.models.spec import arch_from_hf, reward_model_hf_config
from megarl.protocol import Batch
from megarl.tracking.tracker import Tracker

logger = logging.getLogger(__name__)
SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class RewardModelResult:
    path: Path
    val_accuracy: float
    steps: int


def _trim_left_padding(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Left-padded rows cut to their longest real sequence (the pad columns every row shares go)."""
    width = max(int(rows["attention_mask"].sum(-1).max()), 1)
    return {key: value[:, -width:] for key, value in rows.items()}


@dataclass
class Pairs:
    """Tokenized pairs: `chosen` and `rejected` reward-model rows and the `margin` [N] the chosen score should
    exceed the rejected one by (0 where the pair file has none), pair i in row i of each."""

    chosen: dict[str, torch.Tensor]
    rejected: dict[str, torch.Tensor]
    margin: torch.Tensor

    @classmethod
    def build(cls, rows: list[dict], inputs: RewardModelInputs) -> Pairs:
        messages = [row["prompt"] for row in rows]
        chosen, rejected = (inputs.from_text(messages=messages, responses=[row[side] for row in rows])
                            for side in SIDES)
        return cls(chosen, rejected, torch.tensor([float(row.get("margin") or 0.0) for row in rows]))

    def __len__(self) -> int:
        return len(self.chosen["input_ids"])

    def batch(self, index: np.ndarray) -> Batch:
        """The update rows of pairs `index`: chosen_* and rejected_* sequences and their margins."""
        columns = {"margin": self.margin[index]}
        for side, rows in zip(SIDES, (self.chosen, self.rejected)):
            columns.update({f"{side}_{key}": value for key, value in
                            _trim_left_padding({k: v[index] for k, v in rows.items()}).items()})
        return Batch.from_dict(columns)


def _pair_files(recipe: Recipe, data_dir: Path) -> tuple[list[Path], list[Path]]:
    train = recipe.reward_model.train
    if train.synthetic is not None:
        synth = train.synthetic
        paths = write_arithmetic_preferences(data_dir, synth.num_train, synth.num_val, synth.seed, synth.max_operand)
        return [paths[0]], [paths[1]]
    return [Path(f).expanduser() for f in train.train_files], [Path(f).expanduser() for f in train.val_files]


def _write_reward_model(path: Path, checkpoint: Path, config: dict, tokenizer: Any) -> None:
    """The reward model saved in `checkpoint` as an HF checkpoint at `path`, all or nothing: `megarl export`'s
    conversion (backbone and `score.weight` in the engine's dtype), then `config` and the tokenizer."""
    from megarl.engines.export import export_checkpoint

    with atomic.new_directory(path) as partial:
        export_checkpoint(checkpoint, partial)
        (partial / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))  # with the rows' pad id
        tokenizer.save_pretrained(partial)


def _validate(role: RewardModelRole, pairs: Pairs) -> dict[str, float]:
    margin = role.score(pairs.chosen) - role.score(pairs.rejected)
    return {"val/rm_accuracy": float((margin > 0).float().mean()), "val/rm_margin": float(margin.mean())}


def train_reward_model(recipe: Recipe, *, ray_address: str | None = None) -> RewardModelResult:
    """Run `megarl train-rm` for `recipe`; returns where the reward model went and its final validation accuracy."""
    problems = check_reward_model_training(recipe)
    if problems:
        raise InputError(problems)
    rm, train = recipe.reward_model, recipe.reward_model.train
    run_dir = prepare_run_dir(recipe)
    log_dir = run_dir / "train-rm"
    policy_tokenizer = load_tokenizer(recipe.model.tokenizer)
    if train.init_path is not None:
        weights, hf_config = Path(train.init_path), read_hf_config(train.init_path, key="reward_model.train.init_path")
    else:
        weights, hf_config = prepare_initial_weights(recipe, run_dir, policy_tokenizer), recipe.model.hf_config()
    rm_tokenizer = load_tokenizer(rm.tokenizer) if rm.tokenizer else policy_tokenizer
    inputs = RewardModelInputs(rm_tokenizer, policy_tokenizer,
                               max_length=arch_from_hf(hf_config).max_position_embeddings)
    if inputs.pad_id == rm_tokenizer.eos_token_id:
        logger.warning("train-rm: the reward model's tokenizer has no pad token, so its checkpoint's pad_token_id is "
                       "EOS (id %d), as TRL's RewardTrainer does: HF's *ForSequenceClassification then reads a row "
                       "ending in EOS at the token before it, and train-rm trains with that same token",
                       inputs.pad_id)
    train_files, val_files = _pair_files(recipe, log_dir / "data")
    train_pairs, val_pairs = Pairs.build(read_pairs(train_files), inputs), Pairs.build(read_pairs(val_files), inputs)
    steps_per_epoch = len(train_pairs) // train.mini_batch_size
    if steps_per_epoch == 0:
        raise InputError(f"reward_model.train.mini_batch_size: larger than the {len(train_pairs)} training pairs "
                         f"(got {train.mini_batch_size})")
    total_steps = train.epochs * steps_per_epoch
    engine = engine_settings(recipe, "reward_model", train_pairs=len(train_pairs))

    with ExitStack() as cleanup:
        ray_for_run(cleanup, ray_address)
        sinks = recipe.trainer.logging
        tracker = Tracker(log_dir, total_steps=total_steps, jsonl=sinks.jsonl, tensorboard=sinks.tensorboard,
                          console=sinks.console)
        cleanup.callback(tracker.close)
        pool = plan_pools(recipe)["reward_model"]
        cleanup.callback(pool.release)
        warmed = None
        if train.sft_steps > 0:
            # The policy's warm-up code on the RL data's reference solutions, for a fixed number of steps.
            warmup = recipe.sft_warmup.model_copy(
                update={"steps": train.sft_steps, "stop_loss": None, "stop_accuracy": None})
            warmed = warmed_up_checkpoint(recipe.model_copy(update={"sft_warmup": warmup}), pool=pool,
                                          layout_of="reward_model", weights=weights, hf_config=hf_config,
                                          data=prepare_data(recipe, run_dir), tracker=tracker,
                                          out_dir=log_dir / "sft_backbone")
        # Trained with the pooling token the written checkpoint states (its pad id), so HF scores it alike.
        group = start_engine_group(pool, name="reward_model", settings=engine,
                                   hf_config={**hf_config, "pad_token_id": inputs.pad_id}, weights=str(weights),
                                   log_dir=None)
        cleanup.callback(group.kill)
        if warmed is not None:
            group.run(MegatronWorker.load_policy_checkpoint, str(warmed))  # the backbone; the score head starts at zero
        role = RewardModelRole(group, batching=reward_scoring_batching(recipe))
        settings = preference_update_settings(recipe)
        rng = np.random.default_rng(recipe.seed)
        step, metrics = 0, {}
        for _ in range(train.epochs):
            order = rng.permutation(len(train_pairs)) if train.shuffle else np.arange(len(train_pairs))
            for start in range(0, steps_per_epoch * train.mini_batch_size, train.mini_batch_size):
                metrics = role.update(train_pairs.batch(order[start : start + train.mini_batch_size]), settings)
                step += 1
                if step == total_steps or (train.val_every and step % train.val_every == 0):
                    metrics.update(_validate(role, val_pairs))
                tracker.log(step, metrics)
        # Each rank writes its own shards: no rank gathers the model (a 7B reward model in float32 is 28 GB).
        checkpoint = log_dir / "rm_checkpoint"
        shutil.rmtree(checkpoint, ignore_errors=True)
        group.run(MegatronWorker.save_checkpoint, str(checkpoint), weights_only=True)
    # The ranks are gone and this process never joined torch.distributed: the conversion runs here.
    config = reward_model_hf_config(hf_config, pad_token_id=inputs.pad_id, dtype=engine.params_dtype)
    _write_reward_model(Path(rm.path).expanduser(), checkpoint, config, rm_tokenizer)
    shutil.rmtree(checkpoint)
    return RewardModelResult(Path(rm.path).expanduser(), metrics["val/rm_accuracy"], step)
