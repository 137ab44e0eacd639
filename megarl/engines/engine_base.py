"""What the policy, value and reward-model engines share: the `TrainEngine` methods that do not depend on the head.

Micro-batching, forward passes over rows, PPO-style epochs of mini-batches with one
optimizer step each, checkpoints, optimizer reset, named weight shards for the sync,
and offload/onload. A subclass builds `model` (`gpt.GPTModelChunks`), `train`
(`TrainState`, or None for a frozen model) and `hf_config`, and implements the
methods of its head (log-probs and SFT for the policy, values for the critic, scores
and preference updates for the reward model).
`_update_calls` counts update calls: it seeds each call's shuffle and is saved in
checkpoints, so a resumed run shuffles as the uninterrupted one would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from megatron.core import parallel_state

from megarl.config.settings import Batching, LoraSettings, OptimizerSettings
from megarl.engines import checkpoint, cpu_compat, gpt, hf_weights, lora, offload
from megarl.engines.gpt import GPTModelChunks
from megarl.engines.losses import dp_sum
from megarl.engines.optim import TrainState, build_train_state
from megarl.engines.protocol import AdapterShards, Rows, WeightShards
from megarl.models.lora import adapted_modules
from megarl.engines.schedule import (
    MicroBatches,
    broadcast_from_last_stage,
    is_output_stage,
    make_micro_batches,
    run_schedule,
)

Tensor = torch.Tensor
SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm: the trainer's weights can no longer be used (nor sent anywhere)."""


def check_finite(metrics: dict[str, float], *, where: str) -> None:
    """Stop the step when a loss or gradient norm of `metrics` is NaN or infinite, naming it.

    The trainer is where a divergence happens, so it is caught here, once per optimizer step, before its
    weights reach the rollout servers or a checkpoint (the servers load what they are sent, as SGLang's do)."""
    bad = [f"{key} is {value}" for key, value in metrics.items()
           if key.endswith(("loss", "grad_norm")) and not math.isfinite(value)]
    if bad:
        raise TrainingDiverged(f"training diverged at {where}: {', '.join(bad)}; stopped before these weights "
                               f"reach the rollout servers or a checkpoint (lower the learning rate, or check the "
                               f"rewards and advantages of this step)")


def global_normalisers(response_mask: Tensor) -> dict[str, float]:
    """A mini-batch's response tokens and non-empty sequences summed over DP: what its losses divide by, so
    the gradient does not depend on how the rows are split into micro-batches or over ranks."""
    non_empty = (response_mask.sum(-1) > 0).sum().item()
    tokens, seqs = dp_sum([response_mask.sum().item(), non_empty]).tolist()
    return {"global_tokens": max(tokens, 1.0), "global_seqs": max(seqs, 1.0)}


