"""Megatron GPT forward (TP1 PP1, gloo, one spawned process) against HF transformers on the same weights.

The HF models are built and saved here (random weights, randomised norms and biases,
vocab 300 so Megatron pads it to 384); the engine loads the safetensors checkpoints
in a spawned rank and returns its logits / log-probs / entropy for one left- and
right-padded batch.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from _engine_spawn import run_spawned
from _engine_workers import forward_outputs

pytestmark = pytest.mark.dist

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
    attn_implementation="eager",
)
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False, rope_theta=5000.0)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False, head_dim=16)),
}
PROMPT, RESPONSE = 6, 7


def _batch() -> dict:
    gen = torch.Generator().manual_seed(11)
    rows = 5
    input_ids = torch.randint(0, 300, (rows, PROMPT + RESPONSE), generator=gen)
    mask = torch.ones(rows, PROMPT + RESPONSE, dtype=torch.long)
    for row, (left_pad, right_pad) in enumerate([(0, 0), (2, 3), (5, 0), (1, 6), (3, 1)]):
        mask[row, :left_pad] = 0
        mask[row, PROMPT + RESPONSE - right_pad :] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    models, checkpoints = {}, {}
    for name, (config_cls, model_cls, extra) in MODELS.items():
        torch.manual_seed(len(name))
        model = model_cls(config_cls(**TINY, **extra)).eval()
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "norm" in param_name or param_name.endswith("bias"):
                    param.uniform_(0.5, 1.5)
        model.save_pretrained(root / name)
        models[name], checkpoints[name] = model, str(root / name)
    batch = _batch()
    (results,) = run_spawned(forward_outputs, checkpoints=checkpoints, batch=batch, response_length=RESPONSE)
    return models, batch, results


def _hf_logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits.double()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_hf_with_left_padding(setup, name):
    models, batch, results = setup
    assert results[name]["padded_vocab"] == 384
    ours = results[name]["logits"].double()
    reference = _hf_logits(models[name], batch)
    valid = batch["attention_mask"].bool()
    assert reference[valid].abs().max() > 0.5  # the comparison is not between near-zero logits
    assert torch.allclose(ours[valid], reference[valid], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_log_probs_and_entropy_match_references(setup, name):
    models, batch, results = setup
    reference = _hf_logits(models[name], batch)[:, PROMPT - 1 : -1]  # position t predicts token t + 1
    targets = batch["input_ids"][:, PROMPT:]
    valid = batch["attention_mask"][:, PROMPT:].bool()
    for temperature, key in ((1.0, "log_probs"), (0.7, "log_probs_t07")):
        expected = torch.log_softmax(reference / temperature, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        got = results[name][key]
        assert got.shape == (5, RESPONSE) and got.dtype == torch.float32
        assert torch.allclose(got.double()[valid], expected[valid], atol=1e-5, rtol=0), key
    # Plain entropy: -sum_v p_v log p_v over the real vocab only (padding columns masked).
    probs = torch.softmax(reference, -1)
    entropy = -(probs * probs.log()).sum(-1)
    assert torch.allclose(results[name]["entropy"].double()[valid], entropy[valid], atol=1e-5, rtol=0)
    assert results[name]["entropy_t07"] is None
