"""The resharding plan: which bytes of which Megatron shard make each full HF tensor, who sends it, in which bucket.

Built once from the trainer layout (TP, PP, VPP, DP sizes) and the HF config; pure,
no process group. The plan's output unit is a full HF tensor, because SGLang's
loader takes full HF tensors and shards them for its own TP itself.

The layout maths is not re-derived here: the plan *probes* `megarl.models`. Each
full Megatron parameter is replaced by a tiny tensor that keeps only its TP-split
dim (other dims 1) and holds "parameter id, position" codes; running that through
`megatron_to_hf` and `shard_tensor` shows where every position of every HF tensor
comes from (fused QKV split per query group, fc1 into gate/up, vocab padding
dropped, TP shards concatenated). Compressed into runs of consecutive positions,
that becomes a copy program: `assemble_bucket` writes each HF tensor straight
into its slot of a flat bucket buffer from the TP shards, one copy per byte.

Senders: one per HF tensor, TP rank 0 / DP rank 0 of the PP stage that owns it
(after a TP gather within the stage); with tied embeddings and PP > 1 the last
stage's output-layer copy is not sent. MoE experts (never TP-split) are sent by
the EP rank that holds them, renamed to their global expert index, so the EP
ranks of a stage send in parallel. Buckets are per (PP stage, EP rank), capped in
bytes; dense parameters go with EP rank 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable

import torch

from megarl.models import experts_per_rank, global_expert_name, global_layer_index, hf_param_shapes, hf_to_megatron
from megarl.models import is_expert, megatron_to_hf, padded_vocab_size, shard_for_rank, tp_split_dim
from megarl.models.sharding import shard_tensor
from megarl.models.spec import Arch

Tensor = torch.Tensor
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_ID_STRIDE = 2**32  # probe code = parameter index * stride + position (exact in float64)


@dataclass(frozen=True)
class TrainerLayout:
    """The trainer's parallel layout. EP splits the DP ranks of a stage (Megatron's default
    order: tp-cp-ep-dp-pp with cp = 1, so DP rank r < ep holds EP rank r's experts)."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    ep: int = 1

    def global_rank(self, *, tp_rank: int, pp_rank: int, dp_rank: int = 0) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)


@dataclass(frozen=True)
class Run:
    """`length` consecutive positions along the split dim: TP shard `tp_rank`[src:] -> HF tensor[dst:]."""

    tp_rank: int
    src_start: int
    dst_start: int
    length: int


@dataclass(frozen=True)
class HFTensor:
    """One full HF tensor: its slot in the bucket buffer and the runs that fill it."""

    name: str
    shape: tuple[int, ...]
    dim: int
    runs: tuple[Run, ...]
    offset: int = 0  # bytes, inside the bucket buffer
    nbytes: int = 0


@dataclass(frozen=True)
class ParamPlan:
    """One Megatron parameter: where it lives on the trainer and the HF tensors made from it."""

    name: str  # global name (global layer and expert index)
    local_name: str  # name inside its model chunk
    pp_rank: int
    vpp_rank: int
    split_dim: int | None  # TP split dim; None = replicated (TP rank 0's copy is used)
    shard_shape: tuple[int, ...]
    outputs: tuple[HFTensor, ...]
    ep_rank: int = 0  # the EP rank holding it (experts); 0 for dense parameters

    @property
    def shard_numel(self) -> int:
        return _numel(self.shard_shape)


@dataclass(frozen=True)
class Bucket:
    """A size-capped group of parameters of one (PP stage, EP rank), sent as one flat buffer by `sender_rank`."""

    index: int
    pp_rank: int
    sender_rank: int
    params: tuple[ParamPlan, ...]
    nbytes: int
    dtype: torch.dtype
    ep_rank: int = 0

    @property
    def tensors(self) -> tuple[HFTensor, ...]:
        return tuple(out for param in self.params for out in param.outputs)


@dataclass(frozen=True)
class ReshardPlan:
    arch: Arch
    layout: TrainerLayout
    dtype: torch.dtype
    padded_vocab: int
    buckets: tuple[Bucket, ...]

    def stage_buckets(self, pp_rank: int, ep_rank: int | None = None) -> tuple[Bucket, ...]:
        """The buckets of PP stage `pp_rank` (only EP rank `ep_rank`'s, if given)."""
        return tuple(bucket for bucket in self.buckets
                     if bucket.pp_rank == pp_rank and ep_rank in (None, bucket.ep_rank))

    def hf_names(self) -> list[str]:
        return [tensor.name for bucket in self.buckets for tensor in bucket.tensors]

    @property
    def nbytes(self) -> int:
        return sum(bucket.nbytes for bucket in self.buckets)


