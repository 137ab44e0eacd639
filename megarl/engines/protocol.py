"""`TrainEngine`: what a training-side engine rank offers the worker that hosts it.

The Megatron policy (actor, and the frozen reference), the value model and the
reward model implement it; the controller's worker and everything above it use only these
methods, never Megatron objects. A method an engine does not support (values
from a policy, an update of a frozen reference) raises `NotImplementedError`
naming the engine. Every method is called on all ranks of the engine with the
same arguments (the ranks of one DP replica receive the same rows): most are
collectives over the engine's process groups.

Row inputs are mappings of `[B, ...]` tensors keyed as in the step's batch
(docs/step.md): `input_ids`, `attention_mask`, `position_ids` ([B, P + R]),
`responses` ([B, R]), and for updates `response_mask`, `old_log_probs`,
`advantages`, `ref_log_prob`, `values`, `returns`, `loss_mask`; for a reward model's
update, the sequences of preference pairs as `chosen_*` and `rejected_*`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from megarl.config.settings import (
    Batching,
    LoraSettings,
    PolicyUpdateSettings,
    PreferenceUpdateSettings,
    ValueUpdateSettings,
)
from megarl.models.spec import Arch

Tensor = torch.Tensor
Rows = Mapping[str, Tensor]


@dataclass(frozen=True)
class WeightShards:
    """This rank's weights as the weight sync reads them: Megatron-named tensors per model chunk.

    `shards[(chunk, name)]` is the local shard of parameter `name` of virtual-pipeline chunk
    `chunk`, named as in Megatron's local layer spec whichever spec built the model (Transformer
    Engine's fused norm weights under `megarl.models.canonical_name`); `arch` and `padded_vocab`
    let the resharding plan map them back to HF tensors.
    """

    shards: dict[tuple[int, str], Tensor]
    num_chunks: int
    arch: Arch
    padded_vocab: int
    # The global names of the parameters a sync must send (None: all); a LoRA policy's frozen weights stay as
    # the servers loaded them, so only its adapted linears (merged) change.
    only: frozenset[str] | None = None


@dataclass(frozen=True)
class AdapterShards:
    """This rank's LoRA adapters as the adapter-only sync reads them: `shards[(chunk, name)]` is the local shard of
    full-layout adapter tensor `name` (`megarl.models.lora`), `tp_rank` the rank it was cut for."""

    shards: dict[tuple[int, str], Tensor]
    tp_rank: int
    arch: Arch
    settings: LoraSettings


@runtime_checkable
class TrainEngine(Protocol):
    def compute_log_prob(self, rows: Rows, *, temperature: float, with_entropy: bool,
                         batching: Batching, adapters: bool = True) -> tuple[Tensor, Tensor | None]:
        """(log-probs [B, R], entropy [B, R] or None) of the response tokens, on every rank; `adapters=False`: a
        LoRA policy's base model (its reference policy)."""

    def compute_values(self, rows: Rows, *, batching: Batching) -> Tensor:
        """Values [B, R]: V of the state before each response token, on every rank."""

    def compute_scores(self, rows: Rows, *, batching: Batching) -> Tensor:
        """Scores [B]: a reward model's scalar at the last valid token of each row, on every rank."""

    def update(
        self, rows: Rows, settings: PolicyUpdateSettings | ValueUpdateSettings | PreferenceUpdateSettings
    ) -> dict[str, float]:
        """One update (epochs of mini-batches: PPO, or Bradley-Terry for a reward model) on this DP rank's rows;
        its metrics, equal on every rank."""

    def sft_step(self, rows: Rows, *, batching: Batching, lr: float) -> dict[str, float]:
        """One supervised step on the `loss_mask` tokens at learning rate `lr`."""

    def weight_shards(self) -> WeightShards:
        """This rank's named weights, for the weight sync (a LoRA policy's with its adapters merged)."""

    def adapter_shards(self) -> AdapterShards | None:
        """This rank's LoRA adapters, for the adapter-only sync (None without LoRA)."""

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The full HF-named weights, on every rank."""

    def load_hf_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Replace the weights with a full HF state dict (every rank passes the same one)."""

    def save_checkpoint(self, ckpt_dir: str | Path, *, weights_only: bool = False) -> Path:
        """Weights (and optimizer and LR schedule when trainable and not `weights_only`) and the ranks' RNG
        states, loadable at any layout."""

    def load_checkpoint(self, ckpt_dir: str | Path, *, load_optimizer: bool) -> None:
        """Load a checkpoint saved at any layout; `load_optimizer=False` restores only the weights."""

    def load_policy_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Replace the weights with a policy checkpoint's (any layout; a value model takes the backbone only)."""

    def copy_weights_from(self, source: TrainEngine) -> None:
        """Take `source`'s weights: the same model at the same layout in this process."""

    def reset_optimizer_state(self) -> None:
        """Forget the optimizer's moments (the LR schedule is kept)."""

    def train_state_bytes(self) -> int:
        """Bytes of the weights, gradients and optimizer state this rank keeps while it trains."""

    def offload(self, *, weights: bool) -> None:
        """Move optimizer state and gradient buffers (and the weights when `weights`) to host memory."""

    def onload(self) -> None:
        """Bring back to the device whatever `offload` moved."""
