"""Model architecture specs and HF <-> Megatron weight layouts (pure torch, no megatron import).

`spec` says which HF families are supported (Llama, Qwen2, Qwen3, Qwen3-MoE, registered in
`megarl.registry.MODEL_SPECS`) and their dimensions; `layout` converts state dicts between HF
names and the full Megatron layout (and says which HF slices make one TP rank's shard); `sharding` splits the full Megatron layout into per-rank TP/PP/VPP/EP shards
and merges them back.
"""

from megarl.models.layout import (
    TE_FUSED_NORMS,
    Piece,
    canonical_name,
    fill_from_pieces,
    hf_param_shapes,
    hf_sources,
    hf_to_megatron,
    megatron_param_shapes,
    megatron_pieces,
    megatron_to_hf,
    padded_vocab_size,
    random_hf_state_dict,
)
from megarl.models.sharding import (
    chunk_param_names,
    experts_per_rank,
    global_expert_name,
    global_layer_index,
    is_expert,
    merge_shards,
    shard_for_rank,
    tp_split_dim,
)
from megarl.models.spec import Arch, ModelSpec, arch_from_hf, get_spec, transformer_kwargs

__all__ = [
    "TE_FUSED_NORMS",
    "Arch",
    "ModelSpec",
    "Piece",
    "arch_from_hf",
    "canonical_name",
    "chunk_param_names",
    "experts_per_rank",
    "fill_from_pieces",
    "get_spec",
    "global_expert_name",
    "global_layer_index",
    "hf_param_shapes",
    "hf_sources",
    "hf_to_megatron",
    "is_expert",
    "megatron_param_shapes",
    "megatron_pieces",
    "megatron_to_hf",
    "merge_shards",
    "padded_vocab_size",
    "random_hf_state_dict",
    "shard_for_rank",
    "tp_split_dim",
    "transformer_kwargs",
]
