"""Loading the HF model and replacing its weights in place, all-or-nothing.

Incoming tensors carry HF parameter names (`model.layers.0.self_attn.q_proj.weight`).
Every update is checked in full before anything is copied: each name must be a
tensor of the model's state dict, with the same shape and a dtype that converts
exactly into the model's (bf16 into float32 is fine, float64 into float32 is not). A bad update
is refused as a whole, naming every offending tensor, so the model never runs
on a half-loaded set of weights. With tied embeddings `lm_head.weight` and
`model.embed_tokens.weight` are one tensor; either name updates both. MoE experts
may be named as in checkpoints (`experts.{e}.gate_proj.weight`, ...) or as
transformers 5 fuses them in memory (`experts.gate_up_proj`); see `weight_views`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from megarl.rollout.cpu_engine.args import DTYPE_NAMES
from megarl.rollout.weight_wire import skips_weight_check

logger = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]


class WeightUpdateError(ValueError):
    """An update that was refused before any weight changed; `problems` has one line per tensor."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


# SGLang's --dtype names -> torch dtypes; "auto" keeps the checkpoint's torch_dtype.
DTYPES = {name: "auto" if dtype == "auto" else getattr(torch, dtype) for name, dtype in DTYPE_NAMES.items()}


def load_model(model_path: str | Path, *, dtype: str = "float32", attn_implementation: str = "sdpa") -> PreTrainedModel:
    """The causal LM on CPU in `dtype` (a `DTYPES` name), in eval mode."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=DTYPES[dtype], attn_implementation=attn_implementation
    )
    return model.eval()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path, *, required: bool):
    """The tokenizer at `path`; None when it is not `required` and `path` has no tokenizer files."""
    if not required and not any((Path(path) / name).exists() for name in TOKENIZER_FILES):
        logger.info("no tokenizer files in %s: text input disabled", path)
        return None
    return AutoTokenizer.from_pretrained(str(path))


def eos_token_ids(model: PreTrainedModel) -> frozenset[int]:
    """EOS ids from the generation config and the model config (either may hold an int or a list)."""
    ids: set[int] = set()
    for config in (getattr(model, "generation_config", None), model.config):
        value = getattr(config, "eos_token_id", None) if config is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")


def weight_views(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Every tensor an update may name: the state dict, plus the per-expert tensors of HF checkpoints.

    transformers 5 keeps a MoE layer's experts fused in memory (`experts.gate_up_proj`
    [E, 2I, H] = [gate; up] per expert, `experts.down_proj` [E, H, I]) while checkpoints,
    SGLang and trainers name them `experts.{e}.{gate,up,down}_proj.weight`: those names
    map to views into the fused tensors, so either form updates the same memory.
    """
    views: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        views[name] = tensor
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            continue
        prefix, half = match.group(1), tensor.shape[1] // 2
        for expert in range(tensor.shape[0]):
            if match.group(2) == "gate_up_proj":
                views[f"{prefix}{expert}.gate_proj.weight"] = tensor[expert, :half]
                views[f"{prefix}{expert}.up_proj.weight"] = tensor[expert, half:]
            else:
                views[f"{prefix}{expert}.down_proj.weight"] = tensor[expert]
    return views


def check_named_tensors(model: PreTrainedModel, named_tensors: NamedTensors) -> list[str]:
    """One problem line per tensor whose name, shape or dtype does not fit the model."""
    targets = weight_views(model)
    problems = []
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name}: not a tensor ({type(tensor).__name__})")
        elif name not in targets:
            problems.append(f"{name}: no such tensor in the model")
        elif tuple(tensor.shape) != tuple(targets[name].shape):
            problems.append(f"{name}: shape {tuple(tensor.shape)} != model shape {tuple(targets[name].shape)}")
        elif tensor.dtype != targets[name].dtype and not widens_exactly(tensor.dtype, targets[name].dtype):
            problems.append(f"{name}: dtype {tensor.dtype} != model dtype {targets[name].dtype}")
    # No scan of the values: SGLang loads what it is sent, and a pass over every received byte cost more
    # than the copy itself. A diverged trainer is stopped where it diverges (the step checks its loss and
    # gradient norm), and `weight_sync.verify: checksum` compares what the servers hold.
    return problems


