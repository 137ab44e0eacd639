"""Advantage estimators against hand numbers and plain per-sample Python reference loops."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest
import torch

from megarl.algorithms import _scan
from megarl.algorithms.advantages import (
    _gae_torch,
    _returns_to_go_torch,
    estimate_advantages,
    estimator,
    gae,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)
from megarl.algorithms.masked import masked_mean, masked_var, masked_whiten
from megarl.registry import ADVANTAGE_ESTIMATORS

# ---------------------------------------------------------------- references


def whiten_reference(rows: list[list[float]], mask: list[list[int]], eps: float) -> list[list[float]]:
    """Whiten over valid tokens (unbiased variance), zero elsewhere; plain Python."""
    valid = [x for row, m in zip(rows, mask) for x, keep in zip(row, m) if keep]
    mean = sum(valid) / len(valid)
    var = sum((x - mean) ** 2 for x in valid) / (len(valid) - 1)
    scale = 1.0 / math.sqrt(var + eps)
    return [[(x - mean) * scale if keep else 0.0 for x, keep in zip(row, m)] for row, m in zip(rows, mask)]


def gae_reference(rewards, values, mask, gamma, lam):
    """Per-sample, per-token GAE; masked positions carry next value and running advantage."""
    raw = []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        next_value, running = 0.0, 0.0
        row = [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            if m_row[t]:
                delta = r_row[t] + gamma * next_value - v_row[t]
                running = delta + gamma * lam * running
                next_value = v_row[t]
            row[t] = running
        raw.append(row)
    returns = [[a + v for a, v in zip(a_row, v_row)] for a_row, v_row in zip(raw, values)]
    return whiten_reference(raw, mask, 1e-8), returns


def group_reference(scores: list[float], index: list, epsilon: float, norm_by_std: bool) -> list[float]:
    """GRPO with a dict of lists, one sample at a time."""
    groups = defaultdict(list)
    for score, key in zip(scores, index):
        groups[key].append(score)
    out = []
    for score, key in zip(scores, index):
        members = groups[key]
        mean, std = (0.0, 1.0) if len(members) == 1 else (statistics.mean(members), statistics.stdev(members))
        out.append((score - mean) / (std + epsilon) if norm_by_std else score - mean)
    return out


def random_case(batch: int, length: int, seed: int, hole: bool):
    """Left-aligned responses with trailing padding, optionally a hole in the middle of each."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length  # one row fills the whole window
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    if hole:
        for i, n in enumerate(lengths.tolist()):
            if n >= 4:
                mask[i, n // 2 - 1 : n // 2 + 1] = 0
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return rewards, values, mask


# ---------------------------------------------------------------- GAE


def test_gae_hand_computed_full_and_with_hole():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 5.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 0.1], [0.5, 99.0, 0.1]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # Row 0: A = [0.5, 0.8, 0.9]; row 1 skips t=1 (its reward 5 and value 99 are ignored): A = [0.5, -, 0.9].
    # With gamma = lam = 1, returns are the reward-to-go: 1 everywhere it is defined.
    raw = [0.5, 0.8, 0.9, 0.5, 0.9]
    assert returns[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert returns[1, 0].item() == pytest.approx(1.0) and returns[1, 2].item() == pytest.approx(1.0)
    mean = sum(raw) / 5
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / 4 + 1e-8)
    assert advantages[0].tolist() == pytest.approx([(x - mean) / std for x in (0.5, 0.8, 0.9)])
    assert advantages[1].tolist() == pytest.approx([(0.5 - mean) / std, 0.0, (0.9 - mean) / std])


