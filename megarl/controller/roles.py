"""The role objects the step loop talks to: policy (actor/reference), critic, reward model, rollout fleet, reward loop.

Each wraps a worker group or a service and exposes one method per phase, so
the step (`step.py`) never sees Ray, HTTP or Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megarl.algorithms.metrics import entropy_metric
from megarl.cluster.engine_worker import MegatronWorker
from megarl.cluster.memory import MemoryCycle, peak_memory_metrics
from megarl.cluster.worker_group import WorkerGroup, mean_metrics
from megarl.config.settings import (
    SamplingSettings,
    Batching,
    PolicyUpdateSettings,
    PreferenceUpdateSettings,
    ValueUpdateSettings,
    WeightSyncSettings,
)
from megarl.controller.phases import apply_kl
from megarl.protocol import Batch

INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
UPDATE_KEYS = INPUT_KEYS + ("response_mask", "old_log_probs", "advantages")
CRITIC_UPDATE_KEYS = INPUT_KEYS + ("response_mask", "values", "returns")


class PolicyRole:
    """A Megatron policy behind its worker group: the trainable actor (with `update` settings) or the frozen
    reference (without). The reference runs on ranks of its own, or in the actor's: `fused=True` is the frozen
    engine the actor's workers hold beside the actor (`MegatronWorker.init_reference`), `adapters=False` a LoRA
    actor with its adapters off (its base model, nothing of its own to save)."""

    def __init__(self, group: WorkerGroup, *, batching: Batching, update: PolicyUpdateSettings | None = None,
                 adapters: bool = True, fused: bool = False):
        self.group = group
        self.batching = batching
        self.update_settings = update
        self.adapters = adapters
        self.fused = fused

    @property
    def dp_size(self) -> int:
        return self.group.dp_size

    def _log_probs(self, batch: Batch, *, key: str, temperature: float, with_entropy: bool) -> Batch:
        shards = self.group.dispatch_dp(MegatronWorker.compute_log_prob, batch.select(list(INPUT_KEYS)), key=key,
                                        temperature=temperature, with_entropy=with_entropy, batching=self.batching,
                                        adapters=self.adapters, reference=self.fused)
        return Batch.concat(shards)

    def compute_log_prob(self, batch: Batch, *, temperature: float) -> tuple[Batch, dict[str, float]]:
        """Adds `old_log_probs`; returns `actor/entropy`, aggregated over the response tokens like the loss."""
        out = self._log_probs(batch, key="old_log_probs", temperature=temperature, with_entropy=True)
        batch["old_log_probs"] = out["old_log_probs"]
        mode = self.update_settings.loss.loss_agg_mode
        return batch, {"actor/entropy": entropy_metric(out["entropy"], batch["response_mask"], mode)}

    def response_log_probs(self, batch: Batch) -> torch.Tensor:
        """The log-probs [B, response width] of `batch`'s response tokens at temperature 1, without entropy."""
        return self._log_probs(batch, key="log_probs", temperature=1.0, with_entropy=False)["log_probs"]

    def compute_ref_log_prob(self, batch: Batch, *, temperature: float) -> Batch:
        out = self._log_probs(batch, key="ref_log_prob", temperature=temperature, with_entropy=False)
        batch["ref_log_prob"] = out["ref_log_prob"]
        return batch

    def update(self, batch: Batch) -> dict[str, float]:
        keys = list(UPDATE_KEYS) + (["ref_log_prob"] if self.update_settings.loss.use_kl_loss else [])
        return mean_metrics(self.group.dispatch_dp(MegatronWorker.update, batch.select(keys), settings=self.update_settings))

    def sft(self, batch: Batch, *, batching: Batching, lr: float) -> dict[str, float]:
        return mean_metrics(self.group.dispatch_dp(MegatronWorker.sft_step, batch, batching=batching, lr=lr))

    def reset_optimizer_state(self) -> None:
        self.group.run(MegatronWorker.reset_optimizer_state)

    def save_checkpoint(self, ckpt_dir: str, *, weights_only: bool = False) -> None:
        self.group.run(MegatronWorker.save_checkpoint, ckpt_dir, weights_only=weights_only, reference=self.fused)

    def load_checkpoint(self, ckpt_dir: str, *, load_optimizer: bool) -> None:
        self.group.run(MegatronWorker.load_checkpoint, ckpt_dir, load_optimizer=load_optimizer, reference=self.fused)

    def push_weights(self, *, urls: list[str], api_key: str | None, version: int, settings: WeightSyncSettings,
                     devices: list[list[str]] | None = None) -> dict[str, float]:
        """Weight sync to `urls` through `settings.transport` (`devices`: the servers' GPU UUIDs, see
        `RolloutFleet.server_devices`); the metrics of trainer rank 0."""
        results = self.group.run(MegatronWorker.push_weights, urls=urls, api_key=api_key, version=version, settings=settings,
                                 devices=devices)
        return next(result for result in results if result is not None)


