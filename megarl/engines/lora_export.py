"""Export a LoRA policy's checkpoint (any layout): as a PEFT adapter, or merged into its base as an HF checkpoint.

A LoRA checkpoint holds the adapters alone (`megarl.engines.checkpoint`). `read_adapters`
builds the model at TP1/PP1 in a world-size-1 gloo group (the weights stay uninitialised:
only the adapters are loaded), lets dist_checkpointing reshard the saved adapters into it
and returns them in the full layout. `export_peft` (`megarl export CKPT --lora OUT`) writes
them as PEFT writes an adapter: `adapter_config.json` and `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained` loads on the HF base model. `export_merged`
(`megarl export CKPT --merge OUT`) reads the base the checkpoint records, one HF tensor at a
time, adds scale * B A to the adapted ones and writes an HF checkpoint as `megarl export --hf`
does. Each needs a process of its own, as `export_checkpoint` does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megarl.config.settings import LoraSettings
from megarl.engines.export import (
    MAX_SHARD_BYTES,
    ShardedWriter,
    checked_tokenizer_dir,
    with_the_users_umask,
    world_of_one,
    write_config_and_tokenizer,
)
from megarl.errors import InputError
from megarl.models import arch_from_hf, hf_param_shapes, random_hf_state_dict
from megarl.models.lora import hf_deltas, peft_config, to_peft

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _lora_info(ckpt_dir: Path):
    from megarl.engines.checkpoint import read_checkpoint_info

    info = read_checkpoint_info(ckpt_dir)
    if info.lora is None:
        raise InputError(f"checkpoint {ckpt_dir}: holds full weights, no LoRA adapters; export it with --hf OUT")
    return info


def read_adapters(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's adapters in the full Megatron layout (`decoder.layers.0.self_attention.linear_qkv.lora_A`,
    ...), in the dtype the engine trained in."""
    from megarl.engines import checkpoint, gpt, lora

    ckpt_dir = Path(ckpt_dir).expanduser().resolve()
    info = _lora_info(ckpt_dir)
    record = info.lora
    settings = LoraSettings(rank=record["rank"], alpha=record["alpha"], dropout=record["dropout"],
                            targets=tuple(record["targets"]), init=record["init"], seed=0)
    with world_of_one():
        model = gpt.build_gpt(info.hf_config, params_dtype=info.params_dtype, transformer_impl="local")
        lora.attach_lora(model, settings)
        checkpoint.load_checkpoint(model, None, ckpt_dir, load_optimizer=False, lora_record=record)
        return {name: tensor.clone() for (_, name), tensor in lora.adapter_shards(model).items()}


def export_peft(ckpt_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the checkpoint's adapters as a PEFT adapter dir; returns `out_dir`."""
    from safetensors.torch import save_file

    ckpt_dir, out_dir = Path(ckpt_dir).expanduser().resolve(), Path(out_dir).expanduser().resolve()
    info = _lora_info(ckpt_dir)
    adapters = read_adapters(ckpt_dir)
    record = info.lora
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in to_peft(adapters, arch_from_hf(info.hf_config)).items()}
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with_the_users_umask(out_dir / ADAPTER_WEIGHTS)
    config = peft_config(rank=record["rank"], alpha=record["alpha"], dropout=record["dropout"],
                         targets=record["targets"], base_model=record["base"]["path"])
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    return out_dir


def _base_tensors(base: dict, arch, ckpt_dir: Path):
    """name -> base tensor, read one at a time from the recorded HF dir (or drawn from the recorded seed)."""
    from megarl.engines.hf_reader import read_tensor

    if base["path"] is None:
        state = random_hf_state_dict(arch, seed=base["seed"])
        return state.__getitem__
    path = Path(base["path"]).expanduser()
    if not (path / "config.json").exists():
        raise InputError(f"checkpoint {ckpt_dir}: its LoRA base {str(path)!r} is gone; the merge needs it")
    return lambda name: read_tensor(path, name)


def export_merged(ckpt_dir: str | Path, out_dir: str | Path, *, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write the base with the checkpoint's adapters merged (W + alpha/r * B A) as an HF checkpoint dir."""
    ckpt_dir, out_dir = Path(ckpt_dir).expanduser().resolve(), Path(out_dir).expanduser().resolve()
    info = _lora_info(ckpt_dir)
    tokenizer_dir = checked_tokenizer_dir(info, ckpt_dir)
    arch = arch_from_hf(info.hf_config)
    base = _base_tensors(info.lora["base"], arch, ckpt_dir)
    deltas = hf_deltas(read_adapters(ckpt_dir), arch, scale=info.lora["alpha"] / info.lora["rank"])
    dtype = getattr(torch, info.params_dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = ShardedWriter(out_dir, max_shard_bytes)
    for name in hf_param_shapes(arch):
        tensor = base(name)
        if tensor is None:
            raise InputError(f"checkpoint {ckpt_dir}: its LoRA base {info.lora['base']['path']} lacks {name}")
        if name in deltas:
            tensor = tensor.float() + deltas[name].float()
        writer.add(name, tensor.to(dtype).contiguous())
    writer.close()
    write_config_and_tokenizer(info, tokenizer_dir, out_dir)
    return out_dir