def build_plan(
    arch: Arch,
    layout: TrainerLayout,
    *,
    dtype: torch.dtype,
    bucket_bytes: int,
    padded_vocab: int | None = None,
    only: frozenset[str] | None = None,
) -> ReshardPlan:
    """The plan for sending a model trained at `layout` (parameters of `dtype`) as full HF tensors.

    `arch`: `megarl.models.arch_from_hf(hf_config)`; `padded_vocab`: the engine's padded
    vocab (default: Megatron's padding to a multiple of 128 * TP); `only`: the global names of the
    Megatron parameters to send (a LoRA policy's adapted linears), with the HF tensors made from them.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    padded = padded_vocab or padded_vocab_size(arch.vocab_size, tp_size=layout.tp)
    meta_hf = {name: torch.empty(shape, device="meta") for name, shape in hf_param_shapes(arch).items()}
    full = hf_to_megatron(meta_hf, arch, padded_vocab=padded)
    outputs = _probe_outputs(full, arch, layout.tp)
    if layout.ep > 1 and layout.dp % layout.ep:
        raise ValueError(f"ep={layout.ep} must divide dp={layout.dp} (EP ranks are DP ranks of a stage)")
    buckets: list[Bucket] = []
    for pp_rank in range(layout.pp):
        for ep_rank in range(layout.ep):
            params = [param for param in _stage_params(full, outputs, arch, layout, pp_rank, ep_rank)
                      if only is None or param.name in only]
            sender = layout.global_rank(tp_rank=0, pp_rank=pp_rank, dp_rank=ep_rank)
            buckets += _bucketize(params, pp_rank=pp_rank, ep_rank=ep_rank, sender=sender, dtype=dtype,
                                  cap=bucket_bytes, first_index=len(buckets))
    sent = [t.name for b in buckets for t in b.tensors]
    expected = set(meta_hf) if only is None else {out.name for name in only for out in outputs[name]}
    if sorted(sent) != sorted(expected):
        raise ValueError(f"plan does not cover the HF tensors exactly once: missing {sorted(expected - set(sent))[:5]}, "
                         f"sent {len(sent)} for {len(expected)}")
    return ReshardPlan(arch, layout, dtype, padded, tuple(buckets))


def assemble_bucket(
    bucket: Bucket, shard_of: Callable[[ParamPlan, int], Tensor], *, out: Tensor | None = None,
    only_tp_rank: int | None = None,
) -> list[tuple[str, Tensor]]:
    """The bucket's HF tensors, written into `out` (a uint8 buffer of >= bucket.nbytes) from the TP shards.

    `shard_of(param, tp_rank)` returns that TP rank's shard of `param` (the param's shard
    shape; another dtype is cast). Returns (name, view of `out` in the bucket's dtype) pairs.
    With `only_tp_rank`, only the runs that rank's shards fill are written (replicated
    parameters belong to TP rank 0): TP ranks sharing `out` in memory each write their part.
    """
    if out is None:
        out = torch.empty(bucket.nbytes, dtype=torch.uint8, device=shard_of(bucket.params[0], 0).device)
    if out.dtype != torch.uint8 or out.numel() < bucket.nbytes:
        raise ValueError(f"bucket {bucket.index}: out must be a uint8 buffer of >= {bucket.nbytes} bytes")
    named = []
    for param in bucket.params:
        shards: dict[int, Tensor] = {}
        for hf in param.outputs:
            dest = out[hf.offset : hf.offset + hf.nbytes].view(bucket.dtype).view(hf.shape)
            for run in hf.runs:
                if only_tp_rank is not None and run.tp_rank != only_tp_rank:
                    continue
                if run.tp_rank not in shards:
                    shards[run.tp_rank] = shard_of(param, run.tp_rank)
                source = shards[run.tp_rank].narrow(hf.dim, run.src_start, run.length)
                dest.narrow(hf.dim, run.dst_start, run.length).copy_(source)
            named.append((hf.name, dest))
    return named


def _probe_outputs(full: dict[str, Tensor], arch: Arch, tp: int) -> dict[str, tuple[HFTensor, ...]]:
    """For every full Megatron parameter, the HF tensors it becomes, as runs over its TP shards."""
    names = list(full)
    dims = {name: tp_split_dim(name) or 0 for name in names}
    probes = {}
    for index, name in enumerate(names):
        shape, dim = full[name].shape, dims[name]
        probe_shape = [size if d == dim else 1 for d, size in enumerate(shape)]
        codes = torch.arange(shape[dim], dtype=torch.float64) + index * _ID_STRIDE
        probes[name] = codes.reshape([-1 if d == dim else 1 for d in range(len(shape))]).expand(probe_shape).clone()
    hf_probes = megatron_to_hf(probes, arch)
    hf_shapes = hf_param_shapes(arch)
    by_param: dict[str, list[HFTensor]] = {name: [] for name in names}
    for hf_name in hf_shapes:
        codes = hf_probes[hf_name].reshape(-1).to(torch.int64)
        owners = torch.unique(codes // _ID_STRIDE)
        if owners.numel() != 1:
            raise ValueError(f"{hf_name}: built from several Megatron parameters; the plan cannot express it")
        name = names[int(owners)]
        dim, source_shape = dims[name], tuple(full[name].shape)
        expected = source_shape[:dim] + (codes.numel(),) + source_shape[dim + 1 :]
        if tuple(hf_shapes[hf_name]) != expected:
            raise ValueError(f"{hf_name}: shape {hf_shapes[hf_name]} is not a re-slicing of {name} {source_shape} "
                             f"along dim {dim}")
        owner_rank, local_pos = _shard_positions(name, probes[name], int(owners) * _ID_STRIDE, tp)
        runs = _runs(owner_rank[codes - int(owners) * _ID_STRIDE], local_pos[codes - int(owners) * _ID_STRIDE])
        by_param[name].append(HFTensor(hf_name, tuple(hf_shapes[hf_name]), dim, runs))
    return {name: tuple(tensors) for name, tensors in by_param.items()}


def _shard_positions(name: str, probe: Tensor, base: int, tp: int) -> tuple[Tensor, Tensor]:
    """(TP rank, position in that rank's shard) of every full position, from the models' own sharding."""
    length = probe.numel()
    owner, local = torch.zeros(length, dtype=torch.int64), torch.zeros(length, dtype=torch.int64)
    ranks = range(tp) if tp_split_dim(name) is not None else range(1)
    for rank in ranks:
        held = shard_tensor(name, probe, rank, tp).reshape(-1).to(torch.int64) - base
        owner[held] = rank
        local[held] = torch.arange(held.numel())
    return owner, local


def _runs(ranks: Tensor, positions: Tensor) -> tuple[Run, ...]:
    """Compress per-position (rank, source position) into maximal runs of consecutive sources."""
    breaks = (ranks[1:] != ranks[:-1]) | (positions[1:] != positions[:-1] + 1)
    starts = [0] + (torch.nonzero(breaks).reshape(-1) + 1).tolist() + [ranks.numel()]
    return tuple(
        Run(int(ranks[a]), int(positions[a]), a, b - a) for a, b in zip(starts[:-1], starts[1:])
    )


def _stage_params(full, outputs, arch: Arch, layout: TrainerLayout, pp_rank: int, ep_rank: int) -> list[ParamPlan]:
    """What EP rank `ep_rank` of PP stage `pp_rank` sends, in model-chunk order: its experts, and
    (EP rank 0) the dense parameters; with local names and shard shapes."""
    chunks = shard_for_rank(full, num_layers=arch.num_layers, tie_word_embeddings=arch.tie_word_embeddings,
                            tp_rank=0, tp_size=layout.tp, pp_rank=pp_rank, pp_size=layout.pp, vpp_size=layout.vpp,
                            ep_rank=ep_rank, ep_size=layout.ep)
    per_rank = experts_per_rank(full, layout.ep)
    params = []
    for vpp_rank, chunk in enumerate(chunks):
        for local_name, shard in chunk.items():
            name = global_expert_name(_global_name(local_name, arch, layout, pp_rank, vpp_rank), ep_rank, per_rank)
            if name not in full:
                continue  # the last stage's copy of tied embeddings: the first stage sends them
            if not is_expert(name) and ep_rank != 0:
                continue  # dense parameters: every EP rank holds them, EP rank 0 sends them
            params.append(ParamPlan(name, local_name, pp_rank, vpp_rank, tp_split_dim(name), tuple(shard.shape),
                                    outputs[name], ep_rank if is_expert(name) else 0))
    return params


def _global_name(local_name: str, arch: Arch, layout: TrainerLayout, pp_rank: int, vpp_rank: int) -> str:
    match = _LAYER_RE.match(local_name)
    if not match:
        return local_name
    layer = global_layer_index(int(match.group(1)), num_layers=arch.num_layers, pp_rank=pp_rank, pp_size=layout.pp,
                               vpp_rank=vpp_rank, vpp_size=layout.vpp)
    return f"decoder.layers.{layer}.{match.group(2)}"


def _bucketize(params: list[ParamPlan], *, pp_rank: int, ep_rank: int, sender: int, dtype: torch.dtype, cap: int,
               first_index: int) -> list[Bucket]:
    """Greedy size-capped buckets (a parameter larger than the cap gets a bucket of its own)."""
    element = torch.empty((), dtype=dtype).element_size()
    buckets: list[Bucket] = []
    current: list[ParamPlan] = []
    size = 0

    def close() -> None:
        buckets.append(Bucket(first_index + len(buckets), pp_rank, sender, tuple(current), size, dtype, ep_rank))

    for param in params:
        param_bytes = sum(_numel(out.shape) for out in param.outputs) * element
        if current and size + param_bytes > cap:
            close()
            current, size = [], 0
        placed = []
        for out in param.outputs:
            nbytes = _numel(out.shape) * element
            placed.append(replace(out, offset=size, nbytes=nbytes))
            size += nbytes
        current.append(replace(param, outputs=tuple(placed)))
    if current:
        close()
    return buckets


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count
