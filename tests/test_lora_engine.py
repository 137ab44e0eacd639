"""LoRA adapters on the Megatron policy against a `peft`-wrapped HF model holding the same adapters.

One 2-process gloo job switches through TP1 (DP2), TP2, PP2 and PP2 x VPP2 on a 4-layer Llama
(GQA: 4 heads in 2 query groups, so the packed QKV's adapter rows interleave) with adapters
on every target (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`), rank 4, alpha 8,
random A and B. The reference is the HF model with the PEFT form of those adapters
(`megarl.models.lora.to_peft`): logits, the SFT loss and its gradients by autograd, and
`merge_and_unload()`'s weights. Tolerances are float32 noise on logits of order 1 (1e-5),
as for the plain engine; the adapters move the logits by more than 0.1, so a wrong split
cannot hide below them.
"""

from __future__ import annotations

import copy
import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from _engine_spawn import run_spawned
from _lora_workers import lora_outputs
from _tiny import hf_sft_backward, padded_sequences, tiny_model
from megarl.config.settings import LoraSettings
from megarl.models import arch_from_hf
from megarl.models.lora import PEFT_PREFIX, TARGETS, hf_module, initial_adapters, merge_adapter, to_hf, to_peft

pytestmark = [pytest.mark.dist, pytest.mark.slow]
peft = pytest.importorskip("peft")

LAYOUTS = {
    "tp1pp1": dict(tp=1, pp=1),
    "tp2pp1": dict(tp=2, pp=1),
    "tp1pp2": dict(tp=1, pp=2),
    "pp2vpp2": dict(tp=1, pp=2, vpp=2),
}
SETTINGS = LoraSettings(rank=4, alpha=8.0, dropout=0.0, targets=tuple(TARGETS), init="kaiming", seed=3)
PROMPT, RESPONSE, ROWS = 5, 6, 8


def _random_adapters(arch) -> dict[str, torch.Tensor]:
    """Seeded A (as `initial_adapters` draws it) and a random B, so every adapter changes its linear."""
    adapters = initial_adapters(arch, rank=SETTINGS.rank, targets=SETTINGS.targets, init="kaiming", seed=SETTINGS.seed)
    generator = torch.Generator().manual_seed(5)
    return {name: torch.randn(t.shape, generator=generator) * 0.2 if name.endswith("lora_B") else t
            for name, t in adapters.items()}


def peft_model(model, adapters: dict, arch):
    """A copy of HF `model` wrapped by peft with the PEFT form of megarl's `adapters`."""
    config = peft.LoraConfig(r=SETTINGS.rank, lora_alpha=SETTINGS.alpha, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])
    wrapped = peft.get_peft_model(copy.deepcopy(model), config)
    result = peft.set_peft_model_state_dict(wrapped, to_peft(adapters, arch))
    assert not result.unexpected_keys
    return wrapped.eval()


@functools.cache
def _job() -> dict:
    root = Path(tempfile.mkdtemp(prefix="megarl-lora-test-"))
    model = tiny_model("llama", seed=2, randomise_norms=True, num_hidden_layers=4, attn_implementation="eager")
    model.save_pretrained(root / "hf")
    arch = arch_from_hf(model.config.to_dict())
    adapters = _random_adapters(arch)
    gen = torch.Generator().manual_seed(9)
    batch = padded_sequences(gen, rows=ROWS, prompt=PROMPT, response=RESPONSE, vocab=300)
    batch["loss_mask"] = batch["attention_mask"].clone()
    batch["loss_mask"][:, :PROMPT] = 0
    try:
        out = run_spawned(lora_outputs, world_size=2, layouts=LAYOUTS, checkpoint=str(root / "hf"),
                          settings=SETTINGS, adapters=adapters, batch=batch, response_length=RESPONSE)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"model": model, "arch": arch, "adapters": adapters, "batch": batch, "out": out}


@pytest.fixture(scope="module")
def job():
    return _job()


@pytest.fixture(scope="module")
def reference(job):
    """The peft model's logits, SFT loss and adapter gradients; its merged weights; the base model's logits."""
    wrapped = peft_model(job["model"], job["adapters"], job["arch"])
    logits, loss = hf_sft_backward(wrapped, job["batch"])
    grads = {name: p.grad.clone() for name, p in wrapped.named_parameters() if p.grad is not None}
    with torch.no_grad():
        inputs = {k: job["batch"][k] for k in ("input_ids", "attention_mask", "position_ids")}
        base_logits = job["model"](**inputs).logits
    merged = {k: v for k, v in wrapped.merge_and_unload().state_dict().items()}
    return {"logits": logits.double(), "loss": loss, "grads": grads, "base_logits": base_logits.double(),
            "merged": merged}


