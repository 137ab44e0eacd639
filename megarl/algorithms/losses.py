"""PPO policy and value losses and the loss aggregation modes.

Losses are built per token as `[B, R]` matrices and reduced by `agg_loss`,
whose mode decides how tokens and sequences are weighted (token-mean,
seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm).

Metrics are returned as 0-d tensors detached from the graph, not Python
floats: an engine can stack and all-reduce them across data-parallel ranks
and micro-batches before a single `.item()`, instead of one sync per metric.
"""

from __future__ import annotations

import torch

from megarl.algorithms.masked import masked_count, masked_mean, masked_sum
from megarl.registry import LOSS_AGG_MODES

# A token or sequence count to divide by instead of the local one (see agg_loss).
Normaliser = float | torch.Tensor | None


def _tokens(loss_mask: torch.Tensor, global_tokens: Normaliser) -> Normaliser:
    return masked_count(loss_mask).clamp(min=1) if global_tokens is None else global_tokens


def _sequences(loss_mask: torch.Tensor, global_seqs: Normaliser) -> Normaliser:
    """|S|: the sequences with at least one valid token (an empty one carries no loss, so it is no sample)."""
    return (masked_count(loss_mask, dim=-1) > 0).sum().clamp(min=1) if global_seqs is None else global_seqs


@LOSS_AGG_MODES.register("token-mean")
def _token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor, global_tokens: Normaliser,
                global_seqs: Normaliser) -> torch.Tensor:
    return masked_sum(loss_mat, loss_mask) / _tokens(loss_mask, global_tokens)


@LOSS_AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat: torch.Tensor, loss_mask: torch.Tensor, global_tokens: Normaliser,
                        global_seqs: Normaliser) -> torch.Tensor:
    return masked_sum(loss_mat, loss_mask) / _sequences(loss_mask, global_seqs)


@LOSS_AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat: torch.Tensor, loss_mask: torch.Tensor, global_tokens: Normaliser,
                         global_seqs: Normaliser) -> torch.Tensor:
    # masked_mean gives an empty row 0, so the sum runs over S alone.
    return masked_mean(loss_mat, loss_mask, dim=-1).sum() / _sequences(loss_mask, global_seqs)


@LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat: torch.Tensor, loss_mask: torch.Tensor, global_tokens: Normaliser,
                             global_seqs: Normaliser) -> torch.Tensor:
    # Dr.GRPO: each sequence's token sum over a constant horizon H (the response window), so a long
    # answer is not down-weighted per token; then the mean over sequences, so the loss does not
    # grow with the mini-batch size.
    horizon = loss_mask.shape[-1]
    return masked_sum(loss_mat, loss_mask) / (_sequences(loss_mask, global_seqs) * horizon)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    global_tokens: Normaliser = None,
    global_seqs: Normaliser = None,
) -> torch.Tensor:
    """Reduce a per-token loss `[B, R]` over the valid tokens of `loss_mask` `[B, R]` to a scalar.

    With S = the sequences holding at least one valid token and H = R (the
    response window), the modes are (DESIGN.md §4): `token-mean` sum / valid
    tokens; `seq-mean-token-sum` (1/|S|) sum_i sum_t l; `seq-mean-token-mean`
    (1/|S|) sum_i mean_t l; `seq-mean-token-sum-norm` (1/|S|) sum_i sum_t l / H
    (Dr.GRPO).

    `global_tokens` / `global_seqs` replace the local token count / |S| of the
    denominator. Pass the totals of the whole mini-batch (all micro-batches on
    all data-parallel ranks): then every micro-batch loss is its share of the
    mini-batch loss and summing them (gradient accumulation, plus a SUM
    all-reduce across ranks) gives exactly the mini-batch value, whatever the
    split; where gradients are averaged over DP ranks instead (Megatron DDP's
    default), scale the loss by the DP size.
    """
    reduce = LOSS_AGG_MODES.get(loss_agg_mode).target
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} differ")
    return reduce(loss_mat, loss_mask, global_tokens, global_seqs)


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    *,
    global_tokens: Normaliser = None,
    global_seqs: Normaliser = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate with dual clip; all tensors `[B, R]` -> (scalar loss, metrics).

    ratio = exp(clamp(log_prob - old_log_prob, -20, 20)) (the clamp keeps exp
    finite for far-off-policy tokens); per token
        loss = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high)),
    and for A < 0 additionally capped at -A * clip_ratio_c (dual clip: a huge
    ratio on a bad action cannot blow up the loss). Metrics (0-d, detached):
    `actor/pg_clipfrac` share of response tokens where the clip is active,
    `actor/ppo_kl` masked mean of old_log_prob - log_prob,
    `actor/pg_clipfrac_lower` share of response tokens where the dual clip is active.
    """
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
    loss = agg_loss(per_token, response_mask, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)

    with torch.no_grad():
        metrics = {
            "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
            "actor/ppo_kl": masked_mean(-log_ratio, response_mask),
            "actor/pg_clipfrac_lower": masked_mean(((pessimistic > dual_cap) & negative).float(), response_mask),
        }
    return loss, {name: value.detach() for name, value in metrics.items()}


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    global_tokens: Normaliser = None,
    global_seqs: Normaliser = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss; all tensors `[B, R]` -> (scalar loss, clipfrac 0-d detached).

    vclipped = values + clamp(vpreds - values, -c, c);
    loss = 0.5 * agg(max((vpreds - returns)^2, (vclipped - returns)^2)):
    the critic may not move further than c from the rollout-time values in
    one update. clipfrac = share of response tokens where the clipped term wins.
    """
    vclipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    unclipped = (vpreds - returns).square()
    clipped = (vclipped - returns).square()
    per_token = torch.maximum(unclipped, clipped)
    loss = 0.5 * agg_loss(per_token, response_mask, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    return loss, clipfrac.detach()
