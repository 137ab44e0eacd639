"""Policy loss, value loss and loss aggregation against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.losses import agg_loss, policy_loss, value_loss
from megarl.registry import LOSS_AGG_MODES

# ---------------------------------------------------------------- agg_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0, 10.0], [4.0, 5.0, 6.0, 10.0]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2),
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", ((1 + 2) / 4 + 4 / 4) / 2),
    ],
)
def test_agg_loss_modes_by_hand(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_agg_loss_unknown_mode_names_valid_ones():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'; known: seq-mean-token-mean"):
        agg_loss(LOSS, MASK, "mean")
    assert set(LOSS_AGG_MODES) == {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"}


def _agg_reference(loss: list[list[float]], mask: list[list[int]], mode: str) -> float:
    """docs/step.md's aggregation written out per sequence: S = sequences with a valid token, H = the response window."""
    horizon = len(mask[0])
    kept = [[value for value, keep in zip(row, row_mask) if keep] for row, row_mask in zip(loss, mask)]
    non_empty = [row for row in kept if row]
    if mode == "token-mean":
        return sum(map(sum, non_empty)) / sum(map(len, non_empty))
    per_sequence = {
        "seq-mean-token-sum": [sum(row) for row in non_empty],
        "seq-mean-token-mean": [sum(row) / len(row) for row in non_empty],
        "seq-mean-token-sum-norm": [sum(row) / horizon for row in non_empty],
    }[mode]
    return sum(per_sequence) / len(per_sequence)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_loss_matches_the_formula_with_empty_sequences(mode):
    gen = torch.Generator().manual_seed(3)
    loss = torch.rand(7, 6, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([6, 0, 2, 0, 5, 1, 3])  # two responses without a token: not in S
    mask = (torch.arange(6)[None] < lengths[:, None]).int()
    expected = _agg_reference(loss.tolist(), mask.tolist(), mode)
    # float64 throughout: the sums of a few numbers in [0, 1) agree to rounding.
    assert agg_loss(loss, mask, mode).item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_sequence_modes_do_not_grow_with_the_mini_batch(mode):
    """Two copies of a mini-batch are the same sample twice: a mean over sequences does not change (Dr.GRPO's
    loss used to be a token sum over the whole mini-batch, so it doubled)."""
    gen = torch.Generator().manual_seed(4)
    loss = torch.rand(5, 6, generator=gen, dtype=torch.float64)
    mask = (torch.arange(6)[None] < torch.tensor([6, 0, 2, 4, 1])[:, None]).int()
    once = agg_loss(loss, mask, mode)
    twice = agg_loss(torch.cat([loss, loss]), torch.cat([mask, mask]), mode)
    assert twice.item() == pytest.approx(once.item(), rel=1e-12)


def test_agg_loss_ignores_nan_in_padding_and_empty_rows():
    dirty = LOSS.clone()
    dirty[0, 3] = float("nan")
    assert agg_loss(dirty, MASK, "token-mean").item() == pytest.approx(7 / 3)
    empty_row = torch.cat([MASK, torch.zeros(1, 4, dtype=MASK.dtype)])
    loss = torch.cat([LOSS, torch.full((1, 4), 100.0)])
    # A sequence without a response token is no sample: the seq-mean modes leave it out.
    assert agg_loss(loss, empty_row, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_with_global_normalisers_sum_to_the_full_batch(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.rand(6, 5, generator=gen)
    mask = (torch.arange(5)[None] < torch.tensor([5, 1, 3, 2, 4, 5])[:, None]).float()
    full = agg_loss(loss, mask, mode)
    # Uneven micro-batches (2 + 4 rows): each uses the totals of the whole batch.
    parts = [
        agg_loss(loss[rows], mask[rows], mode, global_tokens=mask.sum(), global_seqs=6)
        for rows in (slice(0, 2), slice(2, 6))
    ]
    assert sum(parts).item() == pytest.approx(full.item())


# ---------------------------------------------------------------- policy_loss: ppo_clip

PPO = dict(loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)


def test_policy_loss_clip_regions_by_hand():
    # Tokens: (ratio, A) = (1.5, +1) clipped above, (1.5, -1) unclipped, (5, -1) dual-clipped,
    # (0.5, +1) unclipped, (0.5, -1) clipped below, (1.1, +2) inside the trust region.
    ratios = torch.tensor([[1.5, 1.5, 5.0, 0.5, 0.5, 1.1]])
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0, -1.0, 2.0]])
    old = torch.zeros(1, 6)
    log_prob = ratios.log().requires_grad_(True)
    mask = torch.ones(1, 6)
    loss, metrics = policy_loss("ppo_clip", old, log_prob, advantages, mask, **PPO)
    per_token = [-1.2, 1.5, 3.0, -0.5, 0.8, -2.2]
    assert loss.item() == pytest.approx(sum(per_token) / 6)
    # pg_clipfrac counts tokens where the clipped term is the larger: (1.5, +1) and (0.5, -1).
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(2 / 6)
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 6)
    assert metrics["actor/ppo_kl"].item() == pytest.approx(-ratios.log().mean().item())
    assert all(v.ndim == 0 and not v.requires_grad for v in metrics.values())

    loss.backward()
    # d(-A * r)/d log r = -A * r on unclipped tokens, 0 where a clip is active.
    expected_grad = torch.tensor([[0.0, 1.5, 0.0, -0.5, 0.0, -2.2]]) / 6
    torch.testing.assert_close(log_prob.grad, expected_grad)


