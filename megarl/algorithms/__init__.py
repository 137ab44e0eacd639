"""The algorithm core: pure PyTorch functions for advantages, losses, KL and step metrics.

Tensors in, tensors out, explicit keyword arguments (never a config object),
shapes in every docstring (`[B, R]` = batch x response length). Names from
recipes resolve through the registries of `megarl.registry`
(`ADVANTAGE_ESTIMATORS`, `POLICY_LOSSES`, `KL_PENALTIES`, `LOSS_AGG_MODES`),
which the modules here fill (the policy losses in `policy_losses/`, one file
each). Importing this package loads torch and numpy only (no megatron, sglang
or ray), so it runs on the controller and in CPU tests.
"""

from megarl.algorithms.advantages import (
    estimate_advantages,
    estimator,
    gae,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)
from megarl.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    entropy_from_logits,
    kl_penalty,
)
from megarl.algorithms.losses import agg_loss, policy_loss, policy_loss_fn, value_loss
from megarl.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megarl.algorithms.metrics import (
    OVERLAPPED_TIMINGS,
    TIMING_PHASES,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    rollout_logprob_diff,
)

__all__ = [
    "OVERLAPPED_TIMINGS",
    "TIMING_PHASES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_in_reward",
    "compute_data_metrics",
    "compute_throughput_metrics",
    "compute_timing_metrics",
    "entropy_from_logits",
    "estimate_advantages",
    "estimator",
    "gae",
    "grpo",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "policy_loss_fn",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
    "rollout_logprob_diff",
    "value_loss",
]
