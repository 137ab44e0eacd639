"""The run's loop over steps: train, write samples, validate, log, checkpoint, and stop cleanly when asked.

A checkpoint is written every `save_every` steps and after the last one (none at all
with `trainer.checkpoint.enabled: false`). When a stop
is requested (`Preemption`), a step that has not begun to update is abandoned and the
controller state it consumed (the loader's batch, the KL controller, the RNGs) is
rolled back; an interrupted validation is skipped. The loop then saves the state after
the last complete step (unless the newest checkpoint already holds it) and raises
`Preempted`. With `rollout.async` the steps train on what `AsyncRollout` generated ahead,
and a checkpoint records its resume point (see `megarl.controller.rollout_ahead`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NoReturn

from megarl.config import Recipe, dump_recipe
from megarl.config.settings import SamplingSettings
from megarl.controller import run_state
from megarl.controller.checkpointing import StepCheckpoint, save_step
from megarl.controller.preemption import Preempted, Preemption
from megarl.controller.roles import Roles
from megarl.controller.rollout_ahead import AsyncRollout
from megarl.controller.samples import decode_rows, write_samples
from megarl.controller.step import StepAbandoned, Trainer
from megarl.controller.validation import validate
from megarl.protocol import Batch
from megarl.protocol.op_timer import measure_batch_ops
from megarl.rollout import GenerationInterrupted
from megarl.tracking.tracker import Tracker

logger = logging.getLogger(__name__)


class StepLoop:
    def __init__(self, recipe: Recipe, *, run_dir: Path, trainer: Trainer, roles: Roles, data, tracker: Tracker,
                 preemption: Preemption, newest: StepCheckpoint | None, val_sampling: SamplingSettings,
                 ahead: AsyncRollout | None = None):
        """`val_sampling`: how validation samples (`config.settings.validation_sampling`); `ahead`: asynchronous
        RL's producer and buffer (`rollout.async`), None for one synchronous step after another."""
        self.recipe, self.run_dir, self.trainer, self.roles = recipe, run_dir, trainer, roles
        self.data, self.tracker, self.preemption, self.newest = data, tracker, preemption, newest
        self.val_sampling, self.ahead = val_sampling, ahead

    def run(self, start_step: int) -> None:
        """Steps `start_step + 1 .. trainer.total_steps` (numbered from 1, as logged)."""
        settings = self.recipe.trainer
        if settings.val_every and settings.val_before_train and start_step == 0 and 0 not in self.tracker.logged_steps:
            metrics = self._validate(0)
            if metrics:
                self.tracker.log(0, metrics)
        for step in range(start_step, settings.total_steps):
            if self.preemption.requested:
                self._stop(step)
            if self.ahead is not None:
                self.ahead.admit_until(step)
            before = self._state(step)
            try:
                with measure_batch_ops() as batch_ops:
                    metrics = self._step(step)
                metrics["perf/batch_ops_s"] = batch_ops.seconds
            except StepAbandoned as abandoned:
                run_state.restore(before, loader=self.data.train_batches, kl_ctrl=self.data.kl_ctrl)
                self.tracker.message(f"stop requested: step {step + 1} abandoned during {abandoned.args[0]}")
                self._stop(step)
            if self.preemption.requested:
                self.tracker.message(f"stop requested: step {step + 1} finished")
            self._write_train_samples(step + 1)
            if settings.val_every and ((step + 1) % settings.val_every == 0 or step + 1 == settings.total_steps):
                metrics.update(self._validate(step + 1))
            metrics["train/epoch"] = self.data.train_batches.epoch
            self.tracker.log(step + 1, metrics)
            every = settings.checkpoint.save_every
            if (every and (step + 1) % every == 0) or step + 1 == settings.total_steps or self.preemption.requested:
                self._save(step + 1)
            if self.preemption.requested:
                self._stop(step + 1)

    def _step(self, step: int) -> dict[str, float]:
        if self.ahead is None:
            return self.trainer.step(step, Batch.from_dict(next(self.data.train_batches)))
        metrics, groups = self.trainer.step_ahead(step, self.ahead)
        self.ahead.commit(groups)
        self.ahead.admit_until(step + 1)  # the next batch starts on the weights just synced
        return metrics

    def _state(self, step: int) -> dict:
        state = run_state.capture(step=step, weight_version=int(self.roles.rollout.weight_version),
                                  loader=self.data.train_batches, kl_ctrl=self.data.kl_ctrl)
        if self.ahead is not None:
            # The loader has run ahead; a resume starts at the oldest batch with an untrained group.
            state["async"] = self.ahead.state()
            state["loader"] = state["async"].pop("loader")
        return state

    def _save(self, step: int) -> None:
        checkpoint = self.recipe.trainer.checkpoint
        if not checkpoint.enabled:
            return
        self.newest = save_step(self.roles, self.run_dir, step=step, controller_state=self._state(step),
                                recipe_text=dump_recipe(self.recipe), keep_last=checkpoint.keep_last,
                                weights_only=checkpoint.weights_only)
        logger.info("checkpoint %s written", self.newest.path)

    def _stop(self, step: int) -> NoReturn:
        """Checkpoint the state after `step` complete steps unless the newest checkpoint holds it; raise Preempted."""
        if self.newest is None or self.newest.step < step:
            self._save(step)
        raise Preempted(*((self.newest.step, self.newest.path) if self.newest is not None else (None, None)))

    def _validate(self, step: int) -> dict[str, float]:
        try:
            metrics, rows = validate(self.data.val_batches(), generate=self.roles.generate,
                                     reward_fn=self.data.reward_fn, sampling=self.val_sampling,
                                     tokenizer=self.data.tokenizer, sample_rows=self.recipe.trainer.samples.val_rows)
        except GenerationInterrupted:
            self.tracker.message(f"stop requested: validation at step {step} skipped")
            return {}
        if rows:
            write_samples(self.run_dir, "val", step, rows)
        logger.info("validation at step %d: %s", step,
                    "  ".join(f"{key} {value:.4f}" for key, value in metrics.items()))
        return metrics

    def _write_train_samples(self, step: int) -> None:
        limit, batch = self.recipe.trainer.samples.train_rows, self.trainer.last_batch
        if limit:
            rows = decode_rows(batch, batch["token_level_scores"].sum(-1), self.data.tokenizer, limit=limit)
            write_samples(self.run_dir, "train", step, rows)
