"""Step metrics computed from the batch: scores, rewards, advantages, lengths, timings, throughput.

The metric names are the logging contract of docs/metrics.md; every value is a
Python float, ready for the logger. Statistics over tokens use the response
tokens only; a statistic over an empty set is NaN rather than an exception,
so one degenerate batch cannot kill a long run from its metrics.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megarl.algorithms.losses import agg_loss
from megarl.algorithms.masked import masked_count, masked_mean

TIMING_PHASES = (
    "gen",
    "onload",
    "reward",
    "reward_total",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "offload",
    "update_weights",
    "step",
)
# Busy time of work that overlaps another phase (reward scoring runs during `gen`): not a slice of the step.
OVERLAPPED_TIMINGS = ("reward_total",)


def _mean_max_min(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """`{prefix}/mean`, `/max`, `/min` of a 1-d tensor (NaN when it is empty)."""
    if values.numel() == 0:
        return {f"{prefix}/{stat}": float("nan") for stat in ("mean", "max", "min")}
    values = values.float()
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def _explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over 1-d tensors (unbiased variances).

    The 1e-5 keeps the ratio finite when every return is equal.
    """
    if returns.numel() < 2:
        return float("nan")
    returns, values = returns.double(), values.double()
    return (1.0 - torch.var(returns - values) / (torch.var(returns) + 1e-5)).item()


def _length_metrics(prefix: str, mask: torch.Tensor, max_length: int) -> dict[str, float]:
    """Length stats of each row of a 0/1 mask, plus the share of rows at `max_length`."""
    lengths = masked_count(mask, dim=-1).float()
    metrics = _mean_max_min(prefix, lengths)
    metrics[f"{prefix}/clip_ratio"] = (lengths == max_length).float().mean().item() if lengths.numel() else 0.0
    return metrics


@torch.no_grad()
def compute_data_metrics(
    *,
    token_level_scores: torch.Tensor,
    token_level_rewards: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    prompt_mask: torch.Tensor,
    max_response_length: int,
    max_prompt_length: int,
    values: torch.Tensor | None = None,
    response_span: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
) -> dict[str, float]:
    """The `critic/*`, `response_length/*` and `prompt_length/*` metrics of one step.

    Shapes: the token tensors and response_mask [B, R], prompt_mask [B, P].
    Scores and rewards are per sequence (sum over tokens); advantages,
    returns and values are over response tokens. `critic/values/*` and
    `critic/vf_explained_var` only when `values` is given. Each clip_ratio is
    the share of rows reaching the configured limit (`max_response_length`,
    `max_prompt_length`), not the batch's widest row. Response lengths count the tokens of `response_span`
    [B, R] (multi-turn: every response token, the tools' too; default `response_mask`). `kept` (bool [B]): the
    rows to count; a dropped sample stays in the batch as a placeholder without
    response tokens, and is no sample of the step's statistics.
    """
    if kept is not None:
        token_level_scores, token_level_rewards, advantages, returns = (
            t[kept] for t in (token_level_scores, token_level_rewards, advantages, returns))
        response_mask, prompt_mask = response_mask[kept], prompt_mask[kept]
        values = None if values is None else values[kept]
        response_span = None if response_span is None else response_span[kept]
    valid = response_mask.bool()
    metrics: dict[str, float] = {}
    metrics |= _mean_max_min("critic/score", token_level_scores.sum(-1))
    metrics |= _mean_max_min("critic/rewards", token_level_rewards.sum(-1))
    metrics |= _mean_max_min("critic/advantages", advantages[valid])
    valid_returns = returns[valid]
    metrics |= _mean_max_min("critic/returns", valid_returns)
    if values is not None:
        valid_values = values[valid]
        metrics |= _mean_max_min("critic/values", valid_values)
        metrics["critic/vf_explained_var"] = _explained_variance(valid_returns, valid_values)
    span = response_mask if response_span is None else response_span
    metrics |= _length_metrics("response_length", span, max_response_length)
    metrics |= _length_metrics("prompt_length", prompt_mask, max_prompt_length)
    return metrics


