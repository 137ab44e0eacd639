"""Model architecture specs and HF <-> Megatron weight layouts (pure torch, no megatron import).

`spec` says which HF families are supported (Llama, Qwen2, Qwen3, Qwen3-MoE) and their
dimensions; `layout` converts state dicts between HF names and the full Megatron
layout; `sharding` splits the full Megatron layout into per-rank TP/PP/VPP/EP shards
and merges them back.
"""

from megarl.models.layout import (
    hf_param_shapes,
    hf_to_megatron,
    megatron_to_hf,
    padded_vocab_size,
    random_hf_state_dict,
)
from megarl.models.sharding import (
    experts_per_rank,
    global_expert_name,
    global_layer_index,
    is_expert,
    merge_shards,
    shard_for_rank,
    tp_split_dim,
)
from megarl.models.spec import MODEL_SPECS, Arch, ModelSpec, arch_from_hf, get_spec, transformer_kwargs

__all__ = [
    "MODEL_SPECS",
    "Arch",
    "ModelSpec",
    "arch_from_hf",
    "experts_per_rank",
    "get_spec",
    "global_expert_name",
    "global_layer_index",
    "hf_param_shapes",
    "hf_to_megatron",
    "is_expert",
    "megatron_to_hf",
    "merge_shards",
    "padded_vocab_size",
    "random_hf_state_dict",
    "shard_for_rank",
    "tp_split_dim",
    "transformer_kwargs",
]
