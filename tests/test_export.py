"""HF export of a distributed checkpoint: a TP2xPP2 checkpoint (from the checkpoint job)
exported by `export_checkpoint` in a fresh single CPU process (a forked rank), as the CLI runs it, then
loaded by HF transformers. The reference is the engine at save time: its weights and
its logits (computed by Megatron at TP2xPP2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from _engine_jobs import checkpoint_job
from _engine_spawn import run_captured

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # one shared multi-process job, 20-50 s


def _export(ckpt_dir: str, out_dir: str, not_a_checkpoint: str) -> None:
    from megarl.engines.export import export_checkpoint
    from megarl.errors import InputError

    try:
        export_checkpoint(Path(not_a_checkpoint), Path(out_dir))
    except InputError as error:
        print("InputError:", error)
    print("exported", export_checkpoint(Path(ckpt_dir), Path(out_dir)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    job = checkpoint_job()
    out_dir = tmp_path_factory.mktemp("export") / "hf"
    not_a_checkpoint = tmp_path_factory.mktemp("empty")
    _, stdout, _ = run_captured(_export, str(job["ckpt_dir"]), str(out_dir), str(not_a_checkpoint))
    return job, out_dir, stdout


def test_export_writes_the_saved_weights_config_and_tokenizer(exported):
    job, out_dir, stdout = exported
    assert f"exported {out_dir}" in stdout
    saved = job["out"][0]["saved_weights"]
    tensors = load_file(str(out_dir / "model.safetensors"))
    assert set(tensors) == set(saved) and "lm_head.weight" not in tensors  # tied
    for name, tensor in saved.items():
        assert tensors[name].dtype == torch.float32
        assert torch.equal(tensors[name], tensor), name
    config = json.loads((out_dir / "config.json").read_text())
    original = json.loads((job["hf_dir"] / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["vocab_size"] == 200 and config["dtype"] == "float32"
    assert {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in original.items() if k not in ("dtype", "torch_dtype")
    }
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out_dir / name).read_bytes() == (job["hf_dir"] / name).read_bytes()


def test_hf_transformers_reproduces_the_engine_logits(exported):
    job, out_dir, _ = exported
    model = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager").eval()
    batch = job["batch"]
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    valid = batch["attention_mask"].bool()
    engine_logits = job["out"][0]["saved_logits"]
    assert engine_logits[valid].abs().max() > 0.5
    assert torch.allclose(logits[valid], engine_logits[valid], atol=1e-5, rtol=0)


def test_export_of_a_dir_without_metadata_is_an_input_error(exported):
    _, _, stdout = exported
    assert "InputError:" in stdout and "megarl_checkpoint.json not found" in stdout
