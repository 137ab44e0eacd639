"""`ppo_clip`: the clipped PPO surrogate with dual clip, per token (the default `actor.policy_loss`).

    ratio_t   = exp(clip(logp_new_t - logp_old_t, -20, 20))
    pg_loss_t = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_low, 1 + eps_high))
    A_t < 0:  pg_loss_t = min(pg_loss_t, -A_t * c)                                    (dual clip)

eps_low/eps_high = `clip_ratio_low`/`clip_ratio_high`, c = `clip_ratio_c` (> 1).
The clamp of the log-ratio keeps exp finite for far-off-policy tokens; the dual
clip caps the loss of a bad action whose ratio has grown huge. As verl 0.9.1's
`compute_policy_loss_vanilla`.
"""

from __future__ import annotations

import torch

from megarl.algorithms.losses import policy_loss_fn
from megarl.algorithms.masked import masked_mean


@policy_loss_fn("ppo_clip")
def ppo_clip(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss `[B, R]` and metrics (0-d, detached): `actor/pg_clipfrac` the share of response tokens
    where the clip is active, `actor/ppo_kl` the masked mean of logp_old - logp_new (clamped as the ratio),
    `actor/pg_clipfrac_lower` the share where the dual clip is active."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pessimistic = torch.maximum(unclipped, clipped)
    dual_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    per_token = torch.where(negative, torch.minimum(pessimistic, dual_cap), pessimistic)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
            "actor/ppo_kl": masked_mean(-log_ratio, response_mask),
            "actor/pg_clipfrac_lower": masked_mean(((pessimistic > dual_cap) & negative).float(), response_mask),
        }
    return per_token, {name: value.detach() for name, value in metrics.items()}
