"""HF <-> Megatron weight layouts: names, fused tensors, vocab padding and TP/PP sharding.

Three layouts meet here:
- HF: `model.layers.{i}.self_attn.q_proj.weight` ... (what checkpoints and SGLang use);
- full Megatron: one GPTModel state dict with Megatron's local-spec names, QKV packed
  per query group ([q heads of the group, k, v] for each group), fc1 = [gate; up],
  and the vocab padded to `padded_vocab_size` rows; MoE layers hold `mlp.router` and
  `mlp.experts.local_experts.{e}` with global expert indices (the HF checkpoint layout
  `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj`; transformers 5's in-memory fused
  `experts.gate_up_proj` / `experts.down_proj` are accepted as input too);
- a Megatron shard: what one (TP rank, PP rank, VPP chunk) model holds, with local
  layer indices.
`hf_to_megatron`/`megatron_to_hf` here convert the first two; `sharding` splits the full
Megatron layout into per-rank shards and back. Every function is pure tensor
reshuffling (copies, no arithmetic), so round trips are bitwise exact.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megarl.models.spec import Arch

Tensor = torch.Tensor

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
# The scalar head of an HF *ForSequenceClassification reward model ([1, hidden], no bias). A reward model has
# no `lm_head.weight`: its backbone maps like a tied model's, and the engine keeps this head itself.
SCORE_HEAD = "score.weight"

# Per-layer Megatron name -> HF name (the fused QKV and fc1 are handled separately).
_LAYER_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def padded_vocab_size(vocab_size: int, *, make_vocab_size_divisible_by: int = 128, tp_size: int = 1) -> int:
    """Megatron's padded vocab: the next multiple of divisible_by * tp (so every TP rank gets equal rows)."""
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def hf_param_shapes(arch: Arch) -> dict[str, tuple[int, ...]]:
    """Every HF parameter name of the model and its shape (lm_head only when untied)."""
    h, q_out, kv_out = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, h)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        if arch.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if arch.qk_layernorm:
            shapes[p + "self_attn.q_norm.weight"] = (arch.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (arch.head_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if arch.is_moe:
            shapes[p + "mlp.gate.weight"] = (arch.num_experts, h)
            for e in range(arch.num_experts):
                shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (arch.moe_ffn_hidden_size, h)
                shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (arch.moe_ffn_hidden_size, h)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, arch.moe_ffn_hidden_size)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (arch.ffn_hidden_size, h)
            shapes[p + "mlp.up_proj.weight"] = (arch.ffn_hidden_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, arch.ffn_hidden_size)
    shapes["model.norm.weight"] = (h,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    return shapes


def random_hf_state_dict(arch: Arch, *, seed: int) -> dict[str, Tensor]:
    """Deterministic random HF weights (normal(0, initializer_range), norms 1, biases 0).

    Generated in HF layout so the same seed gives the same model at every TP/PP layout.
    """
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in hf_param_shapes(arch).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            state[name] = torch.zeros(shape)
        else:
            state[name] = torch.randn(shape, generator=gen) * arch.initializer_range
    return state


def _pack_qkv(q: Tensor, k: Tensor, v: Tensor, arch: Arch) -> Tensor:
    """[q; k; v] (HF, head-major) -> Megatron's per-group packing [q_g heads, k_g, v_g] for each group."""
    groups, hpg, d = arch.num_query_groups, arch.heads_per_group, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(groups, hpg * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(groups * (hpg + 2) * d, *rest)


def _unpack_qkv(qkv: Tensor, arch: Arch) -> tuple[Tensor, Tensor, Tensor]:
    groups, hpg, d = arch.num_query_groups, arch.heads_per_group, arch.head_dim
    rest = qkv.shape[1:]
    per_group = qkv.reshape(groups, (hpg + 2) * d, *rest)
    q, k, v = torch.split(per_group, [hpg * d, d, d], dim=1)
    return (
        q.reshape(groups * hpg * d, *rest).clone(),
        k.reshape(groups * d, *rest).clone(),
        v.reshape(groups * d, *rest).clone(),
    )


def _pad_rows(weight: Tensor, rows: int) -> Tensor:
    if rows < weight.shape[0]:
        raise ValueError(f"padded vocab {rows} is smaller than the vocab {weight.shape[0]}")
    padded = weight.new_zeros((rows, *weight.shape[1:]))
    padded[: weight.shape[0]] = weight
    return padded


def _split_fused_experts(hf_sd: Mapping[str, Tensor], arch: Arch) -> Mapping[str, Tensor]:
    """transformers 5 keeps a MoE layer's experts as two 3-D tensors in memory
    (`experts.gate_up_proj` [E, 2I, H] = [gate; up] per expert, `experts.down_proj` [E, H, I]);
    checkpoints on disk use one tensor per expert and projection. Returns the latter."""
    if not arch.is_moe or not any(name.endswith("mlp.experts.gate_up_proj") for name in hf_sd):
        return hf_sd
    split = {}
    for name, tensor in hf_sd.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                split[f"{prefix}{e}.gate_proj.weight"], split[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e, down in enumerate(tensor):
                split[f"{prefix}{e}.down_proj.weight"] = down
        else:
            split[name] = tensor
    return split


def hf_to_megatron(hf_sd: Mapping[str, Tensor], arch: Arch, *, padded_vocab: int) -> dict[str, Tensor]:
    """Full HF state dict -> full Megatron state dict (vocab rows zero-padded to `padded_vocab`).

    A tied model's `lm_head.weight` (if present, it is the embedding) is ignored.
    """
    hf_sd = _split_fused_experts(hf_sd, arch)
    expected = hf_param_shapes(arch)
    problems = [f"{n}: missing" for n in expected if n not in hf_sd]
    problems += [
        f"{n}: shape {tuple(hf_sd[n].shape)} != {s}"
        for n, s in expected.items()
        if n in hf_sd and tuple(hf_sd[n].shape) != s
    ]
    if problems:
        raise ValueError("HF state dict does not match the config: " + "; ".join(problems[:8]))
    meg = {EMBEDDING: _pad_rows(hf_sd["model.embed_tokens.weight"], padded_vocab)}
    for i in range(arch.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for meg_name, hf_name in _LAYER_SIMPLE.items():
            if hp + hf_name in expected:
                meg[mp + meg_name] = hf_sd[hp + hf_name].clone()
        attn = hp + "self_attn."
        meg[mp + "self_attention.linear_qkv.weight"] = _pack_qkv(
            hf_sd[attn + "q_proj.weight"], hf_sd[attn + "k_proj.weight"], hf_sd[attn + "v_proj.weight"], arch
        )
        if arch.qkv_bias:
            meg[mp + "self_attention.linear_qkv.bias"] = _pack_qkv(
                hf_sd[attn + "q_proj.bias"], hf_sd[attn + "k_proj.bias"], hf_sd[attn + "v_proj.bias"], arch
            )
        if arch.is_moe:
            meg[mp + "mlp.router.weight"] = hf_sd[hp + "mlp.gate.weight"].clone()
            for e in range(arch.num_experts):
                expert, local = f"{hp}mlp.experts.{e}.", f"{mp}mlp.experts.local_experts.{e}."
                meg[local + "linear_fc1.weight"] = torch.cat(
                    [hf_sd[expert + "gate_proj.weight"], hf_sd[expert + "up_proj.weight"]]
                )
                meg[local + "linear_fc2.weight"] = hf_sd[expert + "down_proj.weight"].clone()
        else:
            meg[mp + "mlp.linear_fc1.weight"] = torch.cat(
                [hf_sd[hp + "mlp.gate_proj.weight"], hf_sd[hp + "mlp.up_proj.weight"]]
            )
    meg[FINAL_NORM] = hf_sd["model.norm.weight"].clone()
    if not arch.tie_word_embeddings:
        meg[OUTPUT] = _pad_rows(hf_sd["lm_head.weight"], padded_vocab)
    return meg


def megatron_to_hf(meg_sd: Mapping[str, Tensor], arch: Arch) -> dict[str, Tensor]:
    """Full Megatron state dict -> full HF state dict; vocab padding rows are dropped."""
    hf = {"model.embed_tokens.weight": meg_sd[EMBEDDING][: arch.vocab_size].clone()}
    for i in range(arch.num_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        for meg_name, hf_name in _LAYER_SIMPLE.items():
            if mp + meg_name in meg_sd:
                hf[hp + hf_name] = meg_sd[mp + meg_name].clone()
        attn = hp + "self_attn."
        q, k, v = _unpack_qkv(meg_sd[mp + "self_attention.linear_qkv.weight"], arch)
        hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"] = q, k, v
        if arch.qkv_bias:
            q, k, v = _unpack_qkv(meg_sd[mp + "self_attention.linear_qkv.bias"], arch)
            hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"] = q, k, v
        if arch.is_moe:
            hf[hp + "mlp.gate.weight"] = meg_sd[mp + "mlp.router.weight"].clone()
            for e in range(arch.num_experts):
                expert, local = f"{hp}mlp.experts.{e}.", f"{mp}mlp.experts.local_experts.{e}."
                gate, up = meg_sd[local + "linear_fc1.weight"].chunk(2, dim=0)
                hf[expert + "gate_proj.weight"], hf[expert + "up_proj.weight"] = gate.clone(), up.clone()
                hf[expert + "down_proj.weight"] = meg_sd[local + "linear_fc2.weight"].clone()
        else:
            gate, up = meg_sd[mp + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            hf[hp + "mlp.gate_proj.weight"], hf[hp + "mlp.up_proj.weight"] = gate.clone(), up.clone()
    hf["model.norm.weight"] = meg_sd[FINAL_NORM].clone()
    if not arch.tie_word_embeddings:
        hf["lm_head.weight"] = meg_sd[OUTPUT][: arch.vocab_size].clone()
    return hf
