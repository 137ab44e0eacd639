"""TP / PP / VPP / EP sharding of a full Megatron GPT state dict (pure functions, no megatron import).

Which dim each parameter is split on across TP ranks (`tp_split_dim`, defined with the
layout), how the fused tensors split
(QKV is packed per query group, so whole groups go to a rank; fc1 = [gate; up] gives
each rank [gate_r; up_r]), where a global layer lives (PP rank, VPP chunk, local
index), which MoE experts an EP rank holds (a contiguous block, renumbered from 0;
experts are never TP-split: the engines run expert-TP = 1), which parameters a model
chunk holds (`chunk_param_names`), and `shard_for_rank` /
`merge_shards` between the full layout of `megarl.models.layout` and the state dicts
the per-rank model chunks hold.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from megarl.models.layout import EMBEDDING, EXPERT_RE, FINAL_NORM, OUTPUT, tp_split_dim

Tensor = torch.Tensor
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def shard_tensor(name: str, full: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    """This TP rank's slice of one full Megatron tensor.

    QKV needs no special case: it is packed group-major, so a contiguous dim-0 chunk is
    whole query groups. fc1 = [gate; up] must give each rank [gate_r; up_r].
    """
    dim = tp_split_dim(name)
    if dim is None or tp_size == 1:
        return full.clone()
    if full.shape[dim] % tp_size:
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} is not divisible by tp_size={tp_size}")
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
    return full.chunk(tp_size, dim=dim)[tp_rank].clone()


def merge_tensor(name: str, shards: list[Tensor]) -> Tensor:
    """Inverse of `shard_tensor`: the full tensor from all TP ranks' slices (in rank order)."""
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0].clone()
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=dim)


def layers_per_chunk(num_layers: int, pp_size: int, vpp_size: int = 1) -> int:
    if num_layers % (pp_size * vpp_size):
        raise ValueError(f"num_layers={num_layers} is not divisible by pp_size*vpp_size={pp_size}*{vpp_size}")
    return num_layers // (pp_size * vpp_size)


def global_layer_index(
    local_index: int, *, num_layers: int, pp_rank: int, pp_size: int, vpp_rank: int = 0, vpp_size: int = 1
) -> int:
    """Global layer of local layer `local_index` in VPP chunk `vpp_rank` of PP rank `pp_rank`.

    Megatron's interleaved order: chunk v of rank p holds layers
    [(v * pp_size + p) * L, (v * pp_size + p + 1) * L) with L = num_layers / (pp * vpp).
    """
    per_chunk = layers_per_chunk(num_layers, pp_size, vpp_size)
    return (vpp_rank * pp_size + pp_rank) * per_chunk + local_index


def stage_roles(pp_rank: int, pp_size: int, vpp_rank: int = 0, vpp_size: int = 1) -> tuple[bool, bool]:
    """(pre_process, post_process): does this model chunk hold the embedding / the output layer."""
    first = pp_rank == 0 and vpp_rank == 0
    last = pp_rank == pp_size - 1 and vpp_rank == vpp_size - 1
    return first, last


def is_expert(name: str) -> bool:
    """Whether a Megatron parameter belongs to an MoE expert (`...mlp.experts.local_experts.{e}...`)."""
    return EXPERT_RE.match(name) is not None


def experts_per_rank(names: Iterable[str], ep_size: int) -> int:
    """Experts each of `ep_size` EP ranks holds, from the expert indices in `names` (0: dense model)."""
    experts = {int(m.group(2)) for m in map(EXPERT_RE.match, names) if m}
    if experts and len(experts) % ep_size:
        raise ValueError(f"{len(experts)} experts are not divisible by ep_size={ep_size}")
    return len(experts) // ep_size


def _local_expert_name(name: str, ep_rank: int, per_rank: int) -> str | None:
    """The name on EP rank `ep_rank` of a (global-index) expert tensor, None if it lives elsewhere;
    other names unchanged."""
    match = EXPERT_RE.match(name)
    if match is None:
        return name
    expert = int(match.group(2))
    if expert // per_rank != ep_rank:
        return None
    return f"{match.group(1)}{expert % per_rank}.{match.group(3)}"


def global_expert_name(name: str, ep_rank: int, per_rank: int) -> str:
    """Inverse of the EP renumbering: a local expert tensor name -> its global-index name."""
    match = EXPERT_RE.match(name)
    if match is None:
        return name
    return f"{match.group(1)}{ep_rank * per_rank + int(match.group(2))}.{match.group(3)}"


