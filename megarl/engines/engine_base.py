"""What the policy and value engines share: micro-batching, forward passes over rows, PPO-style
epochs of mini-batches, and checkpoints.

`MegatronEngine` is a mixin: a subclass sets `model` (`gpt.GPTModelChunks`), `train`
(`TrainState`, or None for a frozen model), `hf_config` and `_update_calls` (how many
update calls were made, which seeds each call's shuffle and is saved in checkpoints).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from megarl.engines import checkpoint, cpu_compat
from megarl.engines.losses import dp_sum
from megarl.engines.optim import TrainState
from megarl.engines.schedule import (
    MicroBatches,
    broadcast_from_last_stage,
    is_output_stage,
    make_micro_batches,
    run_schedule,
)

Tensor = torch.Tensor


def global_normalisers(response_mask: Tensor) -> dict[str, float]:
    """A mini-batch's response tokens and sequences summed over DP: what its losses divide by, so the
    gradient does not depend on how the rows are split into micro-batches or over ranks."""
    tokens, seqs = dp_sum([response_mask.sum().item(), response_mask.shape[0]]).tolist()
    return {"global_tokens": max(tokens, 1.0), "global_seqs": max(seqs, 1.0)}


class MegatronEngine:
    train: TrainState | None
    hf_config: dict
    _update_calls: int

    @property
    def _chunks(self) -> list[torch.nn.Module]:
        return self.train.ddp_chunks if self.train else self.model.chunks

    def _set_mode(self, training: bool) -> None:
        for chunk in self._chunks:
            chunk.train(training)

    def _micro_batches(
        self, batch: dict[str, Tensor], micro_batch_size: int, max_tokens_per_microbatch: int | None
    ) -> MicroBatches:
        return make_micro_batches(
            batch,
            micro_batch_size=micro_batch_size,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            num_chunks=len(self._chunks),
        )

    def _forward_rows(
        self,
        batch: dict[str, Tensor],
        *,
        micro_batch_size: int,
        max_tokens_per_microbatch: int | None,
        loss_fn: Callable,
        shapes: dict[str, tuple[int, ...]],
    ) -> dict[str, Tensor]:
        """Forward-only pass over `batch`; per key of `shapes`, the rows `loss_fn` returned under that key,
        in input order, on every pipeline stage (the last stage computes them)."""
        self._set_mode(False)
        micro = self._micro_batches(batch, micro_batch_size, max_tokens_per_microbatch)
        with torch.no_grad():
            outputs = run_schedule(self._chunks, micro, loss_fn=loss_fn, forward_only=True)
        collected = {}
        for key, shape in shapes.items():
            rows = micro.scatter_rows([o[key] for o in outputs], shape[0]) if is_output_stage() else None
            collected[key] = broadcast_from_last_stage(rows, shape)
        return collected

    def _epochs_of_mini_batches(
        self,
        data: dict[str, Tensor],
        *,
        ppo_epochs: int,
        mini_batch_size: int | None,
        micro_batch_size: int,
        max_tokens_per_microbatch: int | None,
        shuffle: bool,
        seed: int,
        step: Callable[[dict[str, Tensor], MicroBatches], dict[str, float]],
    ) -> dict[str, float]:
        """`ppo_epochs` passes over `data` in (shuffled) mini-batches, `step(mini, micro)` on each;
        the mean of the steps' metrics. The shuffle is seeded by `seed` and the update call count."""
        self._set_mode(True)
        rows = next(iter(data.values())).shape[0]
        mini_batch_size = mini_batch_size or rows
        generator = torch.Generator().manual_seed(seed * 1_000_003 + self._update_calls)
        self._update_calls += 1
        history: list[dict[str, float]] = []
        for _ in range(ppo_epochs):
            order = torch.randperm(rows, generator=generator) if shuffle else torch.arange(rows)
            for start in range(0, rows, mini_batch_size):
                mini = {key: value[order[start : start + mini_batch_size]] for key, value in data.items()}
                history.append(step(mini, self._micro_batches(mini, micro_batch_size, max_tokens_per_microbatch)))
        return {key: sum(h[key] for h in history) / len(history) for key in history[0]}

    def _optimizer_step(self, train: TrainState, micro: MicroBatches, loss_fn: Callable) -> tuple[list, float, float]:
        """Forward and backward over `micro`, one optimizer step: (the loss_fn outputs, grad norm, lr)."""
        train.zero_grad()
        outputs = run_schedule(self._chunks, micro, loss_fn=loss_fn, forward_only=False)
        grad_norm, lr = train.step()
        return outputs, grad_norm, lr

    def _save_checkpoint(self, ckpt_dir: str | Path, *, tokenizer_path: str | None) -> Path:
        cpu_compat.install()
        return checkpoint.save_checkpoint(
            self.model,
            self.train,
            ckpt_dir,
            hf_config=self.hf_config,
            tokenizer_path=tokenizer_path,
            engine_state={"update_calls": self._update_calls},
        )

    def load_checkpoint(self, ckpt_dir: str | Path, *, load_optimizer: bool = True) -> None:
        """Load a checkpoint saved at any layout; collective. `load_optimizer=False` restores
        only the weights (the optimizer and LR schedule keep their current state)."""
        cpu_compat.install()
        engine_state = checkpoint.load_checkpoint(self.model, self.train, ckpt_dir, load_optimizer=load_optimizer)
        if load_optimizer:
            self._update_calls = int(engine_state.get("update_calls", self._update_calls))