def test_policy_loss_gradient_direction():
    old = torch.zeros(2, 3)
    log_prob = torch.zeros(2, 3, requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, _ = policy_loss("ppo_clip", old, log_prob, advantages, torch.ones(2, 3), **PPO)
    loss.backward()
    # A gradient step (minus the gradient) raises log-probs of good actions and lowers bad ones.
    assert (log_prob.grad[0] < 0).all() and (log_prob.grad[1] > 0).all()


def test_policy_loss_asymmetric_clip_masking_and_far_off_policy():
    old = torch.zeros(1, 4)
    log_prob = torch.tensor([[math.log(1.25), math.log(1.25), 50.0, 0.0]])
    advantages = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = policy_loss("ppo_clip", old, log_prob, advantages, mask, **{**PPO, "clip_ratio_high": 0.28})
    # ratio 1.25 is inside [0.8, 1.28]; exp(50) is clamped to exp(20) then clipped to 1.28.
    assert loss.item() == pytest.approx((-1.25 - 1.25 - 1.28) / 3)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(1 / 3)
    assert metrics["actor/ppo_kl"].item() == pytest.approx(-(2 * math.log(1.25) + 20.0) / 3)
    assert math.isfinite(loss.item())


def test_policy_loss_rejects_clip_ratio_c_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1, got 1.0"):
        policy_loss("ppo_clip", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                    **{**PPO, "clip_ratio_c": 1.0})


# ---------------------------------------------------------------- value_loss


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0, 7.0]])
    vpreds = torch.tensor([[2.0, 1.2, 3.0, 3.0, 0.0]], requires_grad=True)
    returns = torch.tensor([[3.0, 1.0, 4.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, clipfrac = value_loss(vpreds, returns, values, mask, cliprange_value=0.5, loss_agg_mode="token-mean")
    # vclipped = [1.5, 1.2, 1.5, 1.5]; max(unclipped, clipped) = [2.25, 0.04, 6.25, 1.0].
    assert loss.item() == pytest.approx(0.5 * (2.25 + 0.04 + 6.25 + 1.0) / 4)
    assert clipfrac.item() == pytest.approx(2 / 4)
    assert clipfrac.ndim == 0 and not clipfrac.requires_grad
    loss.backward()
    # Where the clipped term wins the gradient w.r.t. vpreds is 0 (vclipped is constant there).
    expected = torch.tensor([[0.0, 0.5 * 2 * 0.2 / 4, 0.0, 0.5 * 2 * 1.0 / 4, 0.0]])
    torch.testing.assert_close(vpreds.grad, expected)


def test_value_loss_seq_mean_token_sum():
    values = torch.zeros(2, 2)
    vpreds = torch.tensor([[1.0, 2.0], [3.0, 0.0]])
    returns = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = value_loss(vpreds, returns, values, mask, cliprange_value=100.0, loss_agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(0.5 * ((1 + 4) + 9) / 2)