class CriticRole:
    """The Megatron value model behind its worker group: values for GAE, PPO value updates."""

    def __init__(self, group: WorkerGroup, *, update: ValueUpdateSettings):
        self.group = group
        self.update_settings = update

    def compute_values(self, batch: Batch) -> Batch:
        """Adds `values` [B, R]: V of the state before each response token."""
        shards = self.group.dispatch_dp(MegatronWorker.compute_values, batch.select(list(INPUT_KEYS)),
                                        batching=self.update_settings.batching)
        batch["values"] = Batch.concat(shards)["values"]
        return batch

    def update(self, batch: Batch) -> dict[str, float]:
        """critic/{vf_loss, vf_clipfrac, grad_norm, lr}, averaged over DP ranks."""
        per_rank = self.group.dispatch_dp(MegatronWorker.update, batch.select(list(CRITIC_UPDATE_KEYS)),
                                          settings=self.update_settings)
        return mean_metrics(per_rank)


class RewardModelRole:
    """The Megatron reward model behind its worker group: scores of rows, Bradley-Terry updates (`train-rm`)."""

    def __init__(self, group: WorkerGroup, *, batching: Batching):
        self.group = group
        self.batching = batching

    def score(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """Scores [B] of the reward model's input rows (input_ids, attention_mask, position_ids)."""
        batch, size = Batch.from_dict(rows), len(rows["input_ids"])
        if size < self.group.dp_size:  # every DP rank needs a row: pad with copies, drop their scores
            batch = Batch.concat([batch, *[batch[0:1]] * (self.group.dp_size - size)])
        shards = self.group.dispatch_dp(MegatronWorker.compute_scores, batch, batching=self.batching)
        return Batch.concat(shards)["scores"][:size]

    def update(self, pairs: Batch, settings: PreferenceUpdateSettings) -> dict[str, float]:
        """rm/{loss, accuracy, margin, grad_norm, lr} of one update on `pairs` (chosen_* and rejected_* rows)."""
        return mean_metrics(self.group.dispatch_dp(MegatronWorker.update, pairs, settings=settings))


@dataclass
class Roles:
    """Everything one step needs, built once per run."""

    actor: PolicyRole
    rollout: Any  # megarl.rollout.fleet.RolloutFleet
    reward: Any  # megarl.controller.reward_loop.RewardLoop
    memory: MemoryCycle
    reference: PolicyRole | None = None
    critic: CriticRole | None = None
    kl_ctrl: Any = None
    episodes: Any = None  # megarl.agent.rollout.MultiTurnRollout on the fleet, with rollout.multi_turn

    def generate(self, gen_batch: Batch, sampling: SamplingSettings, *, seed: int, on_rows=None) -> Batch:
        """The step's (and validation's) generation with `sampling` : one response per row from the fleet, or one episode per row with rollout.multi_turn."""
        source = self.episodes if self.episodes is not None else self.rollout
        return source.generate(gen_batch, sampling, seed=seed, on_rows=on_rows)

    def apply_kl_in_reward(self, batch: Batch, *, kind: str) -> dict[str, float]:
        metrics = apply_kl(batch, kl_coef=self.kl_ctrl.value, kind=kind)
        self.kl_ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=len(batch))
        return metrics

    def sync_weights(self, *, version: int) -> dict[str, float]:
        # Through the fleet: it records the version and re-syncs servers it restarts (weight source set in run.py).
        return self.rollout.sync_weights(version=version)

    @property
    def reference_engine(self) -> PolicyRole | None:
        """The reference when it is an engine with weights of its own, on its ranks or fused into the actor's
        (not a LoRA actor with its adapters off)."""
        return self.reference if self.reference is not None and self.reference.adapters else None

    def peak_memory(self) -> dict[str, float]:
        """`perf/max_memory_gb/<role>` of every role that reports one (a fused reference shares the actor's
        processes: its `perf/train_state_gb` alone)."""
        reference = self.reference_engine
        groups = {"actor": self.actor.group}
        groups |= {"reference": reference.group} if reference is not None and not reference.fused else {}
        groups |= {"critic": self.critic.group} if self.critic is not None else {}
        metrics = peak_memory_metrics(groups)
        if reference is not None and reference.fused:
            metrics["perf/train_state_gb/reference"] = max(reference.group.run(MegatronWorker.train_state_gb,
                                                                               reference=True))
        rollout = self.rollout.peak_memory_gb()
        return metrics | ({"perf/max_memory_gb/rollout": rollout} if rollout is not None else {})
