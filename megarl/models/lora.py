"""LoRA adapter layouts: which linears carry adapters, how adapters split over TP, and their PEFT names.

An adapter on a Megatron linear `<module>` (weight W [out, in]) is two tensors, named in
the full Megatron layout `<module>.lora_A` [r, in] and `<module>.lora_B` [out, r]; the
linear then computes `W x + (alpha / r) B A x`. Column-parallel linears (`linear_qkv`,
`linear_fc1`) split their output rows over TP, so `lora_B` splits exactly like W's rows
(whole query groups of the packed QKV, [gate_r; up_r] of fc1) and `lora_A` is replicated;
row-parallel linears (`linear_proj`, `linear_fc2`) split their input columns, so `lora_A`
splits like W's columns and `lora_B` is replicated. MoE experts (expert-TP 1) never split.

Megatron fuses HF linears: `linear_qkv` is q/k/v_proj, `linear_fc1` is gate/up_proj. A fused
adapter is the PEFT adapter whose fused members share one `lora_A` and whose `lora_B` rows
are the fused `lora_B` unpacked like the weight (`to_peft`), so every megarl adapter has an
exact PEFT form (the converse needs rank 3r). Everything here is pure tensor reshuffling.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Mapping

import torch

from megarl.config.training import LORA_HF_LINEARS
from megarl.models.layout import unpack_qkv
from megarl.models.sharding import merge_tensor, shard_tensor
from megarl.models.spec import Arch

Tensor = torch.Tensor

# Megatron linear -> its parallel style; recipes name targets by these.
TARGETS = {"linear_qkv": "column", "linear_proj": "row", "linear_fc1": "column", "linear_fc2": "row"}
INITS = ("kaiming", "gaussian")
HF_LINEARS = LORA_HF_LINEARS  # the HF linears each target stands for, in the order the fused weight stacks them
# PEFT saves a causal LM's adapter tensors under this prefix (`PeftModel` wraps the HF model twice).
PEFT_PREFIX = "base_model.model."
_MODULE_RE = re.compile(r"^decoder\.layers\.(\d+)\.(?:(self_attention|mlp)\.)(?:experts\.local_experts\.(\d+)\.)?"
                        r"(linear_qkv|linear_proj|linear_fc1|linear_fc2)$")


def target_of(module: str) -> str:
    """The target (`linear_qkv`, ...) an adapted module path ends in."""
    return module.rsplit(".", 1)[1]


def adapted_modules(arch: Arch, targets: Iterable[str]) -> dict[str, tuple[int, int]]:
    """Every adapted linear of the full Megatron layout (global layer and expert indices) -> (in, out) features."""
    targets = set(targets)
    unknown = sorted(targets - set(TARGETS))
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; expected some of {list(TARGETS)}")
    h = arch.hidden_size
    qkv_out = (arch.num_attention_heads + 2 * arch.num_query_groups) * arch.head_dim
    attention = {"linear_qkv": (h, qkv_out), "linear_proj": (arch.num_attention_heads * arch.head_dim, h)}
    ffn = arch.moe_ffn_hidden_size if arch.is_moe else arch.ffn_hidden_size
    mlp = {"linear_fc1": (h, 2 * ffn), "linear_fc2": (ffn, h)}
    experts = [f"experts.local_experts.{e}." for e in range(arch.num_experts)] if arch.is_moe else [""]
    modules = {}
    for layer in range(arch.num_layers):
        prefix = f"decoder.layers.{layer}."
        for target in TARGETS:
            if target not in targets:
                continue
            if target in attention:
                modules[f"{prefix}self_attention.{target}"] = attention[target]
            else:
                modules.update({f"{prefix}mlp.{expert}{target}": mlp[target] for expert in experts})
    return modules


def adapter_shapes(arch: Arch, *, rank: int, targets: Iterable[str]) -> dict[str, tuple[int, int]]:
    """Every adapter tensor of the full layout (`<module>.lora_A` [r, in], `<module>.lora_B` [out, r])."""
    shapes = {}
    for module, (fan_in, fan_out) in adapted_modules(arch, targets).items():
        shapes[f"{module}.lora_A"] = (rank, fan_in)
        shapes[f"{module}.lora_B"] = (fan_out, rank)
    return shapes


def _split_module(name: str) -> tuple[str, str]:
    module, part = name.rsplit(".", 1)
    if part not in ("lora_A", "lora_B"):
        raise KeyError(f"{name}: not a LoRA adapter tensor")
    return module, part


def tp_split_dim(name: str) -> int | None:
    """The dim adapter tensor `name` splits on over TP (None: replicated): B's rows of a column-parallel linear,
    A's columns of a row-parallel one; experts never split."""
    module, part = _split_module(name)
    if ".experts." in module:
        return None
    style = TARGETS[target_of(module)]
    if style == "column":
        return 0 if part == "lora_B" else None
    return 1 if part == "lora_A" else None


