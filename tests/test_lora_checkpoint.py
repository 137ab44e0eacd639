"""LoRA checkpoints: the adapters and their Adam state alone, a resume at the same and another TP layout that
continues as the uninterrupted engine does, and `megarl export --lora` / `--merge`, loaded by peft and by HF
transformers, reproducing the engine's logits.

One 2-process job (a Qwen2 with QKV bias and tied embeddings, adapters on every target):
PPO step at TP2, save, second step (the reference); fresh engines with other initial
adapters load the checkpoint at TP1 (DP2) and at TP2 and take the second step. At the
saved layout everything is bitwise equal; at TP1 the TP2 partial sums are added in
another order, so float32 noise (1e-6 relative) is allowed. Then the CLI exports the
checkpoint in a fresh process (a forked rank), through the CLI's `main` as a user runs it.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from _engine_spawn import run_captured, run_spawned
from _lora_workers import lora_checkpoint_outputs
from _tiny import padded_sequences, tiny_model
from megarl.config.settings import LoraSettings
from megarl.models.lora import TARGETS

pytestmark = [pytest.mark.dist, pytest.mark.slow]
peft = pytest.importorskip("peft")

SETTINGS = LoraSettings(rank=4, alpha=16.0, dropout=0.0, targets=tuple(TARGETS), init="gaussian", seed=2)
TRAIN = dict(lr=5e-2, warmup_steps=2, clip_grad=1.0, weight_decay=0.01)
PPO = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, entropy_coeff=0.0, temperature=1.0)
ROWS, PROMPT, RESPONSE = 8, 5, 6


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-ckpt")
    tiny_model("qwen2", seed=4, randomise_norms=True, num_hidden_layers=2).save_pretrained(root / "hf")
    gen = torch.Generator().manual_seed(3)
    batch = {**padded_sequences(gen, rows=ROWS, prompt=PROMPT, response=RESPONSE, vocab=300),
             "old_log_probs": -5.7 + 0.3 * torch.randn(ROWS, RESPONSE, generator=gen),
             "advantages": torch.randn(ROWS, RESPONSE, generator=gen)}
    out = run_spawned(lora_checkpoint_outputs, world_size=2, checkpoint=str(root / "hf"), settings=SETTINGS,
                      batch=batch, ckpt_dir=str(root / "ckpt"), train=TRAIN, ppo=PPO, layout={"tp": 2, "pp": 1})
    return {"root": root, "batch": batch, "out": out}


# Relative float noise of a gradient summed in another order, and Adam's defaults (tests/_settings.py), as in
# test_checkpoint.py, whose bound this reuses: Adam divides by sqrt(v), so an element with a near-zero gradient
# turns that noise into a step difference of up to lr * noise / (sqrt(v_hat) + eps).
GRAD_NOISE, ADAM_BETA2, ADAM_EPS, SECOND_STEP = 1e-5, 0.999, 1e-8, 2


def _step_bound(out: dict, name: str) -> torch.Tensor:
    grad = out["continued_grads"][name]
    lr, clip = out["metrics_2"]["actor/lr"], min(1.0, 1.0 / out["metrics_2"]["actor/grad_norm"])
    v_hat = out["continued_moments"][name] / (1 - ADAM_BETA2**SECOND_STEP)
    bound = lr * clip * GRAD_NOISE * grad.abs().max() / (v_hat.sqrt() + ADAM_EPS)
    return bound + 4 * torch.finfo(torch.float32).eps * out["continued_adapters"][name].abs()


def test_checkpoint_holds_the_adapters_alone(job):
    ckpt = job["root"] / "ckpt"
    info = json.loads((ckpt / "megarl_checkpoint.json").read_text())
    assert info["lora"] == {"rank": 4, "alpha": 16.0, "dropout": 0.0, "targets": list(TARGETS), "init": "gaussian",
                            "base": {"path": str(job["root"] / "hf"), "seed": 0}}
    adapters = job["out"][0]["saved_adapters"]
    adapter_bytes = sum(t.numel() * 4 for t in adapters.values())
    base_bytes = (job["root"] / "hf" / "model.safetensors").stat().st_size
    data_bytes = sum(f.stat().st_size for f in ckpt.glob("*.distcp"))
    # Weights plus Adam's two moments, and pickling overhead; far below the base model.
    assert adapter_bytes * 3 <= data_bytes < adapter_bytes * 3 + 200_000 < base_bytes


@pytest.mark.parametrize("layout", ["tp2", "tp1"])
def test_resume_restores_adapters_and_adam_state_and_continues(job, layout):
    exact = layout == "tp2"  # the saved layout
    for out in job["out"]:
        assert out["metrics_1"]["actor/grad_norm"] > 0
        for name, tensor in out["saved_adapters"].items():
            assert torch.equal(out[f"{layout}_loaded_adapters"][name], tensor), name
            assert torch.equal(out[f"{layout}_loaded_moments"][name], out["saved_moments"][name]), name
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/ppo_kl"):
            if exact:
                assert out[f"{layout}_metrics"][key] == out["metrics_2"][key], key
            else:
                assert out[f"{layout}_metrics"][key] == pytest.approx(out["metrics_2"][key], rel=1e-5, abs=1e-7)
        steps, bounds = [], []
        for name, tensor in out["continued_adapters"].items():
            got = out[f"{layout}_adapters"][name]
            if exact:
                assert torch.equal(got, tensor), name
                continue
            grad = out["continued_grads"][name]
            assert torch.allclose(out[f"{layout}_grads"][name], grad, atol=GRAD_NOISE * grad.abs().max(), rtol=0)
            bound = _step_bound(out, name)
            assert ((got - tensor).abs() <= bound).all(), name
            steps.append((tensor - out["saved_adapters"][name]).abs().flatten())
            bounds.append(bound.flatten())
        if not exact:  # the bound is far below a real step: wrong moments or a wrong LR would fail
            assert torch.cat(steps).median() > 100 * torch.cat(bounds).median()


def test_mismatched_engines_refuse_the_checkpoint(job):
    full, wider, follower = job["out"][0]["refusals"]
    assert full is not None and "holds LoRA adapters, the engine trains full weights" in full
    assert wider is not None and "LoRA rank=4, the engine's is 8" in wider
    assert follower is not None and "holds LoRA adapters without their base weights" in follower


def _exports(ckpt: str, out: str) -> list[int]:
    """The exports in one fresh process (each sets up and tears down its own process group), through the CLI's
    main; the last asks for a full-weights export of the LoRA checkpoint. Their exit codes."""
    from megarl.cli import main

    return [main(["export", ckpt, flag, out + name]) for flag, name in (("--lora", "/peft"), ("--merge", "/merged"),
                                                                        ("--hf", "/hf-export"))]


@pytest.fixture(scope="module")
def exported(job) -> SimpleNamespace:
    root = job["root"]
    codes, stdout, stderr = run_captured(_exports, str(root / "ckpt"), str(root))
    assert codes == [0, 0, 2], stderr[-3000:]
    return SimpleNamespace(stdout=stdout, stderr=stderr)


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits.double()


def test_exported_peft_adapter_loads_with_peft_and_reproduces_the_logits(job, exported):
    root, batch = job["root"], job["batch"]
    assert "PEFT adapter written" in exported.stdout
    assert {p.name for p in (root / "peft").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert len(load_file(str(root / "peft" / "adapter_model.safetensors"))) == 2 * 2 * 7  # A, B x 7 linears x 2
    base = AutoModelForCausalLM.from_pretrained(str(root / "hf"), attn_implementation="eager").eval()
    base_logits = _logits(base, batch)
    adapted = peft.PeftModel.from_pretrained(base, str(root / "peft")).eval()
    saved = job["out"][0]["saved_logits"].double()
    valid = batch["attention_mask"].bool()
    assert (saved - base_logits)[valid].abs().max() > 1e-2  # the step moved the policy off the base
    assert torch.allclose(_logits(adapted, batch)[valid], saved[valid], atol=1e-5, rtol=0)


def test_merged_export_is_an_hf_checkpoint_with_the_engines_logits(job, exported):
    root, batch = job["root"], job["batch"]
    assert "LoRA adapters merged written" in exported.stdout
    merged = AutoModelForCausalLM.from_pretrained(str(root / "merged"), attn_implementation="eager").eval()
    valid = batch["attention_mask"].bool()
    saved = job["out"][0]["saved_logits"].double()
    assert torch.allclose(_logits(merged, batch)[valid], saved[valid], atol=1e-5, rtol=0)


@pytest.mark.robust
def test_export_names_the_wrong_flag(exported):
    assert "Traceback" not in exported.stderr
    assert "holds LoRA adapters, not full weights: export them with --lora OUT" in exported.stderr
