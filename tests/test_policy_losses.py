"""The policy losses (ppo_clip, gspo, cispo) against a plain per-token reference written from verl 0.9.1's definitions.

The reference follows `verl/trainer/ppo/core_algos.py` (`compute_policy_loss_vanilla`,
`compute_policy_loss_gspo`, `compute_policy_loss_cispo`, `agg_loss`) one token at a
time in float64: the loss of each token, its derivative with respect to that
token's own log-prob (the only path a gradient takes: everything else is detached
or constant), and the weight `agg_loss` gives the token in each mode. megarl's
vectorised float32 losses must give the same loss, gradient and metrics on random
inputs whose masks include empty rows, for every `loss_agg_mode`. Tolerance: float32
rounding of sums over at most 60 tokens of magnitude <= ~10 (~1e-6 relative); 1e-5
is far below any difference a changed formula makes (the clip and the
aggregation weights move values by 1e-2 and more).
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms.losses import policy_loss, policy_loss_fn
from megarl.config import load_recipe
from megarl.errors import InputError
from megarl.registry import LOSS_AGG_MODES, POLICY_LOSSES

ROWS, WIDTH = 8, 9
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    """Random log-probs, per-token advantages and masks: rows 1 and 5 empty, the others of random lengths (some
    with holes). Each row is shifted off-policy by its own offset so some sequences (and tokens) leave the clip
    range and some stay; row 3 is so far off that GSPO's clamp at 10 and the log-ratio clamp at 20 act."""
    gen = torch.Generator().manual_seed(seed)
    old = -0.2 - 2.0 * torch.rand(ROWS, WIDTH, generator=gen)
    offsets = torch.tensor([0.05, -0.3, 0.4, 25.0, -0.02, 0.1, -0.6, 0.25]).unsqueeze(-1)
    log_prob = old + offsets + 0.3 * torch.randn(ROWS, WIDTH, generator=gen)
    mask = (torch.rand(ROWS, WIDTH, generator=gen) < 0.8).float()
    mask[1] = 0.0
    mask[5] = 0.0
    mask[0] = 1.0
    return {"old_log_prob": old, "log_prob": log_prob, "advantages": torch.randn(ROWS, WIDTH, generator=gen),
            "response_mask": mask}


def _agg_weight(mask: torch.Tensor, mode: str, i: int, t: int) -> float:
    """The weight of token (i, t) in verl's `agg_loss`: loss = sum_it weight_it * loss_it."""
    if mask[i, t] == 0:
        return 0.0
    tokens = float(mask.sum())
    lengths = mask.sum(-1)
    sequences = float((lengths > 0).sum())
    return {"token-mean": 1.0 / tokens,
            "seq-mean-token-sum": 1.0 / sequences,
            "seq-mean-token-mean": 1.0 / (sequences * float(lengths[i])),
            "seq-mean-token-sum-norm": 1.0 / (sequences * mask.shape[1])}[mode]


def _ppo_clip_token(lp, old, adv, *, seq_log_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c):
    """compute_policy_loss_vanilla: (loss, d loss / d lp, clipped?, dual-clipped?, ppo_kl term)."""
    log_ratio = min(max(lp - old, -20.0), 20.0)
    ratio = math.exp(log_ratio)
    d_ratio = ratio if -20.0 < lp - old < 20.0 else 0.0
    low, high = 1 - clip_ratio_low, 1 + clip_ratio_high
    unclipped, clipped = -adv * ratio, -adv * min(max(ratio, low), high)
    loss, grad = (unclipped, -adv * d_ratio) if unclipped >= clipped else (clipped, 0.0)
    dual = adv < 0 and loss > -adv * clip_ratio_c
    if dual:
        loss, grad = -adv * clip_ratio_c, 0.0
    return loss, grad, clipped > unclipped, dual, -log_ratio


def _gspo_token(lp, old, adv, *, seq_log_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c):
    """compute_policy_loss_gspo: every token carries the sequence ratio s = exp(min(mean log-ratio, 10)); its
    derivative with respect to the token's own log-prob is s (0 where the clamp at 10 acts)."""
    ratio = math.exp(min(seq_log_ratio, 10.0))
    d_ratio = ratio if seq_log_ratio < 10.0 else 0.0
    low, high = 1 - clip_ratio_low, 1 + clip_ratio_high
    unclipped, clipped = -adv * ratio, -adv * min(max(ratio, low), high)
    loss, grad = (unclipped, -adv * d_ratio) if unclipped >= clipped else (clipped, 0.0)
    return loss, grad, clipped > unclipped, False, -(lp - old)


def _cispo_token(lp, old, adv, *, seq_log_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c):
    """compute_policy_loss_cispo: loss = -sg(clip(ratio)) * A * lp, so d loss / d lp = -clip(ratio) * A."""
    log_ratio = min(max(lp - old, -20.0), 20.0)
    ratio = math.exp(log_ratio)
    weight = min(max(ratio, 1 - clip_ratio_low), 1 + clip_ratio_high)
    return -weight * adv * lp, -weight * adv, ratio != weight, False, -log_ratio


REFERENCES = {"ppo_clip": _ppo_clip_token, "gspo": _gspo_token, "cispo": _cispo_token}


