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
Megatron layout into per-rank shards and back. `megatron_pieces` says which slices of
which HF tensors make one TP rank's shard of a parameter, so a rank can read just its
own slices of a checkpoint (and `hf_to_megatron` is the same program at TP 1).
Transformer Engine's layer spec names two norms differently (`TE_FUSED_NORMS`);
`canonical_name` maps a model chunk's names onto the local-spec names used here.
Every function is pure tensor reshuffling (copies, no arithmetic), so round trips are
bitwise exact.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from megarl.models.spec import Arch

Tensor = torch.Tensor

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
# The scalar head of an HF *ForSequenceClassification reward model ([1, hidden], no bias). A reward model has
# no `lm_head.weight`: its backbone maps like a tied model's, and the engine keeps this head itself.
SCORE_HEAD = "score.weight"

EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)\.(.+)$")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Transformer Engine's layer spec fuses the pre-attention norm into linear_qkv and, in a
# dense layer, the pre-MLP norm into linear_fc1 (TELayerNormColumnParallelLinear); its
# state dict names them after the linear layer. Megatron's own local spec maps its norms
# to the same names in dist-checkpoints (`sharded_state_dict_keys_map`).
TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}

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


def canonical_name(name: str) -> str:
    """A model chunk's parameter name in the layout this module uses (the local spec's names).

    Transformer Engine's fused norm weights (`...linear_qkv.layer_norm_weight`,
    `...mlp.linear_fc1.layer_norm_weight`) become `...input_layernorm.weight` and
    `...pre_mlp_layernorm.weight`; every other name is the same in both layer specs.
    """
    for te_suffix, local_suffix in TE_FUSED_NORMS.items():
        if name.endswith("." + te_suffix):
            return name[: -len(te_suffix)] + local_suffix
    return name


def tp_split_dim(name: str) -> int | None:
    """The dim a Megatron parameter is split on across TP ranks (None: replicated).

    Column-parallel (output dim 0): linear_qkv (weight and bias), linear_fc1, the word
    embeddings and the output layer (vocab rows). Row-parallel (input dim 1):
    linear_proj, linear_fc2. Norms (incl. the per-head q/k norms and TE's fused
    `layer_norm_weight`), the MoE router and the experts (expert-TP = 1) are replicated.
    """
    if EXPERT_RE.match(name):
        return None
    if name in (EMBEDDING, OUTPUT) or name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


@dataclass(frozen=True)
class Piece:
    """`length` positions along `dim` of HF tensor `hf_name` from `src_start` go to `dst_start` of a Megatron
    tensor (the same dim: every fused or split Megatron tensor is a re-slicing of its HF tensors along one dim)."""

    hf_name: str
    dim: int
    src_start: int
    dst_start: int
    length: int


def megatron_param_shapes(arch: Arch, *, padded_vocab: int) -> dict[str, tuple[int, ...]]:
    """Every parameter of the full Megatron layout and its shape (vocab rows padded to `padded_vocab`)."""
    shapes: dict[str, tuple[int, ...]] = {EMBEDDING: (padded_vocab, arch.hidden_size)}
    for i in range(arch.num_layers):
        shapes.update({f"decoder.layers.{i}.{suffix}": shape for suffix, shape in _layer_param_shapes(arch).items()})
    shapes[FINAL_NORM] = (arch.hidden_size,)
    if not arch.tie_word_embeddings:
        shapes[OUTPUT] = (padded_vocab, arch.hidden_size)
    return shapes


