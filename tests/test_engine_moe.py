"""Qwen3-MoE through the registry: Megatron (local spec, all-to-all token dispatcher, expert
TP = 1) against HF transformers on the same weights, at EP1 and EP2 (DP2) and PP2.

One 2-process job switches through the layouts and returns, per model (top-k routing
weights renormalised or not), the full logits, log-probs / entropy (also packed), and one
SFT step at lr = 0 on the DP shares: loss, grad norm and gradients, which HF autograd
must reproduce (router and experts included). The weights gathered from the EP2 shards
must be the checkpoint's, and a distributed checkpoint saved at EP2 must load at the
other layouts.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from _engine_spawn import run_spawned
from _engine_workers import moe_outputs
from _tiny import hf_sft_backward
from megarl.data.padding import position_ids_from_mask

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # one shared multi-process job, 20-50 s

CONFIG = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    initializer_range=0.1,
    tie_word_embeddings=False,
    attn_implementation="eager",
)
MODELS = {"moe_renorm": dict(norm_topk_prob=True), "moe_plain": dict(norm_topk_prob=False)}
LAYOUTS = {  # on 2 ranks
    "ep1": dict(tp=1, pp=1, ep=1),
    "ep2": dict(tp=1, pp=1, ep=2),
    "pp2": dict(tp=1, pp=2, ep=1),
}
PROMPT, RESPONSE, ROWS = 5, 6, 6


def _batch() -> dict:
    gen = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, 300, (ROWS, PROMPT + RESPONSE), generator=gen)
    mask = torch.ones_like(input_ids)
    for row, (left_pad, right_pad) in enumerate([(0, 0), (2, 3), (4, 1), (1, 5), (0, 2), (3, 0)]):
        mask[row, :left_pad] = 0
        mask[row, PROMPT + RESPONSE - right_pad :] = 0
    loss_mask = mask.clone()
    loss_mask[:, :PROMPT] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": position_ids_from_mask(mask),
        "loss_mask": loss_mask,
    }


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    models, checkpoints = {}, {}
    for name, extra in MODELS.items():
        torch.manual_seed(3)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG, **extra)).eval()
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "norm" in param_name:
                    param.uniform_(0.5, 1.5)
                elif "experts" in param_name or "gate" in param_name:
                    param.normal_(0, 0.1)  # HF leaves experts and router uninitialised
        model.save_pretrained(root / name)
        models[name], checkpoints[name] = model, str(root / name)
    batch = _batch()
    out = run_spawned(
        moe_outputs,
        world_size=2,
        layouts=LAYOUTS,
        checkpoints=checkpoints,
        batch=batch,
        response_length=RESPONSE,
        ckpt_dir=str(root / "ckpt"),
    )
    return models, {**checkpoints, "ckpt": root / "ckpt"}, batch, out


@pytest.fixture(scope="module")
def hf_reference(job):
    models, _, batch, _ = job
    reference = {}
    for name, model in models.items():
        logits, loss = hf_sft_backward(model, batch)
        # Gradients in the on-disk names (one tensor per expert), as the engine reports them.
        grads = {}
        for param_name, param in model.named_parameters():
            if param_name.endswith("experts.gate_up_proj"):
                for e, fused in enumerate(param.grad):
                    gate, up = fused.chunk(2)
                    grads[param_name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                    grads[param_name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
            elif param_name.endswith("experts.down_proj"):
                for e, down in enumerate(param.grad):
                    grads[param_name.replace("down_proj", f"{e}.down_proj.weight")] = down
            else:
                grads[param_name] = param.grad.clone()
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
        reference[name] = {"logits": logits.double(), "loss": loss, "grads": grads, "norm": norm}
    return reference


def test_layouts_split_the_experts_as_asked(job):
    _, _, _, out = job
    for layout, parallel in LAYOUTS.items():
        where = [ranks[layout]["where"] for ranks in out]
        assert {(w["tp_size"], w["pp_size"], w["dp_size"]) for w in where} == {
            (parallel["tp"], parallel["pp"], 2 // (parallel["tp"] * parallel["pp"]))
        }


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_logits_and_log_probs_match_hf(job, hf_reference, layout):
    _, _, batch, out = job
    valid = batch["attention_mask"].bool()
    response_valid = valid[:, PROMPT:]
    targets = batch["input_ids"][:, PROMPT:]
    for ranks in out:
        for name in MODELS:
            ours, reference = ranks[layout][name], hf_reference[name]["logits"]
            assert reference[valid].abs().max() > 0.5
            assert torch.allclose(ours["logits"].double()[valid], reference[valid], atol=1e-5, rtol=0), name
            shifted = reference[:, PROMPT - 1 : -1]
            expected = torch.log_softmax(shifted, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            assert torch.allclose(ours["log_probs"].double()[response_valid], expected[response_valid], atol=1e-5)
            packed = ours["packed_log_probs"]
            assert torch.allclose(packed[response_valid], ours["log_probs"][response_valid], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_training_step_matches_hf_autograd(job, hf_reference, layout):
    _, _, _, out = job
    for ranks in out:
        for name in MODELS:
            ours, reference = ranks[layout][name], hf_reference[name]
            assert ours["sft"]["sft/loss"] == pytest.approx(reference["loss"], abs=1e-5)
            assert ours["sft"]["sft/grad_norm"] == pytest.approx(reference["norm"], rel=1e-4)
            assert ours["packed_sft"]["sft/grad_norm"] == pytest.approx(reference["norm"], rel=1e-4)
            assert set(ours["grads"]) == set(reference["grads"])
            scale = max(g.abs().max() for g in reference["grads"].values())
            for param, grad in reference["grads"].items():
                assert grad.abs().max() > 0 or "experts" in param  # every non-expert param gets a gradient
                assert torch.allclose(ours["grads"][param], grad, atol=1e-5 * scale, rtol=1e-4), (name, param)


def test_gathered_weights_are_the_checkpoint_at_every_layout(job):
    _, checkpoints, _, out = job
    on_disk = load_file(str(checkpoints["moe_renorm"] + "/model.safetensors"))
    for ranks in out:
        for layout in LAYOUTS:
            weights = ranks[layout]["weights"]
            assert set(weights) == set(on_disk)
            for name, tensor in on_disk.items():
                assert torch.equal(weights[name], tensor), (layout, name)


def test_checkpoint_saved_at_ep2_loads_at_other_layouts(job):
    _, checkpoints, batch, out = job
    info = json.loads((checkpoints["ckpt"] / "megarl_checkpoint.json").read_text())
    assert info["hf_config"]["model_type"] == "qwen3_moe"
    # Saved before any step: the schedule is kept, Adam has no moments to save yet.
    assert info["has_optimizer"] is True and info["has_optimizer_state"] is False
    valid = batch["attention_mask"][:, PROMPT:].bool()
    for ranks in out:
        for layout in ("pp2",):
            loaded, expected = ranks[layout]["loaded_log_probs"], ranks["ep2"]["moe_renorm"]["log_probs"]
            assert torch.allclose(loaded[valid], expected[valid], atol=1e-5, rtol=0), layout


def test_moe_checkpoint_keys_are_the_same_for_either_layer_spec(job):
    """A MoE layer's pre-MLP norm: megatron's local spec stores it under the fused-norm key, as a dense layer's;
    TE's MoE spec keeps a `pre_mlp_layernorm` module, which `checkpoint.checkpoint_key` maps to the same key."""
    *_, out = job
    for layout in LAYOUTS:
        keys = set(out[0][layout]["checkpoint_keys"])
        assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in keys
        assert "decoder.layers.mlp.router.weight" in keys
        assert not any("pre_mlp_layernorm" in key or "_extra_state" in key for key in keys), layout
