"""LoRA adapters on Transformer Engine's layers against the same adapters on megatron's local layers (CUDA).

TE's `linear_qkv` and `linear_fc1` fuse the preceding RMSNorm, so their adapters must apply
that norm themselves (`megarl.engines.lora`); a missing or misplaced norm moves the logits by
O(1). One float32 Qwen3 (q/k norms, GQA), one rank, adapters on every target with random A and B.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from _engine_spawn import run_spawned
from _lora_workers import lora_specs_side_by_side
from _tiny import GPU_QWEN3, padded_sequences
from megarl.config.settings import LoraSettings
from megarl.models import arch_from_hf
from megarl.models.lora import TARGETS, initial_adapters

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HAS_TE = importlib.util.find_spec("transformer_engine") is not None
CONFIG = GPU_QWEN3
SETTINGS = LoraSettings(rank=8, alpha=16.0, dropout=0.0, targets=tuple(TARGETS), init="kaiming", seed=0)


@pytest.mark.skipif(not HAS_TE, reason="needs transformer-engine (not installed here)")
def test_lora_on_transformer_engine_layers_matches_local_layers(tmp_path):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**CONFIG, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "hf")
    arch = arch_from_hf(model.config.to_dict())
    generator = torch.Generator().manual_seed(1)
    adapters = {n: torch.randn(t.shape, generator=generator) * 0.2 if n.endswith("lora_B") else t
                for n, t in initial_adapters(arch, rank=8, targets=TARGETS, init="kaiming", seed=0).items()}
    batch = padded_sequences(torch.Generator().manual_seed(2), rows=4, prompt=5, response=6, vocab=300)
    batch["loss_mask"] = batch["attention_mask"].clone()
    out = run_spawned(lora_specs_side_by_side, checkpoint=str(tmp_path / "hf"), settings=SETTINGS, adapters=adapters,
                      batch=batch, impls=("local", "transformer_engine"))[0]
    te, local = out["transformer_engine"], out["local"]
    assert te["fused_norm"] and not local["fused_norm"]
    valid = batch["attention_mask"].bool()
    # TE may run float32 GEMMs in TF32: logits agree to ~1e-3 of their scale (as in test_gpu_engine).
    scale = float(local["logits"][valid].abs().max())
    assert (local["logits"] - local["logits_off"])[valid].abs().max() > 0.1  # the adapters matter
    for key in ("logits", "logits_off"):
        assert torch.allclose(te[key][valid], local[key][valid], atol=2e-3 * scale, rtol=0), key
    assert te["sft"]["sft/loss"] == pytest.approx(local["sft"]["sft/loss"], rel=1e-3)
    assert te["grads"].keys() == local["grads"].keys()
    for name, grad in local["grads"].items():
        assert (te["grads"][name] - grad).norm() <= 1e-2 * grad.norm() + 1e-6, name
