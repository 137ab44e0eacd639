"""The data-shaping parts of a step: uids, the generation batch, assembling responses, masks, advantages.

Each function takes and returns a `Batch` (or tensors) and does one thing of the
phase table in docs/step.md; the step (`step.py`) calls them in order.
"""

from __future__ import annotations

import uuid

import numpy as np

from megarl.algorithms.advantages import estimate_advantages
from megarl.algorithms.kl import apply_kl_in_reward
from megarl.algorithms.rollout_correction import behaviour_log_probs, corrected_advantages, importance_weights
from megarl.protocol import Batch
# The rollout-side helpers are part of this module's API (the step loop and the SFT warm-up use them).
from megarl.rollout.batching import assemble_rollout, prompt_token_lists

__all__ = [
    "GENERATION_KEYS", "add_response_mask", "add_uids", "apply_kl", "assemble_rollout", "compute_advantage",
    "off_policy_corrected", "prompt_token_lists", "split_generation_batch",
]

GENERATION_KEYS = ("input_ids", "attention_mask", "position_ids")


def add_uids(batch: Batch) -> Batch:
    """Give every original prompt a uid; responses of one prompt share it after repeat."""
    batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
    return batch


def split_generation_batch(batch: Batch) -> Batch:
    """Pop what generation needs off `batch` (the prompts' tensors) and copy the rows' non-tensor fields to it
    (multi-turn episodes read them); the rest stays for the union after generation."""
    gen_batch = batch.pop(list(GENERATION_KEYS))
    for key, column in batch.non_tensors.items():
        gen_batch[key] = column
    return gen_batch


def add_response_mask(batch: Batch) -> Batch:
    """`response_mask` = the response part of the attention mask, unless generation gave one (multi-turn: the
    model's tokens only, not the tools' and the environment's)."""
    if "response_mask" not in batch:
        width = batch["responses"].shape[1]
        batch["response_mask"] = batch["attention_mask"][:, -width:].float()
    return batch


def apply_kl(batch: Batch, *, kl_coef: float, kind: str) -> dict[str, float]:
    """token_level_rewards = scores - kl_coef * KL(actor || ref) per token; returns the KL metrics."""
    rewards, metrics = apply_kl_in_reward(
        batch["token_level_scores"],
        batch["old_log_probs"],
        batch["ref_log_prob"],
        batch["response_mask"],
        kl_coef=kl_coef,
        kind=kind,
    )
    batch["token_level_rewards"] = rewards
    return {key: float(value) for key, value in metrics.items()}


def compute_advantage(batch: Batch, *, estimator: str, gamma: float, lam: float, norm_by_std: bool) -> Batch:
    """The estimator fork of the step: each registered estimator takes the inputs it declares."""
    inputs = {
        "token_level_rewards": batch["token_level_rewards"],
        "response_mask": batch["response_mask"],
        "index": batch["uid"],
        "gamma": gamma,
        "lam": lam,
        "norm_by_std": norm_by_std,
    }
    if "values" in batch:
        inputs["values"] = batch["values"]
    batch["advantages"], batch["returns"] = estimate_advantages(estimator, **inputs)
    return batch


def off_policy_corrected(batch: Batch, *, proximal_version: int, mode: str, level: str,
                         cap: float) -> tuple[Batch, dict[str, float]]:
    """The actor's view of `batch` with the rollout correction (`megarl.algorithms.rollout_correction`):
    advantages times the importance weight between the proximal policy (`old_log_probs`, weights
    `proximal_version`) and the behaviour policy (the engine's `rollout_log_probs` of tokens whose
    `token_versions` are older), masked tokens out of `response_mask`; and the rollout_corr/* metrics.
    `batch` itself keeps its advantages (the critic and the logged metrics read those)."""
    proximal = batch["old_log_probs"]
    behaviour = behaviour_log_probs(batch["rollout_log_probs"], proximal, batch["token_versions"], proximal_version)
    weights, kept, metrics = importance_weights(proximal, behaviour, batch["response_mask"], mode=mode,
                                                level=level, cap=cap)
    view = batch.select(batch.keys())
    view["advantages"] = corrected_advantages(batch["advantages"], weights)
    view["response_mask"] = kept.to(batch["response_mask"].dtype)
    return view, metrics