def pick(rows: Rows, keys: tuple[str, ...], *, as_float: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """The `keys` of `rows` (those in `as_float` as float32); KeyError naming what is missing."""
    missing = [key for key in keys if key not in rows]
    if missing:
        raise KeyError(f"engine input lacks {missing} (has {sorted(rows.keys())})")
    return {key: rows[key].float() if key in as_float else rows[key] for key in keys}


class MegatronEngine:
    model: GPTModelChunks
    train: TrainState | None
    hf_config: dict
    tokenizer_path: str | None = None
    _update_calls: int = 0
    _offloaded: offload.Offloaded | None = None  # what the last offload(s) moved, until onload
    _backbone_only = False  # a value model keeps its own head when it loads a policy's weights
    head = "lm"  # what its checkpoints record as their model (`checkpoint.CheckpointInfo.head`)
    lora_settings: LoraSettings | None = None  # a policy with LoRA adapters on a frozen base
    base_weights: dict | None = None  # with LoRA: where the frozen base came from ({"path", "seed"})

    def _build(self, hf_config: dict, *, params_dtype, transformer_impl: str, value_head: bool) -> None:
        """The model of this rank (at the layout Megatron was initialised with); weights are loaded by the head."""
        cpu_compat.install()
        self.hf_config = dict(hf_config)
        self.model = gpt.build_gpt(hf_config, params_dtype=params_dtype, transformer_impl=transformer_impl,
                                   value_head=value_head)
        self._update_calls = 0

    def _attach_optimizer(self, optimizer: OptimizerSettings | None) -> None:
        """Trainable with `optimizer` (DDP, optimizer, LR schedule); frozen without (no gradients at all)."""
        self.train = None if optimizer is None else build_train_state(self.model.chunks, self.model.config, optimizer)
        if optimizer is None:
            for chunk in self.model.chunks:
                chunk.requires_grad_(False)

    # ------------------------------------------------------------------ capabilities of a head

    def _unsupported(self, what: str):
        raise NotImplementedError(f"{type(self).__name__} ({self._kind()}) has no {what}")

    def _kind(self) -> str:
        return "trainable" if self.train is not None else "frozen"

    def compute_log_prob(self, rows: Rows, *, temperature: float, with_entropy: bool, batching: Batching,
                         adapters: bool = True):
        self._unsupported("log-probs")

    def compute_values(self, rows: Rows, *, batching: Batching) -> Tensor:
        self._unsupported("values")

    def compute_scores(self, rows: Rows, *, batching: Batching) -> Tensor:
        self._unsupported("scores")

    def update(self, rows: Rows, settings) -> dict[str, float]:
        self._unsupported("update")

    def sft_step(self, rows: Rows, *, batching: Batching, lr: float) -> dict[str, float]:
        self._unsupported("supervised step")

    def _require_trainable(self) -> TrainState:
        if self.train is None:
            self._unsupported("optimizer (built frozen, as a reference)")
        return self.train

    # ------------------------------------------------------------------ forward and update plumbing

    @property
    def _chunks(self) -> list[torch.nn.Module]:
        return self.train.ddp_chunks if self.train else self.model.chunks

    def _set_mode(self, training: bool) -> None:
        for chunk in self._chunks:
            chunk.train(training)

    def _micro_batches(self, batch: dict[str, Tensor], batching: Batching) -> MicroBatches:
        return make_micro_batches(
            batch,
            micro_batch_size=batching.micro_batch_size,
            max_tokens_per_microbatch=batching.max_tokens_per_microbatch,
            num_chunks=len(self._chunks),
        )

    def _forward_rows(
        self, rows: Rows, *, batching: Batching, loss_fn: Callable, shapes: dict[str, tuple[int, ...]]
    ) -> dict[str, Tensor]:
        """Forward-only pass over the sequences of `rows`; per key of `shapes`, the rows `loss_fn` returned under
        that key, in input order, on every pipeline stage (the last stage computes them)."""
        cpu_compat.install()
        self._set_mode(False)
        micro = self._micro_batches(pick(rows, SEQUENCE_KEYS), batching)
        with torch.no_grad():
            outputs = run_schedule(self._chunks, micro, loss_fn=loss_fn, forward_only=True)
        collected = {}
        for key, shape in shapes.items():
            gathered = micro.scatter_rows([o[key] for o in outputs], shape[0]) if is_output_stage() else None
            collected[key] = broadcast_from_last_stage(gathered, shape)
        return collected

    def _epochs_of_mini_batches(
        self,
        data: dict[str, Tensor],
        settings,
        step: Callable[[dict[str, Tensor], MicroBatches], dict[str, float]],
        micro_batches: Callable[[dict[str, Tensor]], MicroBatches] | None = None,
    ) -> dict[str, float]:
        """`settings.epochs` passes over `data` in (shuffled) mini-batches of `settings.mini_batch_size` rows,
        `step(mini, micro)` on each; the mean of the steps' metrics. The shuffle is seeded by `settings.seed` and
        the update call count. `micro_batches(mini)` cuts a mini-batch (default: `settings.batching` rows each)."""
        cpu_compat.install()
        self._set_mode(True)
        rows = next(iter(data.values())).shape[0]
        mini_batch_size = settings.mini_batch_size
        generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + self._update_calls)
        self._update_calls += 1
        history: list[dict[str, float]] = []
        for epoch in range(settings.epochs):
            order = torch.randperm(rows, generator=generator) if settings.shuffle else torch.arange(rows)
            for start in range(0, rows, mini_batch_size):
                mini = {key: value[order[start : start + mini_batch_size]] for key, value in data.items()}
                micro = micro_batches(mini) if micro_batches else self._micro_batches(mini, settings.batching)
                history.append(step(mini, micro))
                check_finite(history[-1], where=f"update call {self._update_calls}, epoch {epoch + 1}, "
                                                f"mini-batch {start // mini_batch_size + 1}")
        return {key: sum(h[key] for h in history) / len(history) for key in history[0]}

    def _optimizer_step(self, train: TrainState, micro: MicroBatches, loss_fn: Callable) -> tuple[list, float, float]:
        """Forward and backward over `micro`, one optimizer step: (the loss_fn outputs, grad norm, lr)."""
        train.zero_grad()
        outputs = run_schedule(self._chunks, micro, loss_fn=loss_fn, forward_only=False)
        grad_norm, lr = train.step()
        return outputs, grad_norm, lr

    # ------------------------------------------------------------------ weights

    @staticmethod
    def _weights_of(chunk: torch.nn.Module) -> dict[str, Tensor]:
        """A chunk's weights as the policy computes with them: LoRA adapters (when on) merged into their linears."""
        return lora.merged_weights(chunk, gpt.chunk_weights(chunk))

    def weight_shards(self) -> WeightShards:
        shards = {
            (chunk_index, name): tensor
            for chunk_index, chunk in enumerate(self.model.chunks)
            for name, tensor in self._weights_of(chunk).items()
        }
        only = None
        if self.lora_settings is not None:  # the frozen weights stay as the servers loaded them
            adapted = adapted_modules(self.model.arch, self.lora_settings.targets)
            only = frozenset(f"{module}.weight" for module in adapted)
        return WeightShards(shards, len(self.model.chunks), self.model.arch, self.model.padded_vocab, only)

    def adapter_shards(self) -> AdapterShards | None:
        if self.lora_settings is None:
            return None
        return AdapterShards(lora.adapter_shards(self.model), parallel_state.get_tensor_model_parallel_rank(),
                             self.model.arch, self.lora_settings)

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Full HF-named float32 CPU weights on every rank (collective over TP and PP), LoRA adapters merged. For
        tests and small models: every rank then holds the whole model; `save_checkpoint` +
        `load_policy_checkpoint` hand weights to another engine without that."""
        cpu_compat.install()
        return hf_weights.hf_state_dict(self.model, self._weights_of)

    def load_hf_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        cpu_compat.install()
        hf_weights.load_hf_state_dict(self.model, state_dict, backbone_only=self._backbone_only)
        if self.train is not None:
            # A bf16 model trains fp32 main copies inside the optimizer: refresh them too.
            self.train.optimizer.reload_model_params()

    # ------------------------------------------------------------------ checkpoints and memory

    def _lora_record(self) -> dict | None:
        """What a LoRA policy's checkpoint records of its adapters and base (None: full weights)."""
        settings = self.lora_settings
        if settings is None:
            return None
        return {"rank": settings.rank, "alpha": settings.alpha, "dropout": settings.dropout,
                "targets": list(settings.targets), "init": settings.init, "base": self.base_weights}

    def save_checkpoint(self, ckpt_dir: str | Path, *, weights_only: bool = False) -> Path:
        """Weights (+ optimizer and LR schedule when trainable and not `weights_only`) to `ckpt_dir`, loadable at
        any layout; collective. `megarl export` turns it into an HF checkpoint."""
        cpu_compat.install()
        return checkpoint.save_checkpoint(
            self.model,
            self.train,
            ckpt_dir,
            hf_config=self.hf_config,
            tokenizer_path=self.tokenizer_path,
            engine_state={"update_calls": self._update_calls},
            weights_only=weights_only,
            head=self.head,
            lora_record=self._lora_record(),
        )

    def load_checkpoint(self, ckpt_dir: str | Path, *, load_optimizer: bool) -> None:
        """Load a checkpoint saved at any layout; collective. `load_optimizer=False` restores
        only the weights (the optimizer and LR schedule keep their current state)."""
        cpu_compat.install()
        engine_state = checkpoint.load_checkpoint(self.model, self.train, ckpt_dir, load_optimizer=load_optimizer,
                                                  lora_record=self._lora_record())
        if load_optimizer:
            self._update_calls = int(engine_state.get("update_calls", self._update_calls))

    def load_policy_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Replace the weights with those of a policy's checkpoint (saved at any layout, e.g. the actor's after the
        SFT warm-up); collective. Each rank reads only its own shards: no full state dict exists anywhere. A
        value model takes the backbone and keeps its value head; the optimizer state is kept."""
        cpu_compat.install()
        checkpoint.load_policy_weights(self.model, ckpt_dir, backbone_only=self._backbone_only)
        if self.train is not None:
            # A bf16 model trains fp32 main copies inside the optimizer: refresh them too.
            self.train.optimizer.reload_model_params()

    def copy_weights_from(self, source: MegatronEngine) -> None:
        """This rank's weights become `source`'s: the same model at the same layout in this process (a fused
        reference taking the actor's weights after the SFT warm-up)."""
        targets = [dict(chunk.named_parameters()) for chunk in self.model.chunks]
        sources = [dict(chunk.named_parameters()) for chunk in source.model.chunks]
        if [list(t) for t in targets] != [list(s) for s in sources]:
            raise ValueError("copy_weights_from: the two engines' models differ (other parameters or layout)")
        with torch.no_grad():
            for target, source_params in zip(targets, sources):
                for name, param in target.items():
                    param.copy_(source_params[name])

    def train_state_bytes(self) -> int:
        """The bytes of this rank's weights plus, per trainable parameter, its fp32 gradient, Adam's two fp32
        moments and (for a bf16 / fp16 model) its fp32 main copy: the state a training step keeps."""
        params = {id(p): p for chunk in self.model.chunks for p in chunk.parameters()}.values()
        total = sum(p.numel() * p.element_size() for p in params)
        if self.train is not None:
            per_element = 4 + 8 + (4 if self.model.config.params_dtype != torch.float32 else 0)
            total += sum(p.numel() * per_element for p in params if p.requires_grad)
        return total

    def reset_optimizer_state(self) -> None:
        self._require_trainable().reset_state()

    def offload(self, *, weights: bool) -> None:
        moved = offload.offload(self.model.chunks, self.train, weights=weights)
        self._offloaded = moved if self._offloaded is None else self._offloaded.merge(moved)

    def onload(self) -> None:
        if self._offloaded is not None:
            offload.onload(self._offloaded)
            self._offloaded = None
