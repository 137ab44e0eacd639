"""Step metrics: exact names (docs/metrics.md) and values on a tiny hand-made batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.algorithms.metrics import (
    TIMING_PHASES,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    entropy_metric,
    rollout_logprob_diff,
)

RESPONSE_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
PROMPT_MASK = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
SCORES = torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
REWARDS = torch.tensor([[-0.1, 0.0, 1.0], [0.5, 0.0, 0.0], [0.0, -0.2, 0.0]])
ADVANTAGES = torch.tensor([[1.0, 2.0, 3.0], [-4.0, 99.0, 99.0], [0.5, 0.25, 99.0]])
RETURNS = torch.tensor([[1.0, 0.5, 0.0], [2.0, -99.0, -99.0], [3.0, 4.0, -99.0]])
VALUES = torch.tensor([[0.8, 0.7, 0.1], [1.5, 50.0, 50.0], [2.0, 3.5, 50.0]])


def batch_metrics(values=None):
    return compute_data_metrics(
        token_level_scores=SCORES,
        token_level_rewards=REWARDS,
        advantages=ADVANTAGES,
        returns=RETURNS,
        response_mask=RESPONSE_MASK,
        prompt_mask=PROMPT_MASK,
        max_response_length=3,
        max_prompt_length=4,
        values=values,
    )


def stats(prefix, mean, high, low):
    return {f"{prefix}/mean": pytest.approx(mean), f"{prefix}/max": pytest.approx(high), f"{prefix}/min": pytest.approx(low)}


def test_data_metrics_names_and_values_with_values():
    metrics = batch_metrics(values=VALUES)
    valid_returns = np.array([1.0, 0.5, 0.0, 2.0, 3.0, 4.0])
    valid_values = np.array([0.8, 0.7, 0.1, 1.5, 2.0, 3.5])
    explained = 1 - np.var(valid_returns - valid_values, ddof=1) / (np.var(valid_returns, ddof=1) + 1e-5)
    expected = {
        **stats("critic/score", 0.5, 1.0, 0.0),
        **stats("critic/rewards", (0.9 + 0.5 - 0.2) / 3, 0.9, -0.2),
        **stats("critic/advantages", (1 + 2 + 3 - 4 + 0.5 + 0.25) / 6, 3.0, -4.0),
        **stats("critic/returns", valid_returns.mean(), 4.0, 0.0),
        **stats("critic/values", valid_values.mean(), 3.5, 0.1),
        "critic/vf_explained_var": pytest.approx(explained),
        **stats("response_length", 2.0, 3.0, 1.0),
        "response_length/clip_ratio": pytest.approx(1 / 3),
        **stats("prompt_length", 3.0, 4.0, 2.0),
        "prompt_length/clip_ratio": pytest.approx(1 / 3),
    }
    assert metrics == expected
    assert all(type(v) is float for v in metrics.values())


def test_data_metrics_without_values_has_no_critic_value_keys():
    metrics = batch_metrics()
    assert not any(k.startswith("critic/values") or k == "critic/vf_explained_var" for k in metrics)
    assert len(metrics) == 4 * 3 + 2 * 4


def test_prompt_clip_ratio_is_against_the_configured_limit_not_the_widest_prompt():
    """One of three prompts fills the 4-token window; with max_prompt_length 6 none reaches the limit."""
    metrics = compute_data_metrics(
        token_level_scores=SCORES, token_level_rewards=REWARDS, advantages=ADVANTAGES, returns=RETURNS,
        response_mask=RESPONSE_MASK, prompt_mask=PROMPT_MASK, max_response_length=5, max_prompt_length=6,
    )
    assert metrics["prompt_length/clip_ratio"] == 0.0 and metrics["response_length/clip_ratio"] == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_entropy_metric_is_aggregated_like_the_loss(mode):
    entropy = torch.tensor([[0.5, 1.0, 1.5], [2.0, 9.0, 9.0], [0.25, 0.75, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
    # By hand, over the three sequences with a response token (window H = 3).
    expected = {
        "token-mean": (3.0 + 2.0 + 1.0) / 6,
        "seq-mean-token-sum": (3.0 + 2.0 + 1.0) / 3,
        "seq-mean-token-mean": (1.0 + 2.0 + 0.5) / 3,
        "seq-mean-token-sum-norm": (3.0 / 3 + 2.0 / 3 + 1.0 / 3) / 3,
    }[mode]
    assert entropy_metric(entropy, mask, mode) == pytest.approx(expected, rel=1e-12)


def test_timing_metrics():
    metrics = compute_timing_metrics({"gen": 12.5, "update_actor": 3, "step": 20.0})
    assert metrics == {"timing_s/gen": 12.5, "timing_s/update_actor": 3.0, "timing_s/step": 20.0}
    assert TIMING_PHASES == (
        "gen", "onload", "reward", "reward_total", "old_log_prob", "ref", "values", "adv",
        "update_critic", "update_actor", "offload", "update_weights", "step",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown timing phase\(s\) \['generate'\]; known: gen, onload, reward"):
        compute_timing_metrics({"generate": 1.0})


def test_throughput_metrics():
    metrics = compute_throughput_metrics(total_tokens=1000, step_seconds=2.0, num_gpus=4)
    assert metrics == {"perf/throughput": 125.0, "perf/total_num_tokens": 1000.0, "perf/time_per_step": 2.0}
    with pytest.raises(ValueError, match="num_gpus"):
        compute_throughput_metrics(total_tokens=1, step_seconds=1.0, num_gpus=0)


def test_rollout_logprob_diff():
    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, float("-inf"), 0.0]])
    actor = torch.tensor([[-1.1, -2.0, -2.5], [-0.25, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # |diff| over the 4 response tokens: 0.1, 0, 0.5, 0.25; padding (even -inf) is ignored.
    assert rollout_logprob_diff(rollout, actor, mask) == pytest.approx(0.85 / 4)