@functools.lru_cache(maxsize=16)
def _layer_param_shapes(arch: Arch) -> dict[str, tuple[int, ...]]:
    """The parameters of one decoder layer (names after `decoder.layers.{i}.`) and their shapes."""
    h, d = arch.hidden_size, arch.head_dim
    qkv_rows = arch.num_query_groups * (arch.heads_per_group + 2) * d
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (qkv_rows, h),
    }
    if arch.qkv_bias:
        shapes["self_attention.linear_qkv.bias"] = (qkv_rows,)
    if arch.qk_layernorm:
        shapes["self_attention.q_layernorm.weight"] = (d,)
        shapes["self_attention.k_layernorm.weight"] = (d,)
    shapes["self_attention.linear_proj.weight"] = (h, arch.num_attention_heads * d)
    shapes["pre_mlp_layernorm.weight"] = (h,)
    if arch.is_moe:
        shapes["mlp.router.weight"] = (arch.num_experts, h)
        for e in range(arch.num_experts):
            shapes[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * arch.moe_ffn_hidden_size, h)
            shapes[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, arch.moe_ffn_hidden_size)
    else:
        shapes["mlp.linear_fc1.weight"] = (2 * arch.ffn_hidden_size, h)
        shapes["mlp.linear_fc2.weight"] = (h, arch.ffn_hidden_size)
    return shapes


