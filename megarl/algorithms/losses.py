"""The loss aggregation modes, the policy-loss registry and its entry point, and the PPO value loss.

Losses are built per token as `[B, R]` matrices and reduced by `agg_loss`,
whose mode decides how tokens and sequences are weighted (token-mean,
seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm). The policy
losses themselves (`ppo_clip`, `gspo`, `cispo`) are one module each in
`megarl.algorithms.policy_losses`, registered with `policy_loss_fn` and called
through `policy_loss`.

Metrics are returned as 0-d tensors detached from the graph, not Python
floats: an engine can stack and all-reduce them across data-parallel ranks
and micro-batches before a single `.item()`, instead of one sync per metric.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from megarl.algorithms.masked import masked_count, masked_mean, masked_sum
from megarl.registry import LOSS_AGG_MODES, POLICY_LOSSES

# The recipe's `actor.*` settings a policy loss may take, by parameter name.
POLICY_LOSS_OPTIONS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")

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
    response window), the modes are (docs/step.md): `token-mean` sum / valid
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


def policy_loss_fn(name: str) -> Callable[[Callable], Callable]:
    """Register a per-token policy loss under `name` (`actor.policy_loss`) in `POLICY_LOSSES`.

    The function takes `(old_log_prob, log_prob, advantages, response_mask)` `[B, R]` and, as keyword-only
    parameters, the options it uses from `POLICY_LOSS_OPTIONS`; it returns the per-token loss `[B, R]` and
    its metrics (0-d, detached). `policy_loss` aggregates the per-token loss, so every loss works with every
    `loss_agg_mode`.
    """

    def decorator(fn: Callable) -> Callable:
        params = inspect.signature(fn).parameters
        options = tuple(p for p, spec in params.items() if spec.kind is inspect.Parameter.KEYWORD_ONLY)
        unknown = [p for p in options if p not in POLICY_LOSS_OPTIONS]
        if unknown:
            raise TypeError(f"policy loss {name!r}: options {unknown} are not in {POLICY_LOSS_OPTIONS}")
        POLICY_LOSSES.add(name, fn, options=options)
        return fn

    return decorator


def policy_loss(
    name: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str,
    global_tokens: Normaliser = None,
    global_seqs: Normaliser = None,
    **options: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss `name` (`actor.policy_loss`); all tensors `[B, R]` -> (scalar loss, metrics).

    The per-token loss of `name` reduced by `agg_loss` (`loss_agg_mode`, `global_tokens`, `global_seqs` as
    there). `options` holds at least the options the loss declares (clip_ratio_low, ...); it takes only those.
    Metrics (0-d, detached): `actor/pg_clipfrac`, `actor/ppo_kl`, `actor/pg_clipfrac_lower`.
    """
    entry = POLICY_LOSSES.get(name)
    missing = [option for option in entry.options if option not in options]
    if missing:
        raise ValueError(f"policy loss {name!r} needs the options {missing}")
    per_token, metrics = entry.target(old_log_prob, log_prob, advantages, response_mask,
                                      **{option: options[option] for option in entry.options})
    loss = agg_loss(per_token, response_mask, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs)
    return loss, metrics


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
