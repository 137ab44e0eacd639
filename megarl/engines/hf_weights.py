"""HF weights in and out of this rank's Megatron GPT chunks.

`load_hf_weights` fills freshly built chunks from an HF safetensors dir, an in-memory
HF state dict, or seeded random weights generated in HF layout (so a seed means the
same model at every parallel layout). `hf_state_dict` is the inverse: every rank ends
up with the full HF-named float32 CPU state dict (TP shards all-gathered, MoE experts
all-gathered over EP, PP stages broadcast), which export and the reference model load use.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megarl.engines.gpt import GPTModelChunks
from megarl.models.layout import hf_to_megatron, megatron_to_hf, random_hf_state_dict
from megarl.models.sharding import (
    experts_per_rank,
    global_expert_name,
    is_expert,
    merge_shards,
    merge_tensor,
    shard_for_rank,
    tp_split_dim,
)

Tensor = torch.Tensor
_HEAD_PREFIX = "output_layer."


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


def load_hf_state_dict(model: GPTModelChunks, hf_sd: dict[str, Tensor], *, backbone_only: bool = False) -> None:
    """Convert a full HF state dict to this rank's shards and copy it into the chunks.

    `backbone_only=True` (a value model) leaves the chunks' `output_layer.*` (the value head)
    alone and ignores the LM head of `hf_sd`.
    """
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
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
    )
    for chunk, shard in zip(model.chunks, shards):
        target = _tensor_state(chunk)
        if backbone_only:
            target = {name: t for name, t in target.items() if not name.startswith(_HEAD_PREFIX)}
            shard = {name: t for name, t in shard.items() if not name.startswith(_HEAD_PREFIX)}
        if set(target) != set(shard):
            raise ValueError(
                f"weights do not fit the model chunk: missing {sorted(set(target) - set(shard))[:5]}, "
                f"unexpected {sorted(set(shard) - set(target))[:5]}"
            )
        with torch.no_grad():
            for name, tensor in shard.items():
                target[name].copy_(tensor)


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


def hf_state_dict(model: GPTModelChunks) -> dict[str, Tensor]:
    """The full HF state dict (float32, CPU) on every rank; a collective over the TP and PP groups.

    One all-gather over TP of this rank's flattened shards (and one over EP of its
    experts), then each PP rank broadcasts its merged chunks to the others. DP replicas
    hold the same weights and do not talk.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mine = _with_all_experts(_tp_merged_chunks(model, device), device)
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


def load_hf_weights(model: GPTModelChunks, weights: str | Path | dict[str, Tensor] | None, *, seed: int = 0) -> None:
    """Fill `model` from an HF checkpoint dir, an HF state dict, or (None) random weights from `seed`."""
    if weights is None:
        hf_sd = random_hf_state_dict(model.arch, seed=seed)
    elif isinstance(weights, dict):
        hf_sd = weights
    else:
        hf_sd = read_hf_checkpoint(weights)
    load_hf_state_dict(model, hf_sd)