def _tp_range(name: str, size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(start, length) of TP rank `tp_rank`'s contiguous share of `size` positions."""
    if size % tp_size:
        raise ValueError(f"{name}: {size} positions are not divisible by tp_size={tp_size}")
    share = size // tp_size
    return tp_rank * share, share


def megatron_pieces(name: str, arch: Arch, *, padded_vocab: int, tp_rank: int = 0, tp_size: int = 1) -> list[Piece]:
    """The HF slices that make TP rank `tp_rank`'s shard of full Megatron parameter `name` (tp_size 1: the
    whole parameter), in the order of the shard's positions along the split dim.

    Positions no piece covers are vocab padding rows (zero). The shard is the one
    `sharding.shard_tensor` cuts from the full tensor: whole query groups of the packed
    QKV, [gate_r; up_r] of fc1, a contiguous block of vocab rows or input columns.
    """
    dim = tp_split_dim(name)
    if name in (EMBEDDING, OUTPUT):
        start, rows = _tp_range(name, padded_vocab, tp_rank, tp_size)
        valid = max(0, min(start + rows, arch.vocab_size) - start)
        hf_name = "model.embed_tokens.weight" if name == EMBEDDING else "lm_head.weight"
        return [Piece(hf_name, 0, start, 0, valid)] if valid else []
    if name == FINAL_NORM:
        return [Piece("model.norm.weight", 0, 0, 0, arch.hidden_size)]
    match = _LAYER_RE.match(name)
    if match is None:
        raise KeyError(f"{name}: not a parameter of the Megatron GPT layout")
    hp, suffix = f"model.layers.{match.group(1)}.", match.group(2)
    expert = EXPERT_RE.match(name)
    if expert is not None:
        prefix, rows = f"{hp}mlp.experts.{expert.group(2)}.", arch.moe_ffn_hidden_size
        if expert.group(3) == "linear_fc1.weight":
            return [Piece(prefix + "gate_proj.weight", 0, 0, 0, rows),
                    Piece(prefix + "up_proj.weight", 0, 0, rows, rows)]
        return [Piece(prefix + "down_proj.weight", 0, 0, 0, arch.hidden_size)]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        d, q_rows = arch.head_dim, arch.heads_per_group * arch.head_dim
        first, groups = _tp_range(name, arch.num_query_groups, tp_rank, tp_size)
        pieces = []
        for local in range(groups):  # Megatron packs [q heads of the group; k; v] group by group
            group, base = first + local, local * (q_rows + 2 * d)
            pieces += [Piece(f"{hp}self_attn.q_proj.{kind}", 0, group * q_rows, base, q_rows),
                       Piece(f"{hp}self_attn.k_proj.{kind}", 0, group * d, base + q_rows, d),
                       Piece(f"{hp}self_attn.v_proj.{kind}", 0, group * d, base + q_rows + d, d)]
        return pieces
    if suffix == "mlp.linear_fc1.weight":
        start, rows = _tp_range(name, arch.ffn_hidden_size, tp_rank, tp_size)
        return [Piece(hp + "mlp.gate_proj.weight", 0, start, 0, rows),
                Piece(hp + "mlp.up_proj.weight", 0, start, rows, rows)]
    if suffix == "mlp.router.weight":
        return [Piece(hp + "mlp.gate.weight", 0, 0, 0, arch.num_experts)]
    if suffix not in _LAYER_SIMPLE:
        raise KeyError(f"{name}: not a parameter of the Megatron GPT layout")
    hf_name = hp + _LAYER_SIMPLE[suffix]
    size = _layer_param_shapes(arch)[suffix][dim or 0]
    start, length = _tp_range(name, size, tp_rank, tp_size) if dim is not None else (0, size)
    return [Piece(hf_name, dim or 0, start, 0, length)]


def hf_sources(arch: Arch, *, padded_vocab: int) -> dict[str, list[tuple[str, Piece]]]:
    """For every HF tensor, the (full Megatron parameter, piece) pairs it is cut from: `megatron_pieces` at TP 1,
    inverted. HF tensor `name` = each pair's `megatron[param].narrow(dim, dst_start, length)` at `src_start`."""
    sources: dict[str, list[tuple[str, Piece]]] = {name: [] for name in hf_param_shapes(arch)}
    for name in megatron_param_shapes(arch, padded_vocab=padded_vocab):
        for piece in megatron_pieces(name, arch, padded_vocab=padded_vocab):
            sources[piece.hf_name].append((name, piece))
    return sources


def fill_from_pieces(dest: Tensor, pieces: list[Piece], copy: Callable[[Tensor, Piece], None]) -> Tensor:
    """`copy(view, piece)` writes each piece's HF slice into its view of `dest`; positions no piece covers are
    zeroed. Returns `dest`."""
    covered = sum(piece.length for piece in pieces)
    if not pieces or covered != dest.shape[pieces[0].dim]:
        dest.zero_()
    for piece in pieces:
        copy(dest.narrow(piece.dim, piece.dst_start, piece.length), piece)
    return dest


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


def unpack_qkv(qkv: Tensor, arch: Arch) -> tuple[Tensor, Tensor, Tensor]:
    """The q, k and v rows of a packed QKV tensor ([rows, ...], packed per query group), in HF order."""
    groups, hpg, d = arch.num_query_groups, arch.heads_per_group, arch.head_dim
    rest = qkv.shape[1:]
    per_group = qkv.reshape(groups, (hpg + 2) * d, *rest)
    q, k, v = torch.split(per_group, [hpg * d, d, d], dim=1)
    return (
        q.reshape(groups * hpg * d, *rest).clone(),
        k.reshape(groups * d, *rest).clone(),
        v.reshape(groups * d, *rest).clone(),
    )


def split_fused_experts(hf_sd: Mapping[str, Tensor], arch: Arch) -> Mapping[str, Tensor]:
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
    hf_sd = split_fused_experts(hf_sd, arch)
    expected = hf_param_shapes(arch)
    problems = [f"{n}: missing" for n in expected if n not in hf_sd]
    problems += [
        f"{n}: shape {tuple(hf_sd[n].shape)} != {s}"
        for n, s in expected.items()
        if n in hf_sd and tuple(hf_sd[n].shape) != s
    ]
    if problems:
        raise ValueError("HF state dict does not match the config: " + "; ".join(problems[:8]))
    meg = {}
    for name, shape in megatron_param_shapes(arch, padded_vocab=padded_vocab).items():
        pieces = megatron_pieces(name, arch, padded_vocab=padded_vocab)
        like = hf_sd[pieces[0].hf_name]
        dest = torch.empty(shape, dtype=like.dtype, device=like.device)
        meg[name] = fill_from_pieces(
            dest, pieces, lambda view, p: view.copy_(hf_sd[p.hf_name].narrow(p.dim, p.src_start, p.length)))
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
        q, k, v = unpack_qkv(meg_sd[mp + "self_attention.linear_qkv.weight"], arch)
        hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"] = q, k, v
        if arch.qkv_bias:
            q, k, v = unpack_qkv(meg_sd[mp + "self_attention.linear_qkv.bias"], arch)
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
