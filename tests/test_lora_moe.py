"""LoRA on a Qwen3-MoE policy (adapters on attention and on every expert's linears) at EP1, EP2 and PP2.

peft cannot wrap transformers 5's fused expert tensors, so the reference is HF autograd on the
merged model: its logits are the adapted model's, and for an adapted linear y = (W + s B A) x
the chain rule gives dB = s G A^T and dA = s B^T G from the merged weight's gradient G (a
fused Megatron linear's members share A, so its dA sums over them). One 2-process job.
The engine computes W x + s B (A x), the reference (W + s B A) x: the two round differently in
float32, and routing weights amplify it (1.7e-5 at most on logits of order 1 measured), hence
5e-5 on logits where the dense test, with the same maths on both sides, needs 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from _engine_spawn import run_spawned
from _lora_workers import lora_outputs
from _tiny import hf_sft_backward, padded_sequences
from megarl.config.settings import LoraSettings
from megarl.models import arch_from_hf
from megarl.models.lora import TARGETS, hf_deltas, hf_module, initial_adapters, merge_adapter, to_hf

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
              initializer_range=0.1, tie_word_embeddings=False, attn_implementation="eager", norm_topk_prob=True)
LAYOUTS = {"ep1": dict(tp=1, pp=1, ep=1), "ep2": dict(tp=1, pp=1, ep=2), "pp2": dict(tp=1, pp=2, ep=1)}
SETTINGS = LoraSettings(rank=2, alpha=4.0, dropout=0.0, targets=tuple(TARGETS), init="gaussian", seed=1)
PROMPT, RESPONSE, ROWS = 5, 6, 6


def _fused_names(name: str) -> tuple[str, slice | None, int | None]:
    """An HF checkpoint name -> (the in-memory parameter, the rows of it for an expert, the expert)."""
    if ".experts." not in name:
        return name, None, None
    head, rest = name.split(".experts.")
    expert, linear = rest.split(".")[:2]
    if linear == "down_proj":
        return f"{head}.experts.down_proj", None, int(expert)
    half = CONFIG["moe_intermediate_size"]
    rows = slice(0, half) if linear == "gate_proj" else slice(half, 2 * half)
    return f"{head}.experts.gate_up_proj", rows, int(expert)


def _view(tensors: dict, name: str) -> torch.Tensor:
    param, rows, expert = _fused_names(name)
    tensor = tensors[param]
    if expert is not None:
        tensor = tensor[expert]
    return tensor[rows] if rows is not None else tensor


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-moe")
    torch.manual_seed(3)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif "experts" in name or "gate" in name:
                param.normal_(0, 0.1)
    model.save_pretrained(root / "hf")
    arch = arch_from_hf(model.config.to_dict())
    adapters = initial_adapters(arch, rank=SETTINGS.rank, targets=SETTINGS.targets, init="gaussian", seed=1)
    generator = torch.Generator().manual_seed(4)
    adapters = {n: torch.randn(t.shape, generator=generator) * 0.3 if n.endswith("lora_B") else t
                for n, t in adapters.items()}
    batch = padded_sequences(torch.Generator().manual_seed(6), rows=ROWS, prompt=PROMPT, response=RESPONSE, vocab=300)
    batch["loss_mask"] = batch["attention_mask"].clone()
    batch["loss_mask"][:, :PROMPT] = 0
    out = run_spawned(lora_outputs, world_size=2, layouts=LAYOUTS, checkpoint=str(root / "hf"), settings=SETTINGS,
                      adapters=adapters, batch=batch, response_length=RESPONSE)
    return {"model": model, "arch": arch, "adapters": adapters, "batch": batch, "out": out}


@pytest.fixture(scope="module")
def reference(job):
    """HF autograd on the merged model: logits, loss, and each adapted HF linear's (A, B, weight gradient)."""
    scale = SETTINGS.alpha / SETTINGS.rank
    model = job["model"]
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, delta in hf_deltas(job["adapters"], job["arch"], scale=scale).items():
            _view(params, name).add_(delta)
    merged_state = {k: v.clone() for k, v in model.state_dict().items()}
    logits, loss = hf_sft_backward(model, job["batch"])
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.load_state_dict(base_state)
    with torch.no_grad():
        inputs = {k: job["batch"][k] for k in ("input_ids", "attention_mask", "position_ids")}
        base_logits = model(**inputs).logits
    linears = {linear: (a, b, _view(grads, f"{linear}.weight"))
               for linear, (a, b) in to_hf(job["adapters"], job["arch"]).items()}
    return {"logits": logits.double(), "base_logits": base_logits.double(), "loss": loss, "linears": linears,
            "merged": merged_state, "scale": scale}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_lora_logits_match_merged_hf(job, reference, layout):
    valid = job["batch"]["attention_mask"].bool()
    assert (reference["logits"] - reference["base_logits"])[valid].abs().max() > 0.1
    for out in job["out"]:
        ours = out[layout]
        assert torch.allclose(ours["logits"].double()[valid], reference["logits"][valid], atol=5e-5, rtol=0)
        assert torch.allclose(ours["logits_off"].double()[valid], reference["base_logits"][valid], atol=1e-5, rtol=0)
        assert ours["sft"]["sft/loss"] == pytest.approx(reference["loss"], abs=1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_adapter_gradients_follow_the_chain_rule(job, reference, layout):
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for out in job["out"]:
        for name, (tp_rank, grad) in out[layout]["grads"].items():
            shards.setdefault(name, {})[tp_rank] = grad
    ours = {name: merge_adapter(name, [parts[r] for r in sorted(parts)]) for name, parts in shards.items()}
    assert sum(".experts." in name for name in ours) == 2 * 2 * 4 * 2  # A, B x fc1, fc2 x 4 experts x 2 layers
    unfused = to_hf(ours, job["arch"])  # per HF linear: (its module's dA, its rows of dB)
    s = reference["scale"]
    for module in {name.rsplit(".", 1)[0] for name in ours}:
        parent, linears = hf_module(module)
        members = [reference["linears"][parent + linear] for linear in linears]
        top = max(weight_grad.abs().max() for _, _, weight_grad in members)
        expected_a = sum(s * b.t() @ weight_grad for _, b, weight_grad in members)
        assert torch.allclose(ours[f"{module}.lora_A"], expected_a, atol=1e-5 * top, rtol=1e-4), module
        for linear, (a, _, weight_grad) in zip(linears, members):
            got_b = unfused[parent + linear][1]
            assert torch.allclose(got_b, s * weight_grad @ a.t(), atol=1e-5 * top, rtol=1e-4), parent + linear


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_merged_weights_gather_every_expert(job, reference, layout):
    merged = reference["merged"]
    for out in job["out"]:
        ours = out[layout]["merged"]
        for name in ours:
            if ".experts." in name:
                param, rows, expert = _fused_names(name)
                expected = merged[param][expert] if rows is None else merged[param][expert][rows]
            else:
                expected = merged[name]
            assert torch.allclose(ours[name], expected, atol=1e-6, rtol=0), name

