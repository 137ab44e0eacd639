"""Dynamic micro-batching by a token budget with sequence packing.

The planning functions are pure and checked here against hand-worked examples. The
engine results come from the layout-matrix job (`_engine_jobs`): at every layout (TP,
PP, VPP, DP) packed log-probs, entropy, SFT and PPO gradients must equal the unpacked
computation, and DP ranks with different numbers of bins must agree on one
micro-batch count.
"""

from __future__ import annotations

import math

import pytest
import torch

from _engine_jobs import LAYOUTS, MATRIX_MODELS, PROMPT, WORLD_SIZE, matrix_job
from _engine_spawn import run_spawned
from _engine_workers import packed_attention_against_loop
from megarl.data.padding import position_ids_from_mask
from megarl.engines.packing import first_fit_decreasing, pack_rows, padding_fraction, split_to_count


def test_first_fit_decreasing_by_hand():
    # Longest first: 9 | 7 | 5 | 4 -> with 5 | 3 -> with 7 | 2 fits nowhere.
    assert first_fit_decreasing([5, 9, 3, 7, 2, 4], 10) == [[1], [3, 2], [0, 5], [4]]
    # A sequence over the budget gets a bin of its own.
    assert first_fit_decreasing([15, 3, 4], 10) == [[0], [2, 1]]
    with pytest.raises(ValueError, match="max_tokens_per_microbatch=0"):
        first_fit_decreasing([1], 0)


def test_split_to_count_splits_the_heaviest_bin_then_adds_empty_ones():
    lengths = [4, 4, 4, 4, 1]
    assert split_to_count([[0, 1, 2, 3], [4]], 3, lengths) == [[0, 2], [1, 3], [4]]
    bins = split_to_count([[0, 1, 2, 3], [4]], 6, lengths)
    assert len(bins) == 6 and bins.count([]) == 1
    assert sorted(r for b in bins for r in b) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        split_to_count([[0], [1]], 1, lengths)


def _padded_batch() -> dict:
    input_ids = torch.tensor([[0, 0, 11, 12, 13, 14], [0, 21, 22, 23, 0, 0], [31, 32, 33, 34, 35, 36]])
    mask = (input_ids > 0).long()
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": position_ids_from_mask(mask),
        "response_mask": mask[:, 3:],
    }


def test_pack_rows_places_tokens_positions_and_index():
    batch = _padded_batch()
    packed = pack_rows(batch, [1, 0], pad_to=9)
    assert packed["input_ids"].tolist() == [[21, 22, 23, 11, 12, 13, 14, 0, 0]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0]]  # restart per sequence
    assert packed["cu_seqlens"].tolist() == [0, 3, 7]  # tokens 7, 8 are row padding
    assert packed["token_index"].tolist() == [[-1, 0, 1, 2, -1, -1], [-1, -1, 3, 4, 5, 6]]
    assert torch.equal(packed["response_mask"], batch["response_mask"][[1, 0]])
    assert packed["valid_row"].tolist() == [1.0, 1.0]
    assert pack_rows(batch, [1, 0])["input_ids"].shape == (1, 7)
    empty = pack_rows(batch, [])
    assert empty["input_ids"].shape == (1, 1) and empty["token_index"].shape == (0, 6)
    assert empty["cu_seqlens"].tolist() == [0]
    with pytest.raises(ValueError, match="pad_to=5"):
        pack_rows(batch, [1, 0], pad_to=5)


def test_packing_wastes_under_10_percent_on_gsm8k_like_lengths():
    """Lognormal response lengths clipped to 50..400 plus ~60-token prompts: padding to the
    longest row wastes most slots; packed rows, even padded to a common length (what
    interleaved VPP needs), waste under 10%."""
    gen = torch.Generator().manual_seed(0)
    responses = torch.exp(math.log(150) + 0.6 * torch.randn(512, generator=gen)).clamp(50, 400).long()
    prompts = torch.randint(40, 90, (512,), generator=gen)
    lengths = (prompts + responses).tolist()
    real = sum(lengths)
    fixed = padding_fraction(real, len(lengths) * max(lengths))
    bins = first_fit_decreasing(lengths, 4096)
    loads = [sum(lengths[r] for r in b) for b in bins]
    assert sorted(r for b in bins for r in b) == list(range(512)) and max(loads) <= 4096
    packed_common_length = padding_fraction(real, len(bins) * max(loads))
    assert fixed > 0.4
    assert packed_common_length < 0.10
    assert padding_fraction(real, sum(loads)) == 0.0  # variable-length rows: no padding at all


