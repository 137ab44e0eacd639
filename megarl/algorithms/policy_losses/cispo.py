"""`cispo`: Clipped IS-weight Policy Optimization (MiniMax-M1, 2025): a clipped, detached importance weight
times the log-probability, so no token's gradient is dropped.

With sg[.] a stop-gradient:

    ratio_t   = exp(clip(logp_new_t - logp_old_t, -20, 20))
    w_t       = sg[clip(ratio_t, 1 - eps_low, 1 + eps_high)]
    pg_loss_t = -w_t * A_t * logp_new_t

PPO's clip zeroes the gradient of a token once its ratio leaves the trust
region, and such tokens are often the rare, decisive ones (a "However" that
starts a correction). CISPO clips the importance weight instead and keeps it out
of the graph: every token's gradient is -w_t * A_t * grad logp_new_t, the
REINFORCE gradient off-policy-corrected by a bounded weight. The MiniMax-M1
paper uses a large eps_high and effectively no lower clip. As verl 0.9.1's
`compute_policy_loss_cispo`.
"""

from __future__ import annotations

import torch

from megarl.algorithms.losses import policy_loss_fn
from megarl.algorithms.masked import masked_mean


@policy_loss_fn("cispo")
def cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss `[B, R]` and metrics (0-d, detached): `actor/pg_clipfrac` the share of response tokens
    whose weight is clipped, `actor/ppo_kl` the masked mean of logp_old - logp_new (clamped as the ratio),
    `actor/pg_clipfrac_lower` 0 (no dual clip)."""
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    per_token = -weight * advantages * log_prob
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": masked_mean((ratio != weight).float(), response_mask),
            "actor/ppo_kl": masked_mean(-log_ratio, response_mask),
            "actor/pg_clipfrac_lower": torch.zeros((), device=per_token.device),
        }
    return per_token, {name: value.detach() for name, value in metrics.items()}