def _reference(name: str, mode: str, inputs: dict[str, torch.Tensor], **clip) -> tuple[float, torch.Tensor, dict]:
    token = REFERENCES[name]
    old, lp = inputs["old_log_prob"].double(), inputs["log_prob"].double()
    adv, mask = inputs["advantages"].double(), inputs["response_mask"]
    loss, grad = 0.0, torch.zeros(ROWS, WIDTH, dtype=torch.float64)
    clipped, dual, kl, tokens = 0, 0, 0.0, 0
    for i in range(ROWS):
        valid = [t for t in range(WIDTH) if mask[i, t]]
        seq_log_ratio = sum(float(lp[i, t] - old[i, t]) for t in valid) / max(len(valid), 1)
        for t in valid:
            value, d_value, is_clipped, is_dual, kl_term = token(float(lp[i, t]), float(old[i, t]),
                                                                  float(adv[i, t]), seq_log_ratio=seq_log_ratio,
                                                                  **clip)
            weight = _agg_weight(mask, mode, i, t)
            loss += weight * value
            grad[i, t] = weight * d_value
            clipped, dual, kl, tokens = clipped + is_clipped, dual + is_dual, kl + kl_term, tokens + 1
    metrics = {"actor/pg_clipfrac": clipped / tokens, "actor/pg_clipfrac_lower": dual / tokens,
               "actor/ppo_kl": kl / tokens}
    return loss, grad, metrics


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("seed", [0, 1])
def test_each_loss_equals_verls_definition(name, mode, seed):
    assert set(LOSS_AGG_MODES.names()) == {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                           "seq-mean-token-sum-norm"}  # every mode is covered
    inputs = _inputs(seed)
    expected_loss, expected_grad, expected_metrics = _reference(name, mode, inputs, **CLIP)
    log_prob = inputs["log_prob"].clone().requires_grad_()
    loss, metrics = policy_loss(name, inputs["old_log_prob"], log_prob, inputs["advantages"], inputs["response_mask"],
                                loss_agg_mode=mode, **CLIP)
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(log_prob.grad.double(), expected_grad, rtol=1e-5, atol=1e-7)
    assert {key: value.item() for key, value in metrics.items()} == pytest.approx(expected_metrics, rel=1e-5)
    assert all(value.ndim == 0 and not value.requires_grad for value in metrics.values())
    # The inputs exercise both sides of every clip (a test whose tokens all sat on one side could not fail).
    assert 0 < expected_metrics["actor/pg_clipfrac"] < 1
    if name == "ppo_clip":
        assert expected_metrics["actor/pg_clipfrac_lower"] > 0


def test_gspo_clips_whole_sequences_and_cispo_keeps_every_gradient():
    inputs = _inputs(0)
    mask = inputs["response_mask"].bool()
    log_prob = inputs["log_prob"].clone().requires_grad_()
    args = (inputs["old_log_prob"], log_prob, inputs["advantages"], inputs["response_mask"])
    gspo_loss, _ = policy_loss("gspo", *args, loss_agg_mode="token-mean", **CLIP)
    (gspo_grad,) = torch.autograd.grad(gspo_loss, log_prob)
    cispo_loss, _ = policy_loss("cispo", *args, loss_agg_mode="token-mean", **CLIP)
    (cispo_grad,) = torch.autograd.grad(cispo_loss, log_prob)
    # Row 3 is 25 nats off-policy: PPO and GSPO drop its gradient (clipped or clamped), CISPO keeps it.
    assert (cispo_grad[3][mask[3]] != 0).all() and (gspo_grad[3] == 0).all()
    # GSPO: the tokens of a sequence whose ratio is inside the clip range all have gradient -A_t * s / N.
    seq_ratio = torch.exp((inputs["log_prob"] - inputs["old_log_prob"])[0].mean())
    assert 0.8 < seq_ratio < 1.28
    torch.testing.assert_close(gspo_grad[0], -inputs["advantages"][0] * seq_ratio / mask.sum(), rtol=1e-5, atol=0)


def test_a_new_loss_is_one_registered_function_and_recipes_name_the_known_ones(tmp_path):
    @policy_loss_fn("test_reinforce")
    def reinforce(old_log_prob, log_prob, advantages, response_mask):
        return -advantages * log_prob, {}

    try:
        log_prob = torch.tensor([[-1.0, -2.0]])
        loss, _ = policy_loss("test_reinforce", log_prob, log_prob, torch.tensor([[1.0, 3.0]]),
                              torch.ones(1, 2), loss_agg_mode="seq-mean-token-sum", **CLIP)
        assert loss.item() == pytest.approx(7.0)
        recipe = load_recipe("recipes/quickstart-grpo-cpu.yaml", ["actor.policy_loss=test_reinforce"])
        assert recipe.actor.policy_loss == "test_reinforce"
    finally:
        POLICY_LOSSES.remove("test_reinforce")
    with pytest.raises(TypeError, match=r"options \['beta'\] are not in"):
        policy_loss_fn("test_bad")(lambda old_log_prob, log_prob, advantages, response_mask, *, beta: None)
    assert load_recipe("recipes/quickstart-grpo-cpu.yaml").actor.policy_loss == "ppo_clip"
    with pytest.raises(InputError) as caught:
        load_recipe("recipes/quickstart-grpo-cpu.yaml", ["actor.policy_loss=ppo"])
    (line,) = caught.value.problems
    assert "actor.policy_loss: unknown policy loss 'ppo'; known: cispo, gspo, ppo_clip (got 'ppo')" in line
