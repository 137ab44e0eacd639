"""`rollout.async` in a recipe, and the rollout correction's formulas against a direct, element-by-element
computation (`megarl.algorithms.rollout_correction`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from megarl.algorithms.losses import POLICY_LOSSES, policy_loss
from megarl.algorithms.rollout_correction import behaviour_log_probs, corrected_advantages, importance_weights
from megarl.config import dump_recipe, load_recipe
from megarl.errors import InputError

REPO = Path(__file__).resolve().parents[1]
DISAGGREGATED = [
    "placement.colocate=false", "placement.gpus_per_node=2",
    "placement.pools={train: {gpus_per_node: 1}, gen: {gpus_per_node: 1}}",
    "placement.roles={actor: train, rollout: gen}", "weight_sync.transport=disk",
]


def _problems(overrides: list[str]) -> list[str]:
    with pytest.raises(InputError) as caught:
        load_recipe(REPO / "recipes/quickstart-grpo-cpu.yaml", overrides)
    return caught.value.problems


def test_async_needs_disaggregated_placement_and_names_both_keys() -> None:
    (line,) = _problems(["rollout.async.max_staleness=1"])
    assert line.startswith("--set: rollout.async: needs disaggregated placement: set placement.colocate: false")
    assert line.endswith("(got placement.colocate: true)")


def test_async_recipe_round_trips_under_its_yaml_name(tmp_path: Path) -> None:
    recipe = load_recipe(REPO / "recipes/quickstart-grpo-cpu.yaml",
                         [*DISAGGREGATED, "rollout.async.max_staleness=2", "rollout.async.correction.mode=mask"])
    settings = recipe.rollout.async_
    assert (settings.max_staleness, settings.in_flight_updates, settings.correction.mode) == (2, False, "mask")
    dumped = yaml.safe_load(dump_recipe(recipe))
    assert dumped["rollout"]["async"]["max_staleness"] == 2 and "async_" not in dumped["rollout"]
    (tmp_path / "r.yaml").write_text(dump_recipe(recipe))
    assert load_recipe(tmp_path / "r.yaml").rollout.async_ == settings
    assert load_recipe(REPO / "recipes/quickstart-grpo-cpu.yaml").rollout.async_ is None


def test_partial_rollouts_only_without_in_flight_updates() -> None:
    (line,) = _problems([*DISAGGREGATED, "rollout.async.in_flight_updates=true", "rollout.async.partial_rollouts=true"])
    assert line.startswith("--set: rollout.async.partial_rollouts: only used without in_flight_updates")


# ---------------------------------------------------------------- the correction's formulas


def _direct(prox, behav, mask, *, mode, level, cap):
    """The module docstring's formulas, one element at a time in Python floats."""
    rows, cols = len(prox), len(prox[0])
    weights = [[1.0] * cols for _ in range(rows)]
    kept = [[0.0] * cols for _ in range(rows)]
    for i in range(rows):
        seq = sum(prox[i][t] - behav[i][t] for t in range(cols) if mask[i][t])
        for t in range(cols):
            if not mask[i][t]:
                continue
            log_rho = seq if level == "sequence" else prox[i][t] - behav[i][t]
            rho = math.exp(max(-20.0, min(20.0, log_rho)))
            if mode == "truncate":
                weights[i][t], kept[i][t] = min(rho, cap), 1.0
            elif rho <= cap:
                weights[i][t], kept[i][t] = rho, 1.0
            else:
                weights[i][t] = 0.0
    return weights, kept


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_match_a_direct_computation(mode: str, level: str) -> None:
    generator = torch.Generator().manual_seed(3)
    prox = -torch.rand(4, 6, generator=generator, dtype=torch.float64) * 2
    behav = prox + torch.randn(4, 6, generator=generator, dtype=torch.float64) * 0.6
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]],
                        dtype=torch.float64)
    cap = 1.5
    weights, kept, metrics = importance_weights(prox, behav, mask, mode=mode, level=level, cap=cap)
    want_w, want_k = _direct(prox.tolist(), behav.tolist(), mask.tolist(), mode=mode, level=level, cap=cap)
    # float64 exp of the same sums: agreement to the last few ulps.
    torch.testing.assert_close(weights, torch.tensor(want_w, dtype=torch.float64), rtol=1e-12, atol=0)
    assert kept.tolist() == want_k
    flat_w = [w for row_w, row_k in zip(want_w, want_k) for w, k in zip(row_w, row_k) if k]
    over = sum(1 for row_w, row_k, row_m in zip(want_w, want_k, mask.tolist())
               for w, k, m in zip(row_w, row_k, row_m) if m and (not k or w == cap))
    assert metrics["rollout_corr/mean"] == pytest.approx(sum(flat_w) / len(flat_w), rel=1e-12)
    assert metrics["rollout_corr/max"] == pytest.approx(max(flat_w), rel=1e-12)
    share = over / mask.sum().item()
    assert 0 < share < 1  # the data exercises the cap
    assert metrics["rollout_corr/clipped" if mode == "truncate" else "rollout_corr/masked"] == pytest.approx(share)
    assert metrics["rollout_corr/masked" if mode == "truncate" else "rollout_corr/clipped"] == 0.0


def test_tokens_of_the_proximal_version_weigh_exactly_one() -> None:
    prox = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])
    engine = prox + 1e-4  # the engine's kernels differ a little from the trainer's
    versions = torch.tensor([[3, 3, 3], [2, 2, 3]])
    behav = behaviour_log_probs(engine, prox, versions, proximal_version=3)
    assert torch.equal(behav[0], prox[0]) and torch.equal(behav[1, :2], engine[1, :2]) and behav[1, 2] == prox[1, 2]
    weights, kept, metrics = importance_weights(prox, behav, torch.ones(2, 3), mode="truncate", level="token", cap=2)
    assert torch.equal(weights[0], torch.ones(3)) and weights[1, 2] == 1.0 and torch.equal(kept, torch.ones(2, 3))
    assert (weights[1, :2] != 1.0).all()


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_weights_scale_every_policy_loss_per_token(name: str) -> None:
    """Through the advantages: loss(A * w) == agg(w * l(A)) for every registered loss; w == 1 is bit-identical."""
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=generator, dtype=torch.float64)
    new = old + torch.randn(3, 5, generator=generator, dtype=torch.float64) * 0.3
    adv = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float64)
    options = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    base, _ = policy_loss(name, old, new, adv, mask, loss_agg_mode="token-mean", **options)
    ones, _ = policy_loss(name, old, new, corrected_advantages(adv, torch.ones_like(adv)), mask,
                          loss_agg_mode="token-mean", **options)
    assert torch.equal(base, ones)
    weights = torch.rand(3, 5, generator=generator, dtype=torch.float64) * 2
    entry = POLICY_LOSSES.get(name)
    per_token, _ = entry.target(old, new, adv, mask, **{k: options[k] for k in entry.options})
    want = (per_token * weights * mask).sum() / mask.sum()
    got, _ = policy_loss(name, old, new, corrected_advantages(adv, weights), mask, loss_agg_mode="token-mean",
                         **options)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