@pytest.mark.parametrize("hole", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0)])
def test_gae_matches_per_sample_loop(hole, gamma, lam):
    rewards, values, mask = random_case(batch=7, length=11, seed=3, hole=hole)
    advantages, returns = gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    valid = mask.bool()
    torch.testing.assert_close(advantages, torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(returns[valid], torch.tensor(ref_ret, dtype=torch.float64)[valid], rtol=1e-10, atol=1e-10)


def test_gae_float32_whitened_statistics_and_mask_dtypes():
    rewards, values, mask = random_case(batch=16, length=32, seed=5, hole=True)
    rewards, values = rewards.float(), values.float()
    outputs = [gae(rewards, values, m, gamma=0.99, lam=0.95) for m in (mask, mask.bool(), mask.float())]
    for advantages, returns in outputs[1:]:
        torch.testing.assert_close(advantages, outputs[0][0])
        torch.testing.assert_close(returns, outputs[0][1])
    advantages = outputs[0][0]
    assert advantages.dtype == torch.float32
    valid = advantages[mask.bool()].double()
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.std().item() == pytest.approx(1.0, abs=1e-5)
    assert (advantages[~mask.bool()] == 0).all()


def test_time_recursions_ignore_nan_in_padding():
    rewards, values, mask = random_case(batch=5, length=9, seed=8, hole=True)
    valid = mask.bool()
    dirty_values = values.masked_fill(~valid, float("nan"))
    dirty_rewards = rewards.masked_fill(~valid, float("nan"))
    clean = gae(rewards, values, mask, gamma=0.9, lam=0.9)
    dirty = gae(dirty_rewards, dirty_values, mask, gamma=0.9, lam=0.9)
    torch.testing.assert_close(dirty[0], clean[0])
    torch.testing.assert_close(dirty[1][valid], clean[1][valid])
    clean = reinforce_plus_plus(rewards, mask, gamma=0.9)
    dirty = reinforce_plus_plus(dirty_rewards, mask, gamma=0.9)
    torch.testing.assert_close(dirty, clean)


def test_gae_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0)


# ---------------------------------------------------------------- compiled scan vs pure torch


