"""HF weights in and out of this rank's Megatron GPT chunks.

`load_hf_weights` fills freshly built chunks from an HF safetensors dir, an in-memory
HF state dict, or seeded random weights generated in HF layout (so a seed means the
same model at every parallel layout). Each parameter of each chunk is written in
place from the HF slices that make this rank's shard (`megarl.models.megatron_pieces`):
from a checkpoint dir, every rank reads only those slices (`hf_reader`: safetensors slice
reads in bounded blocks), so no rank ever holds a full model, nor a full tensor it does
not own.
`hf_state_dict` is the inverse, for tests and small models: every rank ends up with
the full HF-named float32 CPU state dict (TP shards all-gathered, MoE experts
all-gathered over EP, PP stages broadcast).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from megatron.core import parallel_state

from megarl.engines.gpt import GPTModelChunks, chunk_weights
from megarl.engines.hf_reader import CheckpointSlices, StateDictSlices
from megarl.models.layout import (
    fill_from_pieces,
    hf_param_shapes,
    megatron_param_shapes,
    megatron_pieces,
    megatron_to_hf,
    random_hf_state_dict,
    tp_split_dim,
)
from megarl.models.sharding import (
    chunk_param_names,
    experts_per_rank,
    global_expert_name,
    is_expert,
    merge_shards,
    merge_tensor,
)
from megarl.models.spec import Arch

Tensor = torch.Tensor
_HEAD_PREFIX = "output_layer."


def check_source(shapes: Mapping[str, tuple[int, ...]], arch: Arch, *, backbone_only: bool, where: str) -> None:
    """ValueError naming every HF tensor the model needs that `shapes` lacks or has in another shape."""
    expected = hf_param_shapes(arch)
    if backbone_only:
        expected.pop("lm_head.weight", None)
    problems = [f"{name}: missing" for name in expected if name not in shapes]
    problems += [f"{name}: shape {shapes[name]} != {shape}" for name, shape in expected.items()
                 if name in shapes and tuple(shapes[name]) != shape]
    if problems:
        raise ValueError(f"{where} does not match the model config: " + "; ".join(problems[:8]))


def load_into_chunks(
    chunks: list[torch.nn.Module], arch: Arch, source, *, padded_vocab: int, backbone_only: bool,
    tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1,
) -> None:
    """Write the shard of every parameter of the model chunks of rank (tp, pp, ep) from `source`'s slices
    (an `hf_reader` source), in place; chunks may use either layer spec's names."""
    full_shapes = megatron_param_shapes(arch, padded_vocab=padded_vocab)
    chunk_names = chunk_param_names(
        full_shapes, num_layers=arch.num_layers, tie_word_embeddings=arch.tie_word_embeddings, pp_rank=pp_rank,
        pp_size=pp_size, vpp_size=len(chunks), ep_rank=ep_rank, ep_size=ep_size,
    )
    for chunk, names in zip(chunks, chunk_names):
        target = chunk_weights(chunk)
        if backbone_only:
            target = {name: t for name, t in target.items() if not name.startswith(_HEAD_PREFIX)}
            names = {name: full for name, full in names.items() if not name.startswith(_HEAD_PREFIX)}
        if set(target) != set(names):
            raise ValueError(
                f"weights do not fit the model chunk: missing {sorted(set(target) - set(names))[:5]}, "
                f"unexpected {sorted(set(names) - set(target))[:5]}"
            )
        for local, full in names.items():
            shape = list(full_shapes[full])
            dim = tp_split_dim(full)
            if dim is not None:
                shape[dim] //= tp_size
            if tuple(target[local].shape) != tuple(shape):
                raise ValueError(
                    f"{local}: the model chunk holds {tuple(target[local].shape)}, expected {tuple(shape)}")
            pieces = megatron_pieces(full, arch, padded_vocab=padded_vocab, tp_rank=tp_rank, tp_size=tp_size)
            with torch.no_grad():
                fill_from_pieces(target[local], pieces, source.copy_into)


def _load(model: GPTModelChunks, source, *, backbone_only: bool, where: str) -> None:
    check_source(source.shapes, model.arch, backbone_only=backbone_only, where=where)
    ps = parallel_state
    load_into_chunks(
        model.chunks, model.arch, source, padded_vocab=model.padded_vocab, backbone_only=backbone_only,
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
    )