def chunk_param_names(
    full_names: Iterable[str],
    *,
    num_layers: int,
    tie_word_embeddings: bool,
    pp_rank: int,
    pp_size: int,
    vpp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> list[dict[str, str]]:
    """Per VPP chunk of a (pp_rank, ep_rank) model: {local name: the full-layout parameter it is a shard of}.

    Local names carry local layer (and expert) indices. With tied embeddings and PP > 1 the
    last stage holds its own copy of the embedding as `output_layer.weight` (Megatron keeps
    the two in sync by an all-reduce of grads).
    """
    full_names = list(full_names)
    per_chunk = layers_per_chunk(num_layers, pp_size, vpp_size)
    block = experts_per_rank(full_names, ep_size)
    chunks = []
    for vpp_rank in range(vpp_size):
        first, last = stage_roles(pp_rank, pp_size, vpp_rank, vpp_size)
        chunk: dict[str, str] = {}
        if first:
            chunk[EMBEDDING] = EMBEDDING
        for local in range(per_chunk):
            layer = global_layer_index(
                local, num_layers=num_layers, pp_rank=pp_rank, pp_size=pp_size, vpp_rank=vpp_rank, vpp_size=vpp_size
            )
            prefix = f"decoder.layers.{layer}."
            for name in full_names:
                if not name.startswith(prefix):
                    continue
                local_name = _local_expert_name(f"decoder.layers.{local}.{name[len(prefix) :]}", ep_rank, block)
                if local_name is not None:
                    chunk[local_name] = name
        if last:
            chunk[FINAL_NORM] = FINAL_NORM
            if not tie_word_embeddings:
                chunk[OUTPUT] = OUTPUT
            elif not first:
                chunk[OUTPUT] = EMBEDDING
        chunks.append(chunk)
    return chunks


def shard_for_rank(
    full_sd: Mapping[str, Tensor],
    *,
    num_layers: int,
    tie_word_embeddings: bool,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    vpp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> list[dict[str, Tensor]]:
    """The state dicts (one per VPP chunk) a (tp_rank, pp_rank, ep_rank) model holds, local layer
    (and expert) names (which parameters: `chunk_param_names`)."""
    chunks = chunk_param_names(full_sd, num_layers=num_layers, tie_word_embeddings=tie_word_embeddings,
                               pp_rank=pp_rank, pp_size=pp_size, vpp_size=vpp_size, ep_rank=ep_rank, ep_size=ep_size)
    return [{local: shard_tensor(full, full_sd[full], tp_rank, tp_size) for local, full in names.items()}
            for names in chunks]


def merge_shards(
    shards: Mapping[tuple[int, int, int], Mapping[str, Tensor]],
    *,
    num_layers: int,
    tie_word_embeddings: bool,
    tp_size: int,
    pp_size: int,
    vpp_size: int = 1,
    ep_size: int = 1,
) -> dict[str, Tensor]:
    """Inverse of `shard_for_rank`: `shards[(tp_rank, pp_rank, vpp_rank)]` (with `ep_size` > 1:
    `shards[(tp_rank, pp_rank, vpp_rank, ep_rank)]`) -> the full Megatron state dict.

    The last stage's tied `output_layer.weight` copy is dropped (it equals the embedding).
    """
    by_name: dict[str, list[Tensor | None]] = {}
    for key, chunk in shards.items():
        tp_rank, pp_rank, vpp_rank = key[:3]
        ep_rank = key[3] if ep_size > 1 else 0
        block = experts_per_rank(chunk, 1)
        first, last = stage_roles(pp_rank, pp_size, vpp_rank, vpp_size)
        for name, tensor in chunk.items():
            if name == OUTPUT and tie_word_embeddings and last and not first:
                continue
            match = _LAYER_RE.match(name)
            if match:
                layer = global_layer_index(
                    int(match.group(1)),
                    num_layers=num_layers,
                    pp_rank=pp_rank,
                    pp_size=pp_size,
                    vpp_rank=vpp_rank,
                    vpp_size=vpp_size,
                )
                name = global_expert_name(f"decoder.layers.{layer}.{match.group(2)}", ep_rank, block)
            by_name.setdefault(name, [None] * tp_size)[tp_rank] = tensor
    missing = [
        f"{name} (tp ranks {[r for r, t in enumerate(ts) if t is None]})" for name, ts in by_name.items() if None in ts
    ]
    if missing:
        raise ValueError("merge_shards: missing TP shards for " + ", ".join(missing[:8]))
    return {name: merge_tensor(name, tensors) for name, tensors in by_name.items()}
