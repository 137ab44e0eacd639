"""LoRA adapters on this rank's Megatron linears: the tensor-parallel maths, a frozen base, adapters on and off.

`attach_lora` freezes every weight of the model chunks and gives each targeted linear
(`megarl.models.lora.TARGETS`, in attention, dense MLPs and every local MoE expert) an
adapter, kept in one `LoraAdapters` module per chunk (attribute `lora_adapters`) so the
base weights keep their names and the adapters checkpoint under global keys of their own.
A forward hook on the linear adds `scale * B A x` (scale = alpha / r) to its output:

- column-parallel (`linear_qkv`, `linear_fc1`: output rows split over TP): A is replicated,
  B holds this rank's rows. h = A x is the same on every rank; its gradient, partial per
  rank (each holds some of B's rows), is summed over TP in the backward pass
  (`copy_to_tensor_model_parallel_region`), so dA and the adapter's dx are whole on every rank.
- row-parallel (`linear_proj`, `linear_fc2`: input columns split): A holds this rank's
  columns, B is replicated. The partial h = A_r x_r is summed over TP in the forward pass
  (`reduce_from_tensor_model_parallel_region`), then B h is the whole output on every rank.

Experts are never TP-split (expert-TP 1). Transformer Engine's `linear_qkv`/`linear_fc1`
fuse the preceding norm, so their input is the un-normed residual: the adapter applies the
module's own norm weights to it first. Dropout (PEFT's `lora_dropout`, on the adapter's
input) draws from the default generator where the input is replicated over TP and from
megatron's model-parallel stream where it is split, as megatron's own dropouts do.
Sequence parallelism is not supported (the engines do not run it).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

from megarl.config.settings import LoraSettings
from megarl.models import lora as layout
from megarl.models.sharding import global_layer_index

Tensor = torch.Tensor
ADAPTERS_ATTR = "lora_adapters"


class _FusedNormInput:
    """The norm a Transformer Engine LayerNorm-linear applies to its input, recomputed for the adapter
    (a plain callable, so the linear does not become a child module of the adapter)."""

    def __init__(self, linear: torch.nn.Module):
        self.linear = linear

    def __call__(self, x: Tensor) -> Tensor:
        linear = self.linear
        weight = linear.layer_norm_weight.float()
        if getattr(linear, "zero_centered_gamma", False):
            weight = weight + 1
        z = x.float()
        if linear.normalization == "RMSNorm":
            z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + linear.eps)
            return (z * weight).to(x.dtype)
        bias = linear.layer_norm_bias.float()
        return F.layer_norm(z, (z.shape[-1],), weight, bias, linear.eps).to(x.dtype)


class LoraAdapter(torch.nn.Module):
    """One linear's adapter: `lora_A` [r, in (local)], `lora_B` [out (local), r]; forward returns the
    adapter's addition to the linear's (local) output."""

    def __init__(self, *, full_name: str, style: str, lora_a: Tensor, lora_b: Tensor, scale: float,
                 dropout: float, expert: bool, norm: _FusedNormInput | None):
        super().__init__()
        self.full_name, self.style, self.scale, self.expert, self.norm = full_name, style, scale, expert, norm
        self.lora_A = torch.nn.Parameter(lora_a)
        self.lora_B = torch.nn.Parameter(lora_b)
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None
        self.group = (parallel_state.get_expert_tensor_parallel_group() if expert
                      else parallel_state.get_tensor_model_parallel_group())

    def _dropped(self, x: Tensor) -> Tensor:
        if self.dropout is None:
            return x
        if self.style == "row" and not self.expert:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.dropout(x)
        return self.dropout(x)

    def forward(self, x: Tensor) -> Tensor:
        if self.norm is not None:
            x = self.norm(x)
        h = F.linear(self._dropped(x), self.lora_A)
        if self.style == "column":
            h = copy_to_tensor_model_parallel_region(h, group=self.group)
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=self.group)
        # The scale goes into B (r columns), not onto the output: one output-sized tensor fewer per linear.
        return F.linear(h, self.lora_B * self.scale)

    def merged_delta(self) -> Tensor:
        """scale * B A of this rank's shards: the change merging makes to the linear's local weight shard."""
        with torch.no_grad():
            return (self.lora_B.double() @ self.lora_A.double()).mul_(self.scale).to(self.lora_A.dtype)

    def sharded_state_dict(self, prefix: str) -> dict:
        """`lora_A` / `lora_B` under global, layout-free keys (`lora_adapters.<full module>.lora_A`)."""
        tp_rank = parallel_state.get_expert_tensor_parallel_rank() if self.expert else (
            parallel_state.get_tensor_model_parallel_rank())
        tp_size = parallel_state.get_expert_tensor_parallel_world_size() if self.expert else (
            parallel_state.get_tensor_model_parallel_world_size())
        dp_rank = parallel_state.get_expert_data_parallel_rank() if self.expert else (
            parallel_state.get_data_parallel_rank(with_context_parallel=True))
        out = {}
        for part in ("lora_A", "lora_B"):
            key = f"{ADAPTERS_ATTR}.{self.full_name}.{part}"
            param = getattr(self, part)
            dim = layout.tp_split_dim(f"{self.full_name}.{part}")
            if dim is None:  # replicated over TP: one TP rank writes it
                item = ShardedTensor.from_rank_offsets(key, param, replica_id=(0, tp_rank, dp_rank))
            else:
                item = ShardedTensor.from_rank_offsets(key, param, (dim, tp_rank, tp_size), replica_id=(0, 0, dp_rank))
                if layout.target_of(self.full_name) == "linear_fc1":
                    # Rank r holds [gate_r; up_r]: stored as the gate and up halves, each split over TP,
                    # as megatron stores fc1's weight, so a checkpoint loads at any TP.
                    item = apply_swiglu_sharded_factory(item, ())
            out[f"{prefix}{part}"] = item
        return out


class LoraAdapters(torch.nn.Module):
    """The adapters of one model chunk, nested under the paths of the linears they adapt."""

    def __init__(self):
        super().__init__()
        self.enabled = True
        self.by_path: dict[str, LoraAdapter] = {}  # local module path -> adapter (not registered twice)

    def add(self, path: str, adapter: LoraAdapter) -> None:
        parent = self
        for part in path.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(path.rsplit(".", 1)[1], adapter)
        self.by_path[path] = adapter

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        out = {}
        for path, adapter in self.by_path.items():
            out.update(adapter.sharded_state_dict(f"{prefix}{path}."))
        return out


def _add_adapter(container: LoraAdapters, adapter: LoraAdapter, module, args, output):
    """Forward hook of an adapted linear: its (output, bias) with the adapter's addition.

    A column-parallel linear's output (the widest: fc1's is 2x the MLP width) takes it in place, as the
    linear's backward does not read its output and a second output-sized tensor would raise the peak memory;
    a row-parallel linear's output may be a view its all-reduce returned as is (TP 1), which autograd forbids
    changing in place."""
    if not container.enabled:
        return output
    out, bias = output
    delta = adapter(args[0])
    return (out.add_(delta) if adapter.style == "column" else out + delta), bias


def _chunk_modules(chunk: torch.nn.Module, *, pp_rank: int, pp_size: int, vpp_rank: int, vpp_size: int,
                   num_layers: int) -> Iterator[tuple[str, str]]:
    """(local module path, full-layout module path) of every linear in `chunk` that could carry an adapter."""
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    for local_index, layer in enumerate(chunk.decoder.layers):
        full_layer = global_layer_index(local_index, num_layers=num_layers, pp_rank=pp_rank, pp_size=pp_size,
                                        vpp_rank=vpp_rank, vpp_size=vpp_size)
        for name, _ in layer.named_modules():
            if name.rsplit(".", 1)[-1] not in layout.TARGETS:
                continue
            full = name
            if ".local_experts." in name:
                head, tail = name.split(".local_experts.", 1)
                local_expert, rest = tail.split(".", 1)
                per_rank = len(layer.mlp.experts.local_experts)
                full = f"{head}.local_experts.{ep_rank * per_rank + int(local_expert)}.{rest}"
            yield f"decoder.layers.{local_index}.{name}", f"decoder.layers.{full_layer}.{full}"


def attach_lora(model, settings: LoraSettings) -> None:
    """Freeze `model`'s (a `GPTModelChunks`) weights and add adapters on `settings.targets`, initialised by
    `settings.init` from `settings.seed` (B = 0: the model still computes the base model)."""
    if model.config.sequence_parallel:
        raise ValueError("LoRA adapters do not support sequence parallelism")
    arch = model.arch
    full = layout.initial_adapters(arch, rank=settings.rank, targets=settings.targets, init=settings.init,
                                   seed=settings.seed)
    expected = layout.adapted_modules(arch, settings.targets)
    ps = parallel_state
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    scale = settings.alpha / settings.rank
    for vpp_rank, chunk in enumerate(model.chunks):
        chunk.requires_grad_(False)
        container = LoraAdapters()
        for local, full_module in _chunk_modules(chunk, pp_rank=pp_rank, pp_size=pp_size, vpp_rank=vpp_rank,
                                                 vpp_size=len(model.chunks), num_layers=arch.num_layers):
            if full_module not in expected:
                continue
            linear = chunk.get_submodule(local)
            expert = ".experts." in full_module
            tp = (0, 1) if expert else (tp_rank, tp_size)
            a_name, b_name = f"{full_module}.lora_A", f"{full_module}.lora_B"
            weight = linear.weight
            adapter = LoraAdapter(
                full_name=full_module, style=layout.TARGETS[layout.target_of(full_module)],
                lora_a=layout.shard_adapter(a_name, full[a_name], *tp).to(weight.device, weight.dtype),
                lora_b=layout.shard_adapter(b_name, full[b_name], *tp).to(weight.device, weight.dtype),
                scale=scale, dropout=settings.dropout, expert=expert,
                norm=_FusedNormInput(linear) if hasattr(linear, "layer_norm_weight") else None,
            )
            for part in ("lora_A", "lora_B"):
                param = getattr(adapter, part)
                # DDP reduces expert grads over the expert-data-parallel group, like the expert's weight.
                param.allreduce = getattr(weight, "allreduce", True)
                dim = layout.tp_split_dim(f"{full_module}.{part}")
                set_tensor_model_parallel_attributes(param, is_parallel=dim is not None, dim=dim or 0, stride=1)
            container.add(local, adapter)
            linear.register_forward_hook(functools.partial(_add_adapter, container, adapter))
        chunk.add_module(ADAPTERS_ATTR, container)


def containers(chunks) -> list[LoraAdapters]:
    """The adapters of each chunk (none for a model without LoRA); `chunks` may be DDP-wrapped."""
    found = []
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        if hasattr(module, ADAPTERS_ATTR):
            found.append(getattr(module, ADAPTERS_ATTR))
    return found


def has_lora(model) -> bool:
    return bool(containers(model.chunks))


@contextmanager
def adapters_disabled(model):
    """Within the block the model computes the base model (the reference policy)."""
    found = containers(model.chunks)
    for container in found:
        container.enabled = False
    try:
        yield
    finally:
        for container in found:
            container.enabled = True


def merged_weights(chunk, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`weights` (a chunk's local-spec weights) with every adapted linear's shard merged: W + scale * B A.
    Local maths only: a column-parallel shard needs only its rows of B, a row-parallel one its columns of A."""
    merged = dict(weights)
    for container in containers([chunk]):
        if not container.enabled:
            continue
        for path, adapter in container.by_path.items():
            name = f"{path}.weight"
            merged[name] = weights[name] + adapter.merged_delta().to(weights[name].device)
    return merged


def adapter_shards(model) -> dict[tuple[int, str], Tensor]:
    """{(chunk, full-layout adapter name): this rank's shard}, as the adapter-only sync and tests read them."""
    return {(index, f"{adapter.full_name}.{part}"): getattr(adapter, part).detach()
            for index, container in enumerate(containers(model.chunks))
            for adapter in container.by_path.values() for part in ("lora_A", "lora_B")}


def load_full_adapters(model, full: Mapping[str, Tensor]) -> None:
    """Set every adapter from full-layout tensors (each rank takes its slices)."""
    ps = parallel_state
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for container in containers(model.chunks):
            for adapter in container.by_path.values():
                for part in ("lora_A", "lora_B"):
                    name = f"{adapter.full_name}.{part}"
                    shard = layout.shard_adapter(name, full[name], *((0, 1) if adapter.expert else (tp_rank, tp_size)))
                    getattr(adapter, part).copy_(shard)