@pytest.fixture(scope="module")
def results():
    return matrix_job()


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_log_probs_equal_unpacked(results, layout):
    valid = results["batch"]["attention_mask"][:, PROMPT:].bool()
    for ranks in results["out"]:
        for name in MATRIX_MODELS:
            out = ranks[layout][name]
            for key in ("log_probs", "entropy"):
                packed, unpacked = out[f"packed_{key}"], out[key]
                assert torch.allclose(packed[valid], unpacked[valid], atol=1e-5, rtol=0), (name, key)
                assert torch.all(packed[~valid] == 0)  # padding positions are zeroed when packed


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_gradients_equal_unpacked(results, layout):
    for ranks in results["out"]:
        out = ranks[layout]
        for name in MATRIX_MODELS:
            sft, packed = out[name]["sft"], out[name]["packed_sft"]
            assert packed["sft/loss"] == pytest.approx(sft["sft/loss"], abs=1e-6)
            assert packed["sft/grad_norm"] == pytest.approx(sft["sft/grad_norm"], rel=1e-5)
            _assert_grads_close(out[name]["packed_grads"], out[name]["grads"], name)
        ppo = out["ppo"]
        for key, value in ppo["metrics"].items():
            assert ppo["packed_metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        _assert_grads_close(ppo["packed_grads"], ppo["grads"], "ppo")


def _assert_grads_close(got: dict, expected: dict, label: str) -> None:
    assert set(got) == set(expected)
    scale = max(g.abs().max() for g in expected.values())
    for param, grad in expected.items():
        assert torch.allclose(got[param], grad, atol=1e-6 * scale, rtol=1e-5), (label, param)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dp_ranks_agree_on_the_packed_micro_batch_count(results, layout):
    counts = [ranks[layout]["micro_batches"] for ranks in results["out"]]
    dp_size = WORLD_SIZE // (LAYOUTS[layout]["tp"] * LAYOUTS[layout]["pp"])
    assert len({c["packed"][0] for c in counts}) == 1
    for count in counts:
        micro_batches, real, computed = count["packed"]
        assert (real, computed) == (count["fixed"][1], real)  # same tokens, no padding slots
        assert count["fixed"][2] > computed
    if dp_size == 4:
        # Two rows per DP rank, 16-token budget: the DP shares need 1 or 2 bins on their own.
        assert {c["packed"][0] for c in counts} == {2}


@pytest.mark.parametrize(
    "cu_seqlens, total",
    [([0, 5, 5, 12, 13, 20], 23),  # an empty and a one-token sequence, 3 tokens of row padding
     ([0], 1)],  # an empty bin: one padding token, no sequence
)
def test_packed_attention_equals_one_call_per_sequence(cu_seqlens, total):
    out = run_spawned(packed_attention_against_loop, cu_seqlens=cu_seqlens, total=total)[0]
    packed, loop = out["packed"], out["loop"]
    assert packed["context"].shape == (total, 1, 64)
    assert torch.all(packed["context"][cu_seqlens[-1]:] == 0)
    # float32, softmax over at most 7 keys: only the summation order differs (the padded keys' masked
    # scores soften to exact zeros), so ~1e-7 relative noise.
    assert torch.allclose(packed["context"], loop["context"], atol=1e-6, rtol=1e-5)
    for got, expected in zip(packed["grads"], loop["grads"]):
        assert torch.allclose(got, expected, atol=1e-6, rtol=1e-5)
