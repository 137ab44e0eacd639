"""KL divergence estimators, KL-in-reward, KL coefficient controllers and token entropy.

KL between the policy and the reference policy is estimated per token from
the two log-probabilities of the sampled token (Schulman's k1/k2/k3
estimators). It enters training either as a penalty in the reward
(`apply_kl_in_reward`, with a fixed or adaptive coefficient) or as a term of
the actor loss (the engine calls `kl_penalty` and `agg_loss` itself).
"""

from __future__ import annotations

import torch

from megarl.algorithms.masked import masked_mean
from megarl.registry import KL_PENALTIES


@KL_PENALTIES.register("kl", "k1")
def _k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


@KL_PENALTIES.register("abs")
def _abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


@KL_PENALTIES.register("mse", "k2")
def _k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


@KL_PENALTIES.register("low_var_kl", "k3")
def _k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    # Unbiased and always >= 0, but exp() explodes when the policies drift far
    # apart: clamp the log-ratio before exp and the estimate after it.
    log_ratio = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    estimate = torch.exp(log_ratio) - log_ratio - 1.0
    return torch.clamp(estimate, min=-10.0, max=10.0)


@KL_PENALTIES.register("low_var_kl+", "k3+")
def _k3_value_k2_gradient(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    # k3's expectation is the KL, but the expectation of its gradient is not the KL's gradient; k2's is.
    # Straight-through: k3's value in the forward pass, k2's gradient in the backward pass.
    k2 = _k2(log_prob, ref_log_prob)
    return k2 - k2.detach() + _k3(log_prob, ref_log_prob).detach()


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate `[B, R]` from policy and reference log-probs `[B, R]`.

    Kinds: `kl`/`k1` logp - ref; `abs` |logp - ref|; `mse`/`k2`
    0.5 (logp - ref)^2; `low_var_kl`/`k3` exp(ref - logp) - (ref - logp) - 1
    with ref - logp clamped to [-20, 20] and the result to [-10, 10];
    `low_var_kl+`/`k3+` k3's value with k2's gradient, logp - ref (straight-through).
    Unknown kind -> ValueError listing the known ones.
    """
    return KL_PENALTIES.get(kind).target(log_prob, ref_log_prob)


@torch.no_grad()
def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Subtract `kl_coef * KL` from the per-token scores; all tensors `[B, R]`.

    Returns (token_level_rewards [B, R], metrics). The KL is zeroed outside the
    response. Metrics are Python floats (this runs once per step on the
    controller, which feeds the value to the KL controller):
    `actor/reward_kl_penalty` the batch mean of the per-sequence mean KL,
    `actor/reward_kl_penalty_coeff` the coefficient used.
    """
    kld = torch.where(response_mask.bool(), kl_penalty(log_prob, ref_log_prob, kind), 0.0)
    token_level_rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean()
    metrics = {
        "actor/reward_kl_penalty": float(current_kl.item()),
        "actor/reward_kl_penalty_coeff": float(kl_coef),
    }
    return token_level_rewards, metrics


class FixedKLController:
    """A constant KL coefficient; `update` is a no-op so callers treat both controllers alike."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards `target_kl` (Ziegler et al. 2019).

    update: err = clip(current_kl / target_kl - 1, -0.2, 0.2);
    value *= 1 + err * n_steps / horizon. The clip bounds the change per
    update, so one noisy batch cannot swing the coefficient.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0, got target_kl={target_kl}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt `value` after `n_steps` samples whose mean KL was `current_kl`."""
        proportional_error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """The adapted coefficient: all a resumed run needs to continue the same trajectory."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dim: `[..., V]` -> `[...]`.

    H = logsumexp(z) - sum(softmax(z) * z), which equals -sum(p log p) but
    never takes the log of an underflowed probability. Logits must be finite
    (mask a vocabulary with a large negative number, not -inf).
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