@torch.no_grad()
def multi_turn_metrics(*, num_turns: torch.Tensor, truncated: torch.Tensor, response_mask: torch.Tensor,
                       response_span: torch.Tensor) -> dict[str, float]:
    """`multi_turn/*` of a batch of episodes: model turns per episode (`num_turns` [B]), the share of truncated
    episodes (`truncated` [B] bool), and `tool_token_share`, the share of the response tokens (`response_span`
    [B, R]: 1 on every response token) that tools and the environment wrote (`response_mask` [B, R]: 1 on the
    model's)."""
    span = response_span.float().sum()
    environment = span - (response_mask.float() * response_span.float()).sum()
    return {
        "multi_turn/turns/mean": float(num_turns.float().mean()),
        "multi_turn/turns/max": float(num_turns.max()),
        "multi_turn/truncated": float(truncated.float().mean()),
        "multi_turn/tool_token_share": float(environment / span) if span > 0 else 0.0,
    }


@torch.no_grad()
def entropy_metric(entropy: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str) -> float:
    """`actor/entropy`: the token entropies `[B, R]` of the step's responses aggregated like the actor's loss."""
    return float(agg_loss(entropy.double(), response_mask, loss_agg_mode))


def compute_timing_metrics(timings: Mapping[str, float]) -> dict[str, float]:
    """`{phase: seconds}` -> `{"timing_s/<phase>": seconds}`; phases from TIMING_PHASES only.

    An unknown phase is a ValueError: a typo in a timer name would otherwise
    silently create a metric no dashboard shows.
    """
    unknown = sorted(set(timings) - set(TIMING_PHASES))
    if unknown:
        raise ValueError(f"unknown timing phase(s) {unknown}; known: {', '.join(TIMING_PHASES)}")
    return {f"timing_s/{phase}": float(seconds) for phase, seconds in timings.items()}


def compute_throughput_metrics(*, total_tokens: int, step_seconds: float, num_gpus: int) -> dict[str, float]:
    """`perf/throughput` (tokens per second per GPU), `perf/total_num_tokens`, `perf/time_per_step`.

    total_tokens counts prompt + response tokens of the step's batch.
    """
    if step_seconds <= 0 or num_gpus <= 0:
        raise ValueError(f"step_seconds and num_gpus must be > 0, got {step_seconds} and {num_gpus}")
    return {
        "perf/throughput": total_tokens / (step_seconds * num_gpus),
        "perf/total_num_tokens": float(total_tokens),
        "perf/time_per_step": float(step_seconds),
    }


@torch.no_grad()
def rollout_logprob_diff(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> float:
    """`rollout/logprob_diff`: mean |engine log-prob - actor log-prob| over response tokens `[B, R]`.

    Near 0 right after a weight sync; a jump means the rollout fleet and the
    trainer disagree about the weights (or the numerics).
    """
    diff = (rollout_log_probs.double() - old_log_probs.double()).abs()
    return masked_mean(diff, response_mask).item()


@torch.no_grad()
def rm_score_metrics(
    rm_scores: torch.Tensor, rule_scores: torch.Tensor, has_response: torch.Tensor
) -> dict[str, float]:
    """`reward/rm_score/{mean,max,min}` of the model-side scores [B] and `reward/rm_rule_corr`, their Pearson
    correlation with the rule scores [B] (NaN when either is constant), over the rows with a response (bool [B])."""
    model, rule = rm_scores[has_response].double(), rule_scores[has_response].double()
    metrics = _mean_max_min("reward/rm_score", model)
    correlated = model.numel() > 1 and model.std() > 0 and rule.std() > 0
    corr = torch.corrcoef(torch.stack([model, rule]))[0, 1].item() if correlated else float("nan")
    metrics["reward/rm_rule_corr"] = corr
    return metrics
