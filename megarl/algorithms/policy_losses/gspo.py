"""`gspo`: Group Sequence Policy Optimization (Zheng et al. 2025): one importance ratio per sequence, clipped.

With |y_i| the response tokens of sequence i and sg[.] a stop-gradient:

    s_i        = exp( (1/|y_i|) sum_t (logp_new_it - logp_old_it) )      the geometric mean of the token ratios
    ratio_it   = exp(min(sg[log s_i] + logp_new_it - sg[logp_new_it], 10))
    pg_loss_it = max(-A_it * ratio_it, -A_it * clip(ratio_it, 1 - eps_low, 1 + eps_high))

Every token of sequence i carries the value s_i, so the clip acts on whole
sequences (a sequence is in or out of the trust region as one), while the
gradient reaches each token through its own log-prob: d ratio_it / d logp_new_it
= s_i. With `seq-mean-token-mean` aggregation the gradient is the paper's,
-(1/|S|) sum_i A_i s_i (1/|y_i|) sum_t grad logp_new_it on unclipped sequences;
the other modes weight tokens as they do for PPO. The log-ratio is clamped at 10
(exp stays finite). GSPO's clip ranges are far narrower than PPO's (the paper: eps_low
3e-4, eps_high 4e-4), because a sequence ratio moves much less than a token ratio.
As verl 0.9.1's `compute_policy_loss_gspo`.
"""

from __future__ import annotations

import torch

from megarl.algorithms.losses import policy_loss_fn
from megarl.algorithms.masked import masked_mean


@policy_loss_fn("gspo")
def gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss `[B, R]` and metrics (0-d, detached): `actor/pg_clipfrac` the share of response tokens
    whose sequence is clipped, `actor/ppo_kl` the masked mean of logp_old - logp_new, `actor/pg_clipfrac_lower`
    0 (no dual clip)."""
    token_log_ratio = log_prob - old_log_prob
    # log s_i: the mean over the sequence's response tokens (an empty sequence gets 0, and carries no loss).
    sequence_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1)
    log_ratio = sequence_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
            "actor/ppo_kl": masked_mean(-token_log_ratio, response_mask),
            "actor/pg_clipfrac_lower": torch.zeros((), device=per_token.device),
        }
    return per_token, {name: value.detach() for name, value in metrics.items()}
