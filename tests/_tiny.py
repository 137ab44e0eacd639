"""Tiny HF models for tests: one set of sizes and families for every test that builds a model from a config.

Random weights from a seed (no hub is reachable); `randomise_norms` gives norms and biases random values
too, since HF starts them at 1 and 0 and a swapped or missing one would hide behind those.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from megarl.data.padding import position_ids_from_mask

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False, head_dim=16)),
}

# The model the rollout tests' CPU-engine servers serve (fleet, client, router): the builtin tokenizer's
# 512-token vocabulary and HF's default initialisation.
SERVED = dict(vocab_size=512, intermediate_size=128, max_position_embeddings=256, initializer_range=0.02)
# The GPU engine tests' Qwen3: large enough for bf16 kernels to differ from fp32 ones, head_dim 32.
GPU_QWEN3 = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, initializer_range=0.1)


def tiny_config(family: str, **overrides):
    config_cls, _, extra = FAMILIES[family]
    return config_cls(**{**TINY, **extra, **overrides})


def tiny_model(family: str, *, seed: int, randomise_norms: bool = False, **overrides):
    """A tiny `family` model (eval mode) with weights drawn after `torch.manual_seed(seed)`."""
    _, model_cls, _ = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(tiny_config(family, **overrides)).eval()
    if randomise_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    param.normal_()
    return model


def served_model(seed: int):
    """The rollout tests' served Llama (`SERVED`), weights from `seed`."""
    return tiny_model("llama", seed=seed, **SERVED)


def greedy_continuation(model, prompt: list[int], steps: int) -> list[int]:
    """Plain argmax decoding with a full forward per token (no cache, no padding): the reference a server's greedy
    output must equal."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


# (left padding of the prompt, response length) per row: unequal token counts in every micro-batch split.
UNEVEN_ROWS = [(0, 6), (2, 1), (4, 3), (1, 6), (0, 2), (3, 5), (2, 4), (1, 1)]


def padded_sequences(generator: torch.Generator, *, rows: int, prompt: int, response: int, vocab: int) -> dict:
    """Random token rows of left-padded prompts + right-padded responses (spans from UNEVEN_ROWS): input_ids,
    attention_mask, position_ids [rows, prompt + response] and the integer response_mask [rows, response]."""
    input_ids = torch.randint(0, vocab, (rows, prompt + response), generator=generator)
    mask = torch.ones_like(input_ids)
    for row, (left_pad, length) in enumerate(UNEVEN_ROWS[:rows]):
        mask[row, :left_pad] = 0
        mask[row, prompt + length :] = 0
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask),
            "response_mask": mask[:, prompt:].clone()}


def hf_sft_backward(model, batch: dict) -> tuple[torch.Tensor, float]:
    """The engines' SFT loss written out on an HF model (token-mean NLL over `loss_mask`, each token predicted
    from the tokens before it), differentiated by autograd: (logits, loss); the gradients are left in .grad."""
    model.zero_grad()
    logits = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
    mask = batch["loss_mask"][:, 1:].float()
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    loss = (nll * mask).sum() / mask.sum()
    loss.backward()
    return logits.detach(), loss.item()
