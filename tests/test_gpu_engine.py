"""The Megatron engine on CUDA: local layers against HF transformers, Transformer Engine layers against local ones.

One float32 Qwen3 model (q/k norms, GQA) loaded from an HF checkpoint dir into a
one-rank engine (NCCL) per layer spec. Reference for the local spec: HF transformers
on the same GPU. Reference for the TE spec: the local spec on the same weights,
forward (logits) and backward (one SFT step's gradients, in HF names). TE's spec
must really be in use: its parameter names include the fused norm weights.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from _engine_spawn import run_spawned
from _engine_workers import layer_specs_side_by_side
from _tiny import GPU_QWEN3
from megarl.data.padding import position_ids_from_mask

pytestmark = pytest.mark.gpu

HAS_TE = importlib.util.find_spec("transformer_engine") is not None
CONFIG = GPU_QWEN3
ROWS, SEQ = 4, 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)  # not all ones: a norm weight in the wrong place must show
    path = tmp_path_factory.mktemp("qwen3") / "hf"
    model.save_pretrained(path)
    return path, model


def _batch() -> dict:
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 300, (ROWS, SEQ), generator=gen)
    mask = torch.ones_like(input_ids)
    mask[1, :3] = 0  # left padding
    mask[3, SEQ - 4:] = 0  # right padding
    loss_mask = mask.clone()
    loss_mask[:, :4] = 0
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask),
            "loss_mask": loss_mask}


def _run(checkpoint, impls):
    path, _ = checkpoint
    return run_spawned(layer_specs_side_by_side, checkpoint=str(path), batch=_batch(), impls=impls)[0]


def test_local_layers_on_cuda_reproduce_hf_transformers(checkpoint):
    out = _run(checkpoint, ("local",))["local"]
    assert out["resolved"] == "local"
    _, model = checkpoint
    batch = _batch()
    with torch.no_grad():
        reference = model.cuda()(input_ids=batch["input_ids"].cuda(), attention_mask=batch["attention_mask"].cuda(),
                                 position_ids=batch["position_ids"].cuda()).logits.cpu()
    valid = batch["attention_mask"].bool()
    # float32 on both sides (torch keeps TF32 off for matmuls by default): summation order only, ~1e-6.
    assert reference[valid].abs().max() > 0.5
    assert torch.allclose(out["logits"][valid], reference[valid], atol=1e-4, rtol=0)


@pytest.mark.skipif(not HAS_TE, reason="needs transformer-engine (not installed here)")
def test_transformer_engine_layers_match_the_local_layers(checkpoint):
    out = _run(checkpoint, ("local", "transformer_engine"))
    te, local = out["transformer_engine"], out["local"]
    assert te["resolved"] == "transformer_engine"
    assert any(name.endswith("linear_qkv.layer_norm_weight") for name in te["names"])
    assert not any(name.endswith("input_layernorm.weight") for name in te["names"])
    valid = _batch()["attention_mask"].bool()
    # TE may run float32 GEMMs in TF32 (2^-11 relative per product): logits then agree to ~1e-3 of their
    # scale. A wiring error (a norm weight misplaced, gate and up swapped) moves them by O(1).
    scale = local["logits"][valid].abs().max()
    assert torch.allclose(te["logits"][valid], local["logits"][valid], atol=2e-3 * float(scale), rtol=0)
    assert te["sft"]["sft/loss"] == pytest.approx(local["sft"]["sft/loss"], rel=1e-3)
    assert te["grads"].keys() == local["grads"].keys()
    for name, grad in local["grads"].items():
        error = (te["grads"][name] - grad).norm()
        assert error <= 1e-2 * grad.norm() + 1e-6, name  # the same TF32 bound, through three layers
