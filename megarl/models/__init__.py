"""Model architecture specs and HF <-> Megatron weight layouts (pure torch, no megatron import).

`spec` says which HF families are supported and their dimensions; `layout` converts
state dicts between HF names and the full Megatron layout; `sharding` splits the full
Megatron layout into per-rank TP/PP/VPP shards and merges them back.
"""

from megarl.models.layout import (
    hf_param_shapes,
    hf_to_megatron,
    megatron_to_hf,
    padded_vocab_size,
    random_hf_state_dict,
)
from megarl.models.sharding import global_layer_index, merge_shards, shard_for_rank, tp_split_dim
from megarl.models.spec import MODEL_SPECS, Arch, ModelSpec, arch_from_hf, get_spec, transformer_kwargs

__all__ = [
    "MODEL_SPECS",
    "Arch",
    "ModelSpec",
    "arch_from_hf",
    "get_spec",
    "global_layer_index",
    "hf_param_shapes",
    "hf_to_megatron",
    "megatron_to_hf",
    "merge_shards",
    "padded_vocab_size",
    "random_hf_state_dict",
    "shard_for_rank",
    "tp_split_dim",
    "transformer_kwargs",
]