# Casts that keep every value: a bf16 trainer may update this float32 engine, as
# SGLang's loaders copy (and cast) into their parameters. Lossy casts are refused.
_EXACT_WIDENINGS = {
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64), (torch.float16, torch.float64), (torch.float32, torch.float64),
}


def widens_exactly(source: torch.dtype, target: torch.dtype) -> bool:
    return (source, target) in _EXACT_WIDENINGS


def checked_tensors(model: PreTrainedModel, skip_tensor_list: list[str] | None = None) -> dict[str, torch.Tensor]:
    """What `/weights_checker` reads: SGLang's walk, every parameter and every buffer (persistent or not),
    less what its rule skips (`weight_wire.skips_weight_check`). Parameters go by every name an update may
    use (`weight_views`: a tied weight's both names, per-expert views of fused experts), so the checksums
    carry the names trainers send; SGLang names its own fused, TP-sharded tensors."""
    tensors = dict(weight_views(model))
    tensors.update((name, buffer) for name, buffer in model.named_buffers() if name not in tensors)
    return {name: tensor for name, tensor in tensors.items()
            if not skips_weight_check(name, tensor, skip_tensor_list)}


def apply_named_tensors(model: PreTrainedModel, named_tensors: NamedTensors) -> int:
    """Check all tensors, then copy them into the model; returns how many were copied."""
    problems = check_named_tensors(model, named_tensors)
    if problems:
        raise WeightUpdateError(problems)
    targets = weight_views(model)
    with torch.no_grad():
        for name, tensor in named_tensors:
            targets[name].copy_(tensor)
    return len(named_tensors)


def read_checkpoint(model: PreTrainedModel, model_path: str | Path) -> NamedTensors:
    """All tensors of the `*.safetensors` files in `model_path`, checked to cover every model weight.

    Floating-point tensors are cast to the model's dtype, as loading the model
    from that directory would (a bf16 checkpoint feeds a float32 CPU engine).
    """
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise WeightUpdateError([f"{model_path}: no *.safetensors files"])
    targets = weight_views(model)
    named: NamedTensors = []
    for file in files:
        try:
            loaded = load_file(str(file))
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error type for a bad header
            raise WeightUpdateError([f"{file}: not a readable safetensors file ({error})"]) from None
        for name, tensor in loaded.items():
            target = targets.get(name)
            if target is not None and tensor.is_floating_point() and target.is_floating_point():
                tensor = tensor.to(target.dtype)
            named.append((name, tensor))
    present = {name for name, _ in named}
    missing = sorted(name for name in _required_names(model) if not _covered(name, present))
    if missing:
        raise WeightUpdateError([f"{name}: missing from {model_path}" for name in missing])
    return named


def _required_names(model: PreTrainedModel) -> set[str]:
    """Names a full checkpoint must contain: one per distinct tensor, fused experts per expert."""
    seen: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        seen.setdefault(id(tensor), name)
    required = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if seen[id(tensor)] != name:
            continue
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            required.add(name)
            continue
        projections = ("gate_proj", "up_proj") if match.group(2) == "gate_up_proj" else ("down_proj",)
        required |= {f"{match.group(1)}{e}.{p}.weight" for e in range(tensor.shape[0]) for p in projections}
    return required


def _covered(name: str, present: set[str]) -> bool:
    """A per-expert name is also covered by its fused tensor (a checkpoint in transformers' memory layout)."""
    if name in present:
        return True
    expert = re.match(r"^(.*\.mlp\.experts\.)\d+\.(gate|up|down)_proj\.weight$", name)
    if expert is None:
        return False
    fused = "down_proj" if expert.group(2) == "down" else "gate_up_proj"
    return f"{expert.group(1)}{fused}" in present
