"""ValueEngine (spawned gloo ranks) against an HF backbone + linear head computed in this process.

One rank at TP1PP1 and two ranks at PP2 run the same job: values (padded and packed
micro-batches) of a fixed batch, then two value updates on it (the single rank also
saves a checkpoint and restores it into a fresh engine). The reference is the HF
model's final hidden states times the engine's value head, read one position before
each response token, and the clipped value loss written out by hand.
"""

from __future__ import annotations

import pytest
import torch

from _engine_spawn import run_spawned
from _tiny import padded_sequences, tiny_model
from _engine_workers import log_prob_rows
from _settings import batching, optimizer, value_update

pytestmark = pytest.mark.dist

PROMPT, RESPONSE, ROWS = 5, 6, 6
UPDATE = dict(epochs=1, micro_batch_size=2, shuffle=False, seed=0, cliprange_value=0.5, loss_agg_mode="token-mean")


def _hf_model():
    return tiny_model("qwen2", seed=5, vocab_size=200, attn_implementation="eager")


def _batch() -> dict:
    gen = torch.Generator().manual_seed(3)
    batch = padded_sequences(gen, rows=ROWS, prompt=PROMPT, response=RESPONSE, vocab=200)
    return {**batch, "response_mask": batch["response_mask"].float(),
            "returns": torch.randn(ROWS, RESPONSE, generator=gen)}


def critic_job(*, rank: int, hf_config: dict, weights: dict, batch: dict, ckpt_dir: str | None = None) -> dict:
    from megarl.engines.critic import ValueEngine

    engine = ValueEngine(hf_config=hf_config, weights=weights, seed=1, head_init_std=0.1, params_dtype="float32",
                         transformer_impl="local", optimizer=optimizer(lr=1e-3, clip_grad=1.0))
    rows = log_prob_rows(batch, RESPONSE)
    values = engine.compute_values(rows, batching=batching(4))
    packed = engine.compute_values(rows, batching=batching(4, 20))
    head = engine.value_head
    head = None if head is None else (head.weight.detach().clone(), head.bias.detach().clone())
    update = dict(rows, response_mask=batch["response_mask"], values=values, returns=batch["returns"])
    first = engine.update(update, value_update(**UPDATE))
    second = engine.update(update, value_update(**UPDATE))
    restored = None
    if ckpt_dir is not None:  # a fresh engine (other seed) loads the trained critic from a checkpoint
        engine.save_checkpoint(ckpt_dir)
        fresh = ValueEngine(hf_config=hf_config, weights=None, seed=9, params_dtype="float32",
                            transformer_impl="local", optimizer=optimizer(lr=1e-3, clip_grad=1.0))
        fresh.load_checkpoint(ckpt_dir, load_optimizer=True)
        restored = (engine.compute_values(rows, batching=batching(4)),
                    fresh.compute_values(rows, batching=batching(4)))
    return {
        "restored": restored,
        "values": values,
        "packed": packed,
        "head": head,
        "first": first,
        "second": second,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = _hf_model()
    hf_config = model.config.to_dict()
    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    batch = _batch()
    ckpt_dir = str(tmp_path_factory.mktemp("critic") / "ckpt")
    (single,) = run_spawned(critic_job, hf_config=hf_config, weights=weights, batch=batch, ckpt_dir=ckpt_dir)
    pp2 = run_spawned(critic_job, world_size=2, layout={"tp": 1, "pp": 2}, hf_config=hf_config, weights=weights,
                      batch=batch)
    return model, batch, single, pp2


def _reference_values(model, batch, head) -> torch.Tensor:
    weight, bias = head
    with torch.no_grad():
        hidden = model.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).last_hidden_state
        values = (hidden @ weight.t() + bias).squeeze(-1)
    # V_t of response token t is read one position earlier: positions P-1 .. P+R-2.
    return values[:, PROMPT - 1 : PROMPT + RESPONSE - 1]


def test_values_match_hf_backbone_plus_head_at_the_state_before_each_token(runs):
    model, batch, single, _ = runs
    weight, _ = single["head"]
    assert weight.shape == (1, 64) and weight.abs().sum() > 0
    expected = _reference_values(model, batch, single["head"])
    mask = batch["response_mask"].bool()
    assert single["values"].shape == (ROWS, RESPONSE)
    assert torch.allclose(single["values"][mask], expected[mask], atol=1e-5)
    # Packing several sequences into one row reads the same values.
    assert torch.allclose(single["packed"][mask], expected[mask], atol=1e-5)


def test_update_reports_the_hand_computed_loss_and_reduces_it(runs):
    _, batch, single, _ = runs
    assert set(single["first"]) == {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr"}
    mask = batch["response_mask"]
    # Before the first step the predictions equal the anchor values: no clipping, plain MSE / 2.
    error = (single["values"] - batch["returns"]).square()
    expected = 0.5 * (error * mask).sum() / mask.sum()
    assert single["first"]["critic/vf_loss"] == pytest.approx(float(expected), rel=1e-5)
    assert single["first"]["critic/vf_clipfrac"] == 0.0
    assert single["first"]["critic/lr"] == pytest.approx(1e-3)
    assert single["first"]["critic/grad_norm"] > 0
    assert single["second"]["critic/vf_loss"] < 0.9 * single["first"]["critic/vf_loss"]


def test_pp2_matches_a_single_rank(runs):
    _, batch, single, pp2 = runs
    mask = batch["response_mask"].bool()
    assert pp2[0]["head"] is None and pp2[1]["head"] is not None  # the head lives on the last stage
    for rank_out in pp2:  # every stage gets the values and metrics
        assert torch.allclose(rank_out["values"][mask], single["values"][mask], atol=1e-5)
        for name in ("first", "second"):
            for key, value in single[name].items():
                assert rank_out[name][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, key)


def test_a_checkpoint_restores_the_trained_critic(runs):
    _, _, single, _ = runs
    trained, restored = single["restored"]
    assert not torch.allclose(trained, single["values"])  # the updates moved the values
    assert torch.equal(restored, trained)
