"""Advantage estimators (GAE, GRPO, RLOO, REINFORCE++ and its group baseline), registered by name.

Every estimator takes `[B, R]` tensors (B samples x R response tokens, responses
left-aligned in the R window) plus explicit keyword arguments, and returns
`(advantages, returns)`, both `[B, R]`. They run under `torch.no_grad()`:
advantages are targets, never differentiated through. The group-based
estimators take `index` (the prompt `uid` of each sample): samples with the
same index are answers to the same prompt.

An estimator declares what it consumes by its parameter names, drawn from
`ESTIMATOR_INPUTS`; `@estimator(name)` registers it in
`megarl.registry.ADVANTAGE_ESTIMATORS` with the metadata derived from them
(`needs_critic`: it reads `values`; `needs_groups`: it reads `index`), and
`estimate_advantages` calls it with exactly those inputs. A new estimator is
one decorated function: the recipe checks and the step loop find it by name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from megarl.algorithms import _scan
from megarl.algorithms.masked import masked_whiten_
from megarl.registry import ADVANTAGE_ESTIMATORS

GroupIndex = np.ndarray | torch.Tensor | Sequence

# What an estimator may ask for, by parameter name: the step's tensors, then the recipe's settings.
ESTIMATOR_INPUTS = (
    "token_level_rewards",  # [B, R] rewards (scores, KL-penalised when in reward)
    "response_mask",  # [B, R] 1 at response tokens
    "values",  # [B, R] critic values: the estimator needs a critic
    "index",  # [B] prompt uid per sample: the estimator compares responses within a group
    "gamma",  # discount (algorithm.gamma)
    "lam",  # GAE lambda (algorithm.lam)
    "norm_by_std",  # divide by the group std (algorithm.norm_adv_by_std_in_grpo)
)


def estimator(name: str) -> Callable[[Callable], Callable]:
    """Register an estimator under `name`; its parameters must come from `ESTIMATOR_INPUTS` (or have defaults)."""

    def decorator(fn: Callable) -> Callable:
        params = inspect.signature(fn).parameters
        unknown = [p for p, spec in params.items() if p not in ESTIMATOR_INPUTS and spec.default is inspect._empty]
        if unknown:
            raise TypeError(f"estimator {name!r}: parameters {unknown} are not inputs ({', '.join(ESTIMATOR_INPUTS)})")
        ADVANTAGE_ESTIMATORS.add(name, fn, needs_critic="values" in params, needs_groups="index" in params)
        return fn

    return decorator


def estimate_advantages(name: str, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Run estimator `name` on the `inputs` it declares (the rest are ignored): (advantages, returns) [B, R]."""
    fn = ADVANTAGE_ESTIMATORS.get(name).target
    params = inspect.signature(fn).parameters
    missing = [p for p in params if p in ESTIMATOR_INPUTS and p not in inputs and params[p].default is inspect._empty]
    if missing:
        raise ValueError(f"advantage estimator {name!r} needs {missing}, which the step did not provide")
    return fn(**{key: value for key, value in inputs.items() if key in params})


def _float_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """At least float32, wider if an input is wider (float64 references stay exact)."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"expected equal [B, R] shapes, got {shapes}")


_WHITEN_EPS = 1e-8  # added to the variance when whitening GAE and REINFORCE++ advantages


def group_ids(index: GroupIndex, batch_size: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
    """Map each sample's group key to a dense id in [0, G); returns (ids [B] int64 on `device`, G).

    `index` is a numpy array (object/str uids or ints), a list, or an int
    tensor. Vectorised through np.unique / torch.unique: no Python loop over
    samples, so 16k uids map in milliseconds.
    """
    if isinstance(index, torch.Tensor):
        keys, inverse = torch.unique(index.reshape(-1), return_inverse=True)
    else:
        keys, inverse = np.unique(np.asarray(index).reshape(-1), return_inverse=True)
        inverse = torch.from_numpy(inverse.reshape(-1).astype(np.int64))
    if inverse.numel() != batch_size:
        raise ValueError(f"index has {inverse.numel()} entries, batch has {batch_size} samples")
    return inverse.to(device), len(keys)


def _group_sums(values: torch.Tensor, ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group sum of a [B] tensor -> [G]."""
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, ids, values)