def shard_adapter(name: str, full: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    """TP rank `tp_rank`'s slice of a full adapter tensor: the split one is cut as its linear's weight is."""
    if tp_split_dim(name) is None:
        return full.clone()
    return shard_tensor(_split_module(name)[0] + ".weight", full, tp_rank, tp_size)


def merge_adapter(name: str, shards: list[Tensor]) -> Tensor:
    """Inverse of `shard_adapter` (all TP ranks' slices in rank order)."""
    if tp_split_dim(name) is None:
        return shards[0].clone()
    return merge_tensor(_split_module(name)[0] + ".weight", shards)


def initial_adapters(arch: Arch, *, rank: int, targets: Iterable[str], init: str, seed: int) -> dict[str, Tensor]:
    """Fresh adapters in the full layout: B = 0 (the adapted model starts as the base model), A random.

    `kaiming`: A ~ U(-1/sqrt(in), 1/sqrt(in)), PEFT's default (kaiming-uniform with a = sqrt(5));
    `gaussian`: A ~ N(0, 1/r), PEFT's `init_lora_weights="gaussian"`. Each A is drawn from a
    generator seeded by `seed` and its name, so a seed gives the same adapters at every layout.
    """
    if init not in INITS:
        raise ValueError(f"LoRA init {init!r}; expected one of {INITS}")
    adapters = {}
    for name, shape in adapter_shapes(arch, rank=rank, targets=targets).items():
        if name.endswith("lora_B"):
            adapters[name] = torch.zeros(shape)
            continue
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if init == "kaiming":
            bound = 1.0 / math.sqrt(shape[1])
            adapters[name] = (torch.rand(shape, generator=generator) * 2 - 1) * bound
        else:
            adapters[name] = torch.randn(shape, generator=generator) / rank
    return adapters


def hf_module(module: str) -> tuple[str, tuple[str, ...]]:
    """(HF parent path, HF linear names) of an adapted Megatron module, e.g. `model.layers.3.self_attn.` and
    (q_proj, k_proj, v_proj) for `decoder.layers.3.self_attention.linear_qkv`."""
    match = _MODULE_RE.match(module)
    if match is None:
        raise KeyError(f"{module}: not an adaptable Megatron linear")
    layer, block, expert, target = match.groups()
    parent = f"model.layers.{layer}." + ("self_attn." if block == "self_attention" else "mlp.")
    if expert is not None:
        parent += f"experts.{expert}."
    return parent, HF_LINEARS[target]


def _unfuse_rows(target: str, rows: Tensor, arch: Arch) -> tuple[Tensor, ...]:
    """The rows of a fused output ([out, ...]) per HF linear, in `HF_LINEARS` order."""
    if target == "linear_qkv":
        return unpack_qkv(rows, arch)
    if target == "linear_fc1":
        return tuple(part.clone() for part in rows.chunk(2, dim=0))
    return (rows.clone(),)


def to_hf(adapters: Mapping[str, Tensor], arch: Arch) -> dict[str, tuple[Tensor, Tensor]]:
    """Full-layout adapters -> {HF linear path (`model.layers.0.self_attn.q_proj`): (lora_A, lora_B)}: a fused
    linear's members share its A and take their rows of its B."""
    modules = sorted({_split_module(name)[0] for name in adapters})
    out = {}
    for module in modules:
        parent, linears = hf_module(module)
        lora_a, lora_b = adapters[f"{module}.lora_A"], adapters[f"{module}.lora_B"]
        for linear, rows in zip(linears, _unfuse_rows(target_of(module), lora_b, arch)):
            out[parent + linear] = (lora_a.clone(), rows)
    return out


def to_peft(adapters: Mapping[str, Tensor], arch: Arch) -> dict[str, Tensor]:
    """Full-layout adapters -> the tensors of PEFT's `adapter_model.safetensors`
    (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, ...)."""
    tensors = {}
    for linear, (lora_a, lora_b) in to_hf(adapters, arch).items():
        tensors[f"{PEFT_PREFIX}{linear}.lora_A.weight"] = lora_a
        tensors[f"{PEFT_PREFIX}{linear}.lora_B.weight"] = lora_b
    return tensors


def hf_deltas(adapters: Mapping[str, Tensor], arch: Arch, *, scale: float) -> dict[str, Tensor]:
    """{HF weight name: scale * B A}: what merging the adapters adds to each adapted HF weight."""
    return {f"{linear}.weight": scale * (lora_b.double() @ lora_a.double()).to(lora_a.dtype)
            for linear, (lora_a, lora_b) in to_hf(adapters, arch).items()}


def peft_config(*, rank: int, alpha: float, dropout: float, targets: Iterable[str],
                base_model: str | None) -> dict:
    """PEFT's `adapter_config.json` for megarl adapters on `targets` (HF linear names, sorted)."""
    linears = sorted(linear for target in targets for linear in HF_LINEARS[target])
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": linears,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
