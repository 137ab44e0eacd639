"""Build Megatron GPT models for this rank from an HF config, and move HF weights in and out.

`build_gpt` creates the model chunks this (TP rank, PP rank) holds (one per VPP chunk;
the embedding only on the first chunk, the output layer only on the last) with the
local layer spec, then loads HF weights (a safetensors dir, an in-memory state dict,
or seeded random weights generated in HF layout so a seed means the same model at
every parallel layout). `hf_state_dict` is the inverse: every rank ends up
with the full HF-named float32 CPU state dict (TP shards all-gathered, PP stages
broadcast), which weight sync v1 and checkpoint export use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.models.layout import hf_to_megatron, megatron_to_hf, padded_vocab_size, random_hf_state_dict
from megarl.models.sharding import merge_shards, merge_tensor, shard_for_rank, stage_roles, tp_split_dim
from megarl.models.spec import Arch, arch_from_hf

Tensor = torch.Tensor
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class GPTModelChunks:
    """The model chunks of this rank plus what is needed to map them back to HF."""

    chunks: list[GPTModel]
    arch: Arch
    config: TransformerConfig
    padded_vocab: int

    @property
    def vocab_start(self) -> int:
        """First vocab row of this TP rank's slice of the (padded) vocab."""
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        return parallel_state.get_tensor_model_parallel_rank() * (self.padded_vocab // tp_size)


def resolve_dtype(params_dtype: str | torch.dtype | None) -> torch.dtype:
    """None -> float32 on CPU, bfloat16 on GPU; names as in recipes ("bfloat16", ...)."""
    if params_dtype is None:
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if isinstance(params_dtype, torch.dtype):
        return params_dtype
    if params_dtype not in _DTYPES:
        raise ValueError(f"params_dtype={params_dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[params_dtype]


def transformer_config(arch: Arch, *, params_dtype: torch.dtype) -> TransformerConfig:
    """The TransformerConfig for `arch` at the parallel layout megatron was initialised with."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Weights always come from an HF-layout state dict (loaded or seeded), so
        # megatron's own initialisation would be wasted work.
        perform_initialization=False,
        use_cpu_initialization=True,
        # Fused kernels need CUDA extensions; the causal softmax kernel would also
        # ignore our padding mask.
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # Batched isend/irecv computes wrong VPP gradients on gloo (PLATFORM.md).
        batch_p2p_comm=False,
    )


def _build_chunk(arch: Arch, config: TransformerConfig, padded_vocab: int, vpp_rank: int | None) -> GPTModel:
    pp_rank, pp_size = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    vpp_size = config.virtual_pipeline_model_parallel_size or 1
    pre_process, post_process = stage_roles(pp_rank, pp_size, vpp_rank or 0, vpp_size)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=arch.qk_layernorm, normalization="RMSNorm"),
        vocab_size=padded_vocab,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rotary_base,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        vp_stage=vpp_rank,
    )
    # Megatron tags TP-split parameters only inside its weight initialisers, which we skip;
    # untagged, grad-norm and optimizer code would treat every shard as a TP replica.
    for name, param in model.named_parameters():
        dim = tp_split_dim(name)
        if dim is None:
            continue
        if not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)
        elif param.partition_dim != dim:
            raise ValueError(f"{name}: megatron splits dim {param.partition_dim}, the layout map says {dim}")
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def read_hf_checkpoint(path: str | Path) -> dict[str, Tensor]:
    """All tensors of an HF safetensors checkpoint dir (`model.safetensors` or a sharded index)."""
    from safetensors.torch import load_file

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
    state: dict[str, Tensor] = {}
    for name in files:
        state.update(load_file(str(path / name)))
    return state


def _tensor_state(chunk: GPTModel) -> dict[str, Tensor]:
    # Megatron's state dict also carries `_extra_state` entries (None without TE).
    return {name: value for name, value in chunk.state_dict().items() if isinstance(value, Tensor)}


def load_hf_state_dict(model: GPTModelChunks, hf_sd: dict[str, Tensor]) -> None:
    """Convert a full HF state dict to this rank's shards and copy it into the chunks."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    full = hf_to_megatron(hf_sd, model.arch, padded_vocab=model.padded_vocab)
    shards = shard_for_rank(
        full,
        num_layers=model.arch.num_layers,
        tie_word_embeddings=model.arch.tie_word_embeddings,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=tp_size,
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        vpp_size=len(model.chunks),
    )
    for chunk, shard in zip(model.chunks, shards):
        target = _tensor_state(chunk)
        if set(target) != set(shard):
            raise ValueError(
                f"weights do not fit the model chunk: missing {sorted(set(target) - set(shard))[:5]}, "
                f"unexpected {sorted(set(shard) - set(target))[:5]}"
            )
        with torch.no_grad():
            for name, tensor in shard.items():
                target[name].copy_(tensor)


def build_gpt(
    hf_config: dict,
    *,
    weights: str | Path | dict[str, Tensor] | None = None,
    seed: int = 0,
    params_dtype: str | torch.dtype | None = None,
    make_vocab_size_divisible_by: int = 128,
) -> GPTModelChunks:
    """This rank's GPT chunks for `hf_config`, loaded with `weights` (or random weights from `seed`)."""
    arch = arch_from_hf(hf_config)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    config = transformer_config(arch, params_dtype=resolve_dtype(params_dtype))
    padded_vocab = padded_vocab_size(
        arch.vocab_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by, tp_size=tp_size
    )
    vpp_size = config.virtual_pipeline_model_parallel_size
    vpp_ranks = list(range(vpp_size)) if vpp_size else [None]
    model = GPTModelChunks([_build_chunk(arch, config, padded_vocab, v) for v in vpp_ranks], arch, config, padded_vocab)
    if weights is None:
        hf_sd = random_hf_state_dict(arch, seed=seed)
    elif isinstance(weights, dict):
        hf_sd = weights
    else:
        hf_sd = read_hf_checkpoint(weights)
    load_hf_state_dict(model, hf_sd)
    return model


def _flatten(tensors: list[Tensor], device) -> Tensor:
    if not tensors:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return torch.cat([t.detach().reshape(-1).to(device=device, dtype=torch.float32) for t in tensors])


def _unflatten(flat: Tensor, shapes: list[torch.Size]) -> list[Tensor]:
    sizes = [s.numel() for s in shapes]
    return [part.reshape(shape).cpu() for part, shape in zip(flat.split(sizes), shapes)]


def _tp_merged_chunks(model: GPTModelChunks, device: torch.device) -> dict[tuple[int, str], Tensor]:
    """{(vpp chunk, name): full-TP tensor} of this rank's chunks: one all-gather of the flattened shards."""
    local = [(v, name, t) for v, chunk in enumerate(model.chunks) for name, t in sorted(_tensor_state(chunk).items())]
    shapes = [t.shape for _, _, t in local]
    flat = _flatten([t for _, _, t in local], device)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_size == 1:
        return {(v, name): t for (v, name, _), t in zip(local, _unflatten(flat, shapes))}
    gathered = [torch.empty_like(flat) for _ in range(tp_size)]
    torch.distributed.all_gather(gathered, flat, group=parallel_state.get_tensor_model_parallel_group())
    per_rank = [_unflatten(g, shapes) for g in gathered]
    return {
        (v, name): merge_tensor(name, [tensors[i] for tensors in per_rank])
        if tp_split_dim(name) is not None
        else per_rank[0][i]
        for i, (v, name, _) in enumerate(local)
    }


def _broadcast_stage(mine: dict, src: int, device: torch.device) -> dict[tuple[int, str], Tensor]:
    """PP rank `src`'s TP-merged chunks on every rank of the pipeline: names/shapes, then one flat buffer."""
    group = parallel_state.get_pipeline_model_parallel_group()
    src_global = torch.distributed.get_global_rank(group, src)
    is_src = src == parallel_state.get_pipeline_model_parallel_rank()
    meta = [[(key, t.shape) for key, t in mine.items()] if is_src else None]
    torch.distributed.broadcast_object_list(meta, src=src_global, group=group)
    shapes = [shape for _, shape in meta[0]]
    data = (
        _flatten(list(mine.values()), device)
        if is_src
        else torch.empty(sum(s.numel() for s in shapes), dtype=torch.float32, device=device)
    )
    torch.distributed.broadcast(data, src=src_global, group=group)
    return {key: t for (key, _), t in zip(meta[0], _unflatten(data, shapes))}


def hf_state_dict(model: GPTModelChunks) -> dict[str, Tensor]:
    """The full HF state dict (float32, CPU) on every rank; a collective over the TP and PP groups.

    One all-gather over TP of this rank's flattened shards, then each PP rank broadcasts its
    TP-merged chunks to the others. DP replicas hold the same weights and do not talk.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mine = _tp_merged_chunks(model, device)
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    stages = [mine] if pp_size == 1 else [_broadcast_stage(mine, src, device) for src in range(pp_size)]
    shards = {}
    for pp_rank, stage in enumerate(stages):
        for (vpp_rank, name), tensor in stage.items():
            shards.setdefault((0, pp_rank, vpp_rank), {})[name] = tensor
    full = merge_shards(
        shards,
        num_layers=model.arch.num_layers,
        tie_word_embeddings=model.arch.tie_word_embeddings,
        tp_size=1,
        pp_size=pp_size,
        vpp_size=len(model.chunks),
    )
    return megatron_to_hf(full, model.arch)
