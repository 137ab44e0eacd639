"""KL estimators, KL-in-reward, the KL controllers and token entropy against hand numbers."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    entropy_from_logits,
    kl_penalty,
)

LOGP = torch.tensor([-1.0, -2.0, -0.5])
REF = torch.tensor([-2.0, -1.0, -0.5])


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("kl", [1.0, -1.0, 0.0]),
        ("abs", [1.0, 1.0, 0.0]),
        ("mse", [0.5, 0.5, 0.0]),
        ("low_var_kl", [math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1, 0.0]),
    ],
)
def test_kl_kinds_by_hand(kind, expected):
    assert kl_penalty(LOGP, REF, kind).tolist() == pytest.approx(expected)


def test_kl_aliases_and_unknown_kind():
    for alias, name in (("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")):
        torch.testing.assert_close(kl_penalty(LOGP, REF, alias), kl_penalty(LOGP, REF, name))
    with pytest.raises(ValueError, match="unknown KL penalty kind 'full'; known: abs, k1"):
        kl_penalty(LOGP, REF, "full")


@pytest.mark.parametrize("kind", ["k3+", "low_var_kl+"])
def test_k3_plus_has_k3s_value_and_k2s_gradient(kind):
    # verl's straight-through variant (kl_penalty with a '+' suffix), written out from its definition: the
    # forward value is k3 = e^d - d - 1 with d = ref - logp clamped to [-20, 20] and k3 to [-10, 10] (one entry
    # of these inputs reaches the clamp), the gradient w.r.t. logp is k2's, logp - ref, clamped or not.
    torch.manual_seed(0)
    log_prob = (torch.randn(4, 6) - 1.0).requires_grad_()
    ref = torch.randn(4, 6) - 1.0
    out = kl_penalty(log_prob, ref, kind)
    diff = (ref - log_prob).detach().clamp(-20.0, 20.0)
    expected = (torch.exp(diff) - diff - 1.0).clamp(-10.0, 10.0)
    assert (expected == 10.0).any() and (expected < 10.0).any()
    torch.testing.assert_close(out.detach(), expected, atol=1e-6, rtol=1e-6)
    weights = torch.randn(4, 6)  # an arbitrary upstream gradient
    (out * weights).sum().backward()
    torch.testing.assert_close(log_prob.grad, weights * (log_prob.detach() - ref), atol=1e-6, rtol=1e-6)
    # Under no_grad (KL in the reward) it is k3 itself.
    with torch.no_grad():
        torch.testing.assert_close(kl_penalty(log_prob, ref, kind), kl_penalty(log_prob, ref, "k3"))


def test_low_var_kl_clamping():
    log_prob = torch.tensor([0.0, 30.0, 0.0, -3.0])
    ref = torch.tensor([30.0, 0.0, -1e9, 0.0])
    out = kl_penalty(log_prob, ref, "low_var_kl")
    # ref - logp = 30 -> clamped to 20 -> e^20 - 21 -> clamped to 10; -30 and -1e9 -> -20 -> 19 -> 10;
    # ref - logp = 3 -> e^3 - 4 = 16.09 -> 10.
    assert out.tolist() == pytest.approx([10.0, 10.0, 10.0, 10.0])
    small = kl_penalty(torch.tensor([-1.0]), torch.tensor([-1.5]), "low_var_kl")
    assert small.item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    assert torch.isfinite(out).all()


def test_apply_kl_in_reward_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    ref = torch.zeros(2, 3)
    log_prob = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, metrics = apply_kl_in_reward(scores, log_prob, ref, mask, kl_coef=0.1, kind="kl")
    expected = torch.tensor([[-0.01, -0.02, 0.97], [-0.04, 1.95, 0.0]])  # no penalty on padding
    torch.testing.assert_close(rewards, expected)
    # Mean over samples of the per-sample mean KL: (0.2 + 0.45) / 2.
    assert metrics == {
        "actor/reward_kl_penalty": pytest.approx(0.325),
        "actor/reward_kl_penalty_coeff": pytest.approx(0.1),
    }
    assert all(isinstance(v, float) for v in metrics.values())


def test_adaptive_kl_controller_by_hand():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    controller.update(current_kl=9.0, n_steps=256)  # error 0.5 clipped to 0.2
    assert controller.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    controller.update(current_kl=6.6, n_steps=1000)  # error 0.1, inside the clip
    assert controller.value == pytest.approx(0.1 * 1.00512 * 1.01)
    controller.update(current_kl=1.0, n_steps=5000)  # error -5/6 clipped to -0.2
    assert controller.value == pytest.approx(0.1 * 1.00512 * 1.01 * 0.9)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=0.0, horizon=10)


def test_fixed_kl_controller_never_moves():
    controller = FixedKLController(kl_coef=0.05)
    controller.update(current_kl=100.0, n_steps=10**6)
    assert controller.value == 0.05


def test_entropy_from_logits():
    uniform = torch.zeros(2, 3, 7)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(7)))
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 11, generator=gen, dtype=torch.float64) * torch.tensor([0.1, 1.0, 10.0, 1000.0])[:, None, None]
    log_p = torch.log_softmax(logits, dim=-1)
    reference = -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits), reference)
    # Large float32 logits: no overflow, entropy of a near one-hot distribution is ~0.
    peaked = torch.tensor([[1e4, 0.0, -1e4]])
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)
