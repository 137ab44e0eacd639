"""The role objects the step loop talks to: policy (actor/reference), critic, rollout fleet, reward.

Each wraps a worker group or a service and exposes one method per phase, so
the loop in `trainer.py` never sees Ray, HTTP or Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megarl.controller.worker_group import WorkerGroup, mean_metrics
from megarl.protocol import Batch

INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
UPDATE_KEYS = INPUT_KEYS + ("response_mask", "old_log_probs", "advantages")
CRITIC_UPDATE_KEYS = INPUT_KEYS + ("response_mask", "values", "returns")


class PolicyRole:
    """A Megatron policy (trainable actor, or frozen reference) behind its worker group."""

    def __init__(self, group: WorkerGroup, *, logprob_micro_batch_size: int,
                 max_tokens_per_microbatch: int | None = None, ppo: dict[str, Any] | None = None):
        self.group = group
        self.logprob_micro_batch_size = logprob_micro_batch_size
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.ppo = ppo or {}

    @property
    def dp_size(self) -> int:
        return self.group.dp_size

    def _log_probs(self, batch: Batch, *, key: str, temperature: float, with_entropy: bool) -> Batch:
        shards = self.group.dispatch_dp(
            "compute_log_prob",
            batch.select(list(INPUT_KEYS)),
            temperature=temperature,
            micro_batch_size=self.logprob_micro_batch_size,
            max_tokens_per_microbatch=self.max_tokens_per_microbatch,
            with_entropy=with_entropy,
            key=key,
        )
        return Batch.concat(shards)

    def compute_log_prob(self, batch: Batch, *, temperature: float, with_entropy: bool) -> tuple[Batch, float]:
        """Adds `old_log_probs`; returns the mean entropy over response tokens (`actor/entropy`)."""
        out = self._log_probs(batch, key="old_log_probs", temperature=temperature, with_entropy=with_entropy)
        batch["old_log_probs"] = out["old_log_probs"]
        entropy = float("nan")
        if with_entropy:
            mask = batch["response_mask"]
            entropy = float((out["entropy"] * mask).sum() / mask.sum().clamp(min=1))
        return batch, entropy

    def compute_ref_log_prob(self, batch: Batch, *, temperature: float) -> Batch:
        out = self._log_probs(batch, key="ref_log_prob", temperature=temperature, with_entropy=False)
        batch["ref_log_prob"] = out["ref_log_prob"]
        return batch

    def update(self, batch: Batch, *, temperature: float) -> dict[str, float]:
        keys = list(UPDATE_KEYS) + (["ref_log_prob"] if "ref_log_prob" in batch else [])
        per_rank = self.group.dispatch_dp("update_actor", batch.select(keys), temperature=temperature, **self.ppo)
        return mean_metrics(per_rank)

    def sft(self, batch: Batch, *, micro_batch_size: int, lr: float) -> dict[str, float]:
        return mean_metrics(self.group.dispatch_dp("sft_step", batch, micro_batch_size=micro_batch_size, lr=lr,
                                                   max_tokens_per_microbatch=self.max_tokens_per_microbatch))

    def push_weights(self, *, urls: list[str], api_key: str | None, version: int, **sync_options) -> dict[str, float]:
        """Weight sync to `urls`; `sync_options` pick the transport (see MegatronWorker.push_weights)."""
        results = self.group.run("push_weights", urls=urls, api_key=api_key, version=version, **sync_options)
        return next(result for result in results if result is not None)


class CriticRole:
    """The Megatron value model behind its worker group: values for GAE, PPO value updates."""

    def __init__(self, group: WorkerGroup, *, values_micro_batch_size: int, update: dict[str, Any]):
        self.group = group
        self.values_micro_batch_size = values_micro_batch_size
        self.update_kwargs = update  # includes max_tokens_per_microbatch, also used for values

    def compute_values(self, batch: Batch) -> Batch:
        """Adds `values` [B, R]: V of the state before each response token."""
        shards = self.group.dispatch_dp(
            "compute_values",
            batch.select(list(INPUT_KEYS)),
            micro_batch_size=self.values_micro_batch_size,
            max_tokens_per_microbatch=self.update_kwargs["max_tokens_per_microbatch"],
        )
        batch["values"] = Batch.concat(shards)["values"]
        return batch

    def update(self, batch: Batch) -> dict[str, float]:
        """critic/{vf_loss, vf_clipfrac, grad_norm, lr}, averaged over DP ranks."""
        per_rank = self.group.dispatch_dp("update_critic", batch.select(list(CRITIC_UPDATE_KEYS)),
                                          **self.update_kwargs)
        return mean_metrics(per_rank)


@dataclass
class Roles:
    """Everything one step needs, built once per run."""

    actor: PolicyRole
    rollout: Any  # megarl.rollout.fleet.RolloutFleet
    reward_fn: Callable[[Batch], tuple[torch.Tensor, dict[str, float]]]
    reference: PolicyRole | None = None
    critic: CriticRole | None = None
    kl_ctrl: Any = None
    api_key: str | None = None
    extras: dict = field(default_factory=dict)

    def score(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        scores, metrics = self.reward_fn(batch)
        batch["token_level_scores"] = scores
        return batch, metrics

    def apply_kl_in_reward(self, batch: Batch, *, kind: str) -> dict[str, float]:
        from megarl.controller.phases import apply_kl

        metrics = apply_kl(batch, kl_coef=self.kl_ctrl.value, kind=kind)
        self.kl_ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=len(batch))
        return metrics

    def sync_weights(self, *, version: int) -> dict[str, float]:
        # Through the fleet: it records the version and re-syncs servers it restarts (weight source set in run.py).
        return self.rollout.sync_weights(version=version)