@estimator("gae")
@torch.no_grad()
def gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens, whitened.

    Shapes: token_level_rewards, values, response_mask [B, R] -> advantages,
    returns [B, R]. Recursion (backwards in t, only at response tokens):
        delta_t = r_t + gamma * V_next - V_t;  A_t = delta_t + gamma * lam * A_next
    At a masked position the next value and the running advantage pass
    through unchanged, so a hole inside the response (e.g. tool output) is
    skipped rather than cutting the credit flow. `returns = A + V` before
    whitening (at masked positions it holds carried values: mask it when
    used); advantages are whitened over response tokens and zeroed outside.
    """
    _check_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    dtype = _float_dtype(token_level_rewards, values)
    rewards, values = token_level_rewards.to(dtype), values.to(dtype)
    if _scan.available(rewards, values, response_mask):
        return _scan.scan_whitened(rewards, values, response_mask, gamma=gamma, lam=lam, eps=_WHITEN_EPS)
    advantages = _gae_torch(rewards, values, response_mask, gamma=gamma, lam=lam)
    returns = advantages + values
    return masked_whiten_(advantages, response_mask, eps=_WHITEN_EPS), returns


def _gae_torch(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """Pure-torch GAE scan (no numba, or not on the CPU): raw advantages [B, R], carried through masked positions.

    rewards and values share one float dtype. One batch-wide step per token, so
    its cost is R dispatches of [B] ops rather than one pass over memory.
    """
    batch, length = values.shape
    dtype = values.dtype
    # Time-major copies: each loop step reads one row of B contiguous floats
    # instead of B floats R apart. Padding is zeroed once up front, so the
    # loop can use cheap arithmetic (a where() per step costs 5x more).
    valid_t = response_mask.bool().t().contiguous()
    invalid_t = ~valid_t
    values_t = values.t().contiguous().masked_fill_(invalid_t, 0.0)
    work_t = rewards.t().contiguous().sub_(values_t).masked_fill_(invalid_t, 0.0)

    next_value = torch.zeros(batch, dtype=dtype, device=values.device)
    last_gae = torch.zeros(batch, dtype=dtype, device=values.device)
    for t in reversed(range(length)):
        valid, masked = valid_t[t].to(dtype), invalid_t[t].to(dtype)
        # work_t[t] holds r_t - V_t (0 at padding) until it is overwritten with A_t.
        candidate = torch.addcmul(work_t[t], valid, next_value, value=gamma).add_(last_gae, alpha=gamma * lam)
        torch.addcmul(last_gae * masked, valid, candidate, out=work_t[t])
        last_gae = work_t[t]
        next_value = torch.addcmul(values_t[t], masked, next_value)
    del values_t, valid_t, invalid_t
    return work_t.t().contiguous()


def _group_mean_std(scores: torch.Tensor, ids: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, unbiased group std) gathered back to [B].

    A group of one has no spread: it gets mean 0 and std 1 so its score
    passes through unchanged (verl's convention, kept for comparability).
    """
    counts = torch.bincount(ids, minlength=num_groups).to(scores.dtype)
    means = _group_sums(scores, ids, num_groups) / counts
    deviations = scores - means[ids]
    variances = _group_sums(deviations.square(), ids, num_groups) / (counts - 1).clamp(min=1)
    singleton = counts == 1
    means = torch.where(singleton, 0.0, means)
    stds = torch.where(singleton, 1.0, variances.sqrt())
    return means[ids], stds[ids]


def _broadcast(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] per-sample score -> [B, R] on the response tokens, 0 elsewhere."""
    return torch.where(response_mask.bool(), scores.unsqueeze(-1), 0.0)


@estimator("grpo")
@torch.no_grad()
def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: the sample's score normalised within its prompt group.

    Shapes: token_level_rewards, response_mask [B, R], index [B] -> advantages,
    returns [B, R] (returns == advantages). score_i = sum_t r_{i,t};
    A_i = (score_i - mean_group) / (std_group + epsilon), std unbiased; with
    norm_by_std=False (Dr.GRPO) only the mean is subtracted. A group of one
    gets mean 0 and std 1, i.e. A = score / (1 + epsilon) (raw score without
    std normalisation).
    """
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    scores = token_level_rewards.to(_float_dtype(token_level_rewards)).sum(-1)
    ids, num_groups = group_ids(index, scores.shape[0], scores.device)
    means, stds = _group_mean_std(scores, ids, num_groups)
    scores = scores - means
    if norm_by_std:
        scores = scores / (stds + epsilon)
    advantages = _broadcast(scores, response_mask)
    return advantages, advantages


