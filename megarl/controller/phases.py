"""The data-shaping parts of a step: uids, the generation batch, assembling responses, masks, advantages.

Each function takes and returns a `Batch` (or tensors) and does one thing of the
phase table in DESIGN.md §1; the step (`step.py`) calls them in order.
"""

from __future__ import annotations

import uuid

import numpy as np

from megarl.algorithms.advantages import estimate_advantages
from megarl.algorithms.kl import apply_kl_in_reward
from megarl.protocol import Batch
# The rollout-side helpers are part of this module's API (the step loop and the SFT warm-up use them).
from megarl.rollout.batching import assemble_rollout, prompt_token_lists

__all__ = [
    "GENERATION_KEYS", "add_response_mask", "add_uids", "apply_kl", "assemble_rollout", "compute_advantage",
    "prompt_token_lists", "split_generation_batch",
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