def _merged_grads(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Every rank's adapter gradient shards merged over TP (DP and PP ranks contribute the shards they hold)."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for out in ranks:
        for name, (tp_rank, grad) in out["grads"].items():
            shards.setdefault(name, {})[tp_rank] = grad
    return {name: merge_adapter(name, [parts[r] for r in sorted(parts)]) for name, parts in shards.items()}


def _peft_grads_in_megarl_layout(grads: dict, arch, names) -> dict[str, tuple[torch.Tensor, dict]]:
    """Per megarl module: the sum of its HF members' lora_A gradients (they share A) and each member's
    lora_B gradient."""
    out = {}
    for module in {name.rsplit(".", 1)[0] for name in names}:
        parent, linears = hf_module(module)
        a_grad = sum(grads[f"{PEFT_PREFIX}{parent}{linear}.lora_A.default.weight"] for linear in linears)
        b_grads = {parent + linear: grads[f"{PEFT_PREFIX}{parent}{linear}.lora_B.default.weight"]
                   for linear in linears}
        out[module] = (a_grad, b_grads)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_with_and_without_adapters(job, reference, layout):
    valid = job["batch"]["attention_mask"].bool()
    for out in job["out"]:
        ours = out[layout]
        assert (reference["logits"] - reference["base_logits"])[valid].abs().max() > 0.1  # adapters matter
        assert torch.allclose(ours["logits"].double()[valid], reference["logits"][valid], atol=1e-5, rtol=0)
        assert torch.allclose(ours["logits_off"].double()[valid], reference["base_logits"][valid], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_log_probs_off_are_the_base_models(job, reference, layout):
    targets = job["batch"]["input_ids"][:, PROMPT:]
    response_valid = job["batch"]["response_mask"].bool()
    for key, logits in (("log_probs", reference["logits"]), ("log_probs_off", reference["base_logits"])):
        expected = torch.log_softmax(logits[:, PROMPT - 1: -1], -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        for out in job["out"]:
            got = out[layout][key].double()
            assert torch.allclose(got[response_valid], expected[response_valid], atol=1e-5, rtol=0), key


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_adapter_gradients_match_peft(job, reference, layout):
    ranks = [out[layout] for out in job["out"]]
    for out in ranks:
        assert out["sft"]["sft/loss"] == pytest.approx(reference["loss"], abs=1e-5)
    ours = _merged_grads(ranks)
    assert len(ours) == 2 * 4 * len(TARGETS)  # A and B of 4 targets in 4 layers
    expected = _peft_grads_in_megarl_layout(reference["grads"], job["arch"], ours)
    scale = max(g.abs().max() for g in reference["grads"].values())
    for module, (a_grad, b_grads) in expected.items():
        got_a = ours[f"{module}.lora_A"]
        assert torch.allclose(got_a, a_grad, atol=1e-5 * scale, rtol=1e-4), module
        unfused = to_hf({f"{module}.lora_A": got_a, f"{module}.lora_B": ours[f"{module}.lora_B"]}, job["arch"])
        for linear, b_grad in b_grads.items():
            assert torch.allclose(unfused[linear][1], b_grad, atol=1e-5 * scale, rtol=1e-4), linear
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in reference["grads"].values())).item()
    # peft's A gradients of a fused linear's members add up to megarl's one A gradient: compare norms in megarl's
    # layout, where each parameter is counted once.
    ours_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in ours.values())).item()
    assert ranks[0]["sft"]["sft/grad_norm"] == pytest.approx(ours_norm, rel=1e-4)
    assert norm > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_base_is_frozen_without_gradients_or_optimizer_state(job, layout):
    for out in job["out"]:
        facts = out[layout]["frozen"]
        assert facts["base_params"] > 0
        assert facts["base_requiring_grad"] == 0 and facts["base_with_grad"] == 0
        assert facts["optimizer_is_adapters"]
        assert facts["optimizer_state_params"] <= facts["adapter_numel"]  # Adam's moments: adapters only
        assert facts["grad_buffer_numel"] == facts["adapter_numel"]
        # The training state a rank keeps: every weight, and a gradient and two Adam moments (fp32) per adapter value.
        assert facts["train_state_bytes"] == facts["weight_bytes"] + 12 * facts["adapter_numel"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_merged_weights_equal_peft_merge(job, reference, layout):
    for out in job["out"]:
        merged = out[layout]["merged"]
        for name, tensor in reference["merged"].items():
            assert torch.allclose(merged[name], tensor, atol=1e-6, rtol=0), name