def load_hf_state_dict(model: GPTModelChunks, hf_sd: Mapping[str, Tensor], *, backbone_only: bool = False) -> None:
    """Copy this rank's shards of a full HF state dict into the chunks.

    `backbone_only=True` (a value model) leaves the chunks' `output_layer.*` (the value head)
    alone and ignores the LM head of `hf_sd`.
    """
    _load(model, StateDictSlices(hf_sd, model.arch), backbone_only=backbone_only, where="HF state dict")


def load_hf_checkpoint(model: GPTModelChunks, path: str | Path, *, backbone_only: bool = False) -> None:
    """Read this rank's slices of an HF safetensors checkpoint dir into the chunks (`backbone_only` as above)."""
    _load(model, CheckpointSlices(path), backbone_only=backbone_only, where=f"HF checkpoint {path}")


def _flatten(tensors: list[Tensor], device) -> Tensor:
    if not tensors:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return torch.cat([t.detach().reshape(-1).to(device=device, dtype=torch.float32) for t in tensors])


def _unflatten(flat: Tensor, shapes: list[torch.Size]) -> list[Tensor]:
    sizes = [s.numel() for s in shapes]
    return [part.reshape(shape).cpu() for part, shape in zip(flat.split(sizes), shapes)]


def _tp_merged_chunks(model: GPTModelChunks, device: torch.device, weights_of) -> dict[tuple[int, str], Tensor]:
    """{(vpp chunk, name): full-TP tensor} of this rank's chunks: one all-gather of the flattened shards."""
    local = [(v, name, t) for v, chunk in enumerate(model.chunks) for name, t in sorted(weights_of(chunk).items())]
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


def _with_all_experts(merged: dict[tuple[int, str], Tensor], device: torch.device) -> dict[tuple[int, str], Tensor]:
    """`merged` with this rank's local experts replaced by every expert of the EP group (global names).

    All EP ranks hold the same number of equally shaped experts, so one all-gather of the
    flattened local experts suffices; rank r's local expert i is global expert r * n + i.
    """
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    experts = {key: t for key, t in merged.items() if is_expert(key[1])}
    if ep_size == 1 or not experts:
        return merged
    keys = sorted(experts)
    per_rank = experts_per_rank([name for _, name in keys], 1)
    flat = _flatten([experts[k] for k in keys], device)
    gathered = [torch.empty_like(flat) for _ in range(ep_size)]
    torch.distributed.all_gather(gathered, flat, group=parallel_state.get_expert_model_parallel_group())
    out = {key: t for key, t in merged.items() if key not in experts}
    for ep_rank, buffer in enumerate(gathered):
        for (vpp_rank, name), tensor in zip(keys, _unflatten(buffer, [experts[k].shape for k in keys])):
            out[(vpp_rank, global_expert_name(name, ep_rank, per_rank))] = tensor
    return out


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


def hf_state_dict(model: GPTModelChunks, weights_of=chunk_weights) -> dict[str, Tensor]:
    """The full HF state dict (float32, CPU) on every rank; a collective over the TP and PP groups.

    One all-gather over TP of this rank's flattened shards (`weights_of(chunk)`, by default the chunk's
    own weights; a LoRA engine passes its merged ones), and one over EP of its experts, then each PP
    rank broadcasts its merged chunks to the others. DP replicas hold the same weights and do not talk.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mine = _with_all_experts(_tp_merged_chunks(model, device, weights_of), device)
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


def load_hf_weights(
    model: GPTModelChunks, weights: str | Path | Mapping[str, Tensor] | None, *, seed: int = 0,
    backbone_only: bool = False,
) -> None:
    """Fill `model` from an HF checkpoint dir (slice reads), an HF state dict, or (None) random weights from `seed`
    (`backbone_only`: keep a value model's head)."""
    if weights is None:
        load_hf_state_dict(model, random_hf_state_dict(model.arch, seed=seed), backbone_only=backbone_only)
    elif isinstance(weights, Mapping):
        load_hf_state_dict(model, weights, backbone_only=backbone_only)
    else:
        load_hf_checkpoint(model, weights, backbone_only=backbone_only)