def returns_to_go_reference(rewards, mask, gamma):
    """Per-sample, per-token G_t = r_t + gamma * G_next; masked positions carry G."""
    out = []
    for r_row, m_row in zip(rewards, mask):
        running, row = 0.0, [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            if m_row[t]:
                running = r_row[t] + gamma * running
            row[t] = running
        out.append(row)
    return out


def holey_case(batch: int, length: int, seed: int, offset: float = 0.0):
    """Random masks: trailing padding, random holes, one empty row and one single-token row; float64."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None] < lengths[:, None]) & (torch.rand(batch, length, generator=gen) > 0.3)
    mask[0] = False
    mask[1] = False
    mask[1, length // 2] = True
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64) + offset
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return rewards, values, mask


def numba_missing(monkeypatch) -> None:
    monkeypatch.setattr(_scan, "_kernels", lambda: None)


@pytest.mark.parametrize("offset", [0.0, 1000.0])  # 1000: |mean| >> std, where a naive sum of squares cancels
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.0)])
def test_compiled_gae_matches_per_sample_loop(offset, gamma, lam):
    # float64 in and out, so the only difference to the Python loop is summation order (~1e-13 here).
    rewards, values, mask = holey_case(batch=9, length=23, seed=4, offset=offset)
    assert _scan.available(rewards, values, mask), "numba is a dependency of megarl: the compiled scan must load"
    advantages, returns = _scan.scan_whitened(rewards, values, mask, gamma=gamma, lam=lam, eps=1e-8)
    ref_adv, ref_ret = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(advantages, torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(returns[mask], torch.tensor(ref_ret, dtype=torch.float64)[mask], rtol=1e-10, atol=1e-10)


def test_compiled_returns_to_go_matches_per_sample_loop():
    rewards, _, mask = holey_case(batch=9, length=23, seed=6)
    advantages, returns = _scan.scan_whitened(rewards, None, mask, gamma=0.8, lam=1.0, eps=1e-8)
    expected = returns_to_go_reference(rewards.tolist(), mask.tolist(), 0.8)
    torch.testing.assert_close(returns, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    whitened = whiten_reference(expected, mask.tolist(), 1e-8)
    torch.testing.assert_close(advantages, torch.tensor(whitened, dtype=torch.float64), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_public_estimators_equal_with_and_without_numba(monkeypatch, dtype):
    # The compiled scan accumulates in float64; the torch fallback in the input dtype. In float32 the
    # fallback's rounding grows with the ~40-step recursion to a few 1e-6 of values of order 1-10.
    tolerance = 1e-12 if dtype == torch.float64 else 2e-5
    rewards, values, mask = holey_case(batch=12, length=40, seed=7)
    rewards, values = rewards.to(dtype), values.to(dtype)
    compiled = [gae(rewards, values, mask, gamma=0.99, lam=0.95), reinforce_plus_plus(rewards, mask, gamma=0.97)]
    numba_missing(monkeypatch)
    assert not _scan.available(rewards)
    fallback = [gae(rewards, values, mask, gamma=0.99, lam=0.95), reinforce_plus_plus(rewards, mask, gamma=0.97)]
    for (adv_c, ret_c), (adv_f, ret_f) in zip(compiled, fallback):
        assert adv_c.dtype == adv_f.dtype == dtype
        torch.testing.assert_close(adv_c, adv_f, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(ret_c, ret_f, rtol=tolerance, atol=tolerance)  # masked positions too
    # The private torch scans are the fallback's whole recursion: check them against the loops too.
    raw = _gae_torch(rewards.double(), values.double(), mask, gamma=0.99, lam=0.95)
    _, ref_ret = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), 0.99, 0.95)
    ref_ret = torch.tensor(ref_ret, dtype=torch.float64)
    torch.testing.assert_close((raw + values.double())[mask], ref_ret[mask], rtol=1e-10, atol=1e-10)
    ref_g = returns_to_go_reference(rewards.tolist(), mask.tolist(), 0.97)
    ref_g = torch.tensor(ref_g, dtype=torch.float64)
    torch.testing.assert_close(_returns_to_go_torch(rewards.double(), mask, 0.97), ref_g)


def test_compiled_scan_same_bits_on_any_thread_count(monkeypatch):
    rewards, values, mask = holey_case(batch=11, length=17, seed=9)
    monkeypatch.setattr(_scan, "_PARALLEL_MIN_ELEMENTS", 0)  # split even this small batch over threads
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = gae(rewards.float(), values.float(), mask, gamma=1.0, lam=0.95)
        torch.set_num_threads(3)  # rows split 4/4/3 over three threads
        split = gae(rewards.float(), values.float(), mask, gamma=1.0, lam=0.95)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(single[0], split[0]) and torch.equal(single[1], split[1])


@pytest.mark.parametrize("compiled", [True, False])
def test_whitened_scans_need_two_response_tokens(monkeypatch, compiled):
    if not compiled:
        numba_missing(monkeypatch)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[1, 2] = True
    with pytest.raises(ValueError, match="masked_whiten needs at least 2 valid positions, mask has 1"):
        gae(torch.ones(3, 4), torch.ones(3, 4), mask, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="masked_whiten needs at least 2 valid positions, mask has 1"):
        reinforce_plus_plus(torch.ones(3, 4), mask, gamma=1.0)


# ---------------------------------------------------------------- GRPO


def grpo_case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    index = np.array(["a", "b", "a", "c", "b", "a", "d", "b", "c", "c"], dtype=object)  # "d" is a group of one
    lengths = torch.randint(1, 6, (len(index),), generator=gen)
    mask = (torch.arange(6)[None] < lengths[:, None]).float()
    rewards = torch.zeros(len(index), 6, dtype=torch.float64)
    rewards[torch.arange(len(index)), lengths - 1] = torch.randint(0, 3, (len(index),), generator=gen).double()
    rewards[4, 0] += 0.25  # a second nonzero token: the score is the row sum
    return rewards, mask, index


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_dict_of_lists_reference(norm_by_std):
    rewards, mask, index = grpo_case()
    advantages, returns = grpo(rewards, mask, index, epsilon=1e-6, norm_by_std=norm_by_std)
    ref = group_reference(rewards.sum(-1).tolist(), list(index), 1e-6, norm_by_std)
    expected = torch.tensor(ref, dtype=torch.float64)[:, None] * mask.double()
    torch.testing.assert_close(advantages, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(returns, advantages)


def test_grpo_invariants_group_mean_zero_and_singleton():
    rewards, mask, index = grpo_case(seed=1)
    advantages, _ = grpo(rewards, mask, index)
    per_sample = advantages[:, 0]  # every response has a token at t = 0
    for key in ("a", "b", "c"):
        members = per_sample[torch.from_numpy(index == key)]
        assert members.sum().item() == pytest.approx(0.0, abs=1e-9)
    # A group of one: mean 0, std 1, so the score passes through divided by (1 + eps).
    lone = int(np.flatnonzero(index == "d")[0])
    assert per_sample[lone].item() == pytest.approx(rewards[lone].sum().item() / (1 + 1e-6))
    # Outside the response every advantage is 0.
    assert (advantages[mask == 0] == 0).all()


def test_grpo_permutation_invariance():
    rewards, mask, index = grpo_case(seed=2)
    perm = torch.randperm(len(index), generator=torch.Generator().manual_seed(0))
    advantages, _ = grpo(rewards, mask, index)
    permuted, _ = grpo(rewards[perm], mask[perm], index[perm.numpy()])
    torch.testing.assert_close(permuted, advantages[perm])


def test_grpo_index_types_agree_and_equal_scores_give_zero():
    rewards, mask, index = grpo_case(seed=3)
    codes = {key: i for i, key in enumerate(sorted(set(index)))}
    as_ints = [codes[k] for k in index]
    reference, _ = grpo(rewards, mask, index)
    for other in (list(index), np.array(as_ints), torch.tensor(as_ints)):
        torch.testing.assert_close(grpo(rewards, mask, other)[0], reference)
    same = torch.ones(4, 3)
    advantages, _ = grpo(same, torch.ones(4, 3), np.array(["x"] * 4, dtype=object))
    assert (advantages == 0).all()


def test_grpo_rejects_index_of_wrong_length():
    with pytest.raises(ValueError, match="index has 2 entries, batch has 3"):
        grpo(torch.zeros(3, 2), torch.ones(3, 2), np.array(["a", "b"]))


def test_grpo_bf16_rewards_give_float32():
    rewards, mask, index = grpo_case(seed=4)
    advantages, _ = grpo(rewards.bfloat16(), mask, index)
    assert advantages.dtype == torch.float32


# ---------------------------------------------------------------- RLOO, REINFORCE++


def test_rloo_hand_computed():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 4.0]])
    mask = torch.tensor([[1, 0], [1, 1], [1, 1], [1, 1], [1, 0], [1, 1]])
    index = np.array(["g", "g", "g", "solo", "h", "h"], dtype=object)
    advantages, returns = rloo(rewards, mask, index)
    # g: scores 1, 0, 0 -> 1 - 0, 0 - 0.5, 0 - 0.5; solo: baseline 0 -> 2; h: 3 - 4, 4 - 3.
    expected = torch.tensor([[1.0, 0.0], [-0.5, -0.5], [-0.5, -0.5], [2.0, 2.0], [-1.0, 0.0], [1.0, 1.0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)


def test_reinforce_plus_plus_hand_computed_with_hole():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 7.0, 4.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    advantages, returns = reinforce_plus_plus(rewards, mask, gamma=0.5)
    # Row 0: G = [1 + 0.5 * 1, 0 + 0.5 * 2, 2] = [1.5, 1, 2]; row 1 skips t=1 (reward 7 ignored): G = [2, -, 4].
    assert returns[0].tolist() == pytest.approx([1.5, 1.0, 2.0])
    assert [returns[1, 0].item(), returns[1, 2].item()] == pytest.approx([2.0, 4.0])
    expected = whiten_reference(returns.tolist(), mask.tolist(), 1e-8)
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64))


def test_reinforce_plus_plus_baseline_matches_reference():
    rewards, mask, index = grpo_case(seed=5)
    advantages, returns = reinforce_plus_plus_baseline(rewards, mask, index, epsilon=1e-6)
    scores = rewards.sum(-1).tolist()
    groups = defaultdict(list)
    for score, key in zip(scores, index):
        groups[key].append(score)
    centered = [s - (statistics.mean(groups[k]) if len(groups[k]) > 1 else 0.0) for s, k in zip(scores, index)]
    rows = [[c * m for m in m_row] for c, m_row in zip(centered, mask.tolist())]
    expected = whiten_reference(rows, mask.tolist(), 1e-6)
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(returns, advantages)


# ---------------------------------------------------------------- registry and imports


def test_registry_names_and_traits_come_from_the_signatures():
    names = {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"}
    assert set(ADVANTAGE_ESTIMATORS) == names
    assert ADVANTAGE_ESTIMATORS.get("grpo").target is grpo
    assert [n for n in sorted(names) if ADVANTAGE_ESTIMATORS.get(n).needs_critic] == ["gae"]
    assert {n for n in names if ADVANTAGE_ESTIMATORS.get(n).needs_groups} == {
        "grpo", "rloo", "reinforce_plus_plus_baseline"}
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; known: gae, grpo"):
        ADVANTAGE_ESTIMATORS.get("ppo")


def test_estimate_advantages_passes_each_estimator_only_what_it_declares():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    mask = torch.ones(4, 2)
    inputs = dict(token_level_rewards=rewards, response_mask=mask, index=np.array(["p", "p", "q", "q"]),
                  gamma=0.9, lam=0.8, norm_by_std=False, values=torch.ones(4, 2))
    assert torch.equal(estimate_advantages("grpo", **inputs)[0], grpo(rewards, mask, inputs["index"],
                                                                      norm_by_std=False)[0])
    assert torch.equal(estimate_advantages("gae", **inputs)[1], gae(rewards, inputs["values"], mask, 0.9, 0.8)[1])
    del inputs["values"]
    with pytest.raises(ValueError, match=r"'gae' needs \['values'\]"):
        estimate_advantages("gae", **inputs)


def test_an_estimator_with_an_unknown_input_is_refused_at_registration():
    with pytest.raises(TypeError, match=r"parameters \['critic_values'\] are not inputs"):
        @estimator("broken")
        def broken(token_level_rewards, critic_values):  # noqa: ARG001 - never called
            raise AssertionError
    assert "broken" not in ADVANTAGE_ESTIMATORS


def test_import_does_not_load_heavy_dependencies():
    code = (
        "import sys, megarl.algorithms\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'ray', 'sglang', 'numba'))\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


# ---------------------------------------------------------------- masked helpers


def test_masked_helpers_against_numpy():
    gen = torch.Generator().manual_seed(11)
    # 1.2M elements: more than one chunk of the chunked sum of squares.
    values = torch.randn(1200, 1000, generator=gen) * 3 + 5
    mask = torch.rand(1200, 1000, generator=gen) > 0.3
    values_np, mask_np = values.double().numpy(), mask.numpy()
    valid = values_np[mask_np]
    assert masked_mean(values, mask).item() == pytest.approx(valid.mean(), rel=1e-5)
    assert masked_var(values, mask).item() == pytest.approx(valid.var(ddof=1), rel=1e-5)
    expected = np.where(mask_np, (values_np - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8), 0.0)
    dirty = values.masked_fill(~mask, float("nan"))
    np.testing.assert_allclose(masked_whiten(dirty, mask).numpy(), expected, rtol=1e-4, atol=1e-4)
    assert torch.isnan(dirty).any()  # the out-of-place version left its input alone
    rows = masked_mean(values, torch.zeros_like(mask), dim=-1)
    assert (rows == 0).all()
    with pytest.raises(ValueError, match="needs at least 2 valid positions, mask has 1"):
        masked_whiten(values[:1, :3], torch.tensor([[True, False, False]]))