@estimator("rloo")
@torch.no_grad()
def rloo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: score minus the mean score of the *other* samples of its group.

    Shapes: token_level_rewards, response_mask [B, R], index [B] -> advantages,
    returns [B, R] (returns == advantages). For a group of n >= 2:
    A_i = s_i - (sum_group - s_i) / (n - 1). A group of one has no other
    sample, so its baseline is 0 and A_i = s_i.
    """
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    scores = token_level_rewards.to(_float_dtype(token_level_rewards)).sum(-1)
    ids, num_groups = group_ids(index, scores.shape[0], scores.device)
    sums = _group_sums(scores, ids, num_groups)[ids]
    counts = torch.bincount(ids, minlength=num_groups).to(scores.dtype)[ids]
    others_mean = (sums - scores) / (counts - 1).clamp(min=1)
    baseline = torch.where(counts > 1, others_mean, 0.0)
    advantages = _broadcast(scores - baseline, response_mask)
    return advantages, advantages


@estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go over response tokens, whitened over the batch.

    Shapes: token_level_rewards, response_mask [B, R] -> advantages, returns
    [B, R]. G_t = r_t + gamma * G_next at response tokens; a masked position
    passes G through unchanged and its reward is ignored (same convention as
    `gae`). returns = G (at a masked position: the G carried from the next
    response token, 0 after the last); advantages = whiten(G) over response
    tokens, 0 elsewhere.
    """
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    rewards = token_level_rewards.to(_float_dtype(token_level_rewards))
    if _scan.available(rewards, response_mask):
        # GAE with V = 0 and lam = 1 is exactly this return-to-go.
        return _scan.scan_whitened(rewards, None, response_mask, gamma=gamma, lam=1.0, eps=_WHITEN_EPS)
    returns = _returns_to_go_torch(rewards, response_mask, gamma=gamma)
    return masked_whiten_(returns.clone(), response_mask, eps=_WHITEN_EPS), returns


def _returns_to_go_torch(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Pure-torch return-to-go scan (no numba, or not on the CPU): G [B, R], carried through masked positions."""
    batch, length = rewards.shape
    dtype = rewards.dtype
    valid_t = response_mask.bool().t().contiguous()
    invalid_t = ~valid_t
    # Time-major, padding zeroed; row t holds r_t until it is overwritten with G_t.
    returns_t = rewards.t().contiguous().masked_fill_(invalid_t, 0.0)
    running = torch.zeros(batch, dtype=dtype, device=rewards.device)
    for t in reversed(range(length)):
        valid, masked = valid_t[t].to(dtype), invalid_t[t].to(dtype)
        carried = torch.addcmul(returns_t[t], masked, running)  # r_t + G at padding (r_t = 0 there)
        torch.addcmul(carried, valid, running, value=gamma, out=returns_t[t])
        running = returns_t[t]
    return returns_t.t().contiguous()


@estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline: (score - group mean), broadcast, whitened over the batch.

    Shapes: token_level_rewards, response_mask [B, R], index [B] -> advantages,
    returns [B, R] (returns == advantages). A group of one gets baseline 0.
    The batch whitening is over response tokens with `epsilon` added to the
    variance; the result is 0 outside the response.
    """
    _check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    scores = token_level_rewards.to(_float_dtype(token_level_rewards)).sum(-1)
    ids, num_groups = group_ids(index, scores.shape[0], scores.device)
    means, _ = _group_mean_std(scores, ids, num_groups)
    centered = _broadcast(scores - means, response_mask)
    advantages = masked_whiten_(centered, response_mask, eps=epsilon)
    return advantages, advantages
