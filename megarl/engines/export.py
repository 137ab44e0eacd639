"""Export a megarl distributed checkpoint (any layout) as an HF checkpoint, in one CPU process.

`export_checkpoint(ckpt_dir, out_dir)` (the `megarl export CKPT --hf OUT` verb) starts a
world-size-1 gloo process group, builds the model at TP1/PP1 from the HF config saved
in the checkpoint's metadata, lets dist_checkpointing reshard the saved shards into it,
converts the weights to HF names and writes `model.safetensors` (in the dtype the engine
trained in), `config.json` and the tokenizer files recorded at save time. No GPU and no
other input is needed. It needs a process of its own: torch.distributed must not be
initialised yet (the CLI is such a process). Memory: the whole model plus one float32
copy of it, on one host.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from megarl.errors import InputError

# Files a tokenizer (and generation defaults) may consist of; all that exist are copied.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


def _hf_weights(ckpt_dir: Path, hf_config: dict, params_dtype: str) -> dict[str, torch.Tensor]:
    """The checkpoint's weights in HF names (float32), resharded into a TP1/PP1 model."""
    from megarl.engines import cpu_compat

    cpu_compat.install()
    from megarl.engines import checkpoint, gpt, hf_weights
    from megarl.engines.distributed import destroy_distributed, set_model_parallel

    with tempfile.TemporaryDirectory(prefix="megarl-export-") as rendezvous:
        # A file rendezvous needs no free port; world size 1 never talks to anyone.
        torch.distributed.init_process_group(
            backend="gloo", init_method=f"file://{rendezvous}/store", rank=0, world_size=1
        )
        try:
            set_model_parallel(tp=1, pp=1)
            model = gpt.build_gpt(hf_config, params_dtype=params_dtype)
            checkpoint.load_model_state(model, ckpt_dir)
            return hf_weights.hf_state_dict(model)
        finally:
            destroy_distributed()


def export_checkpoint(ckpt_dir: Path, out_dir: Path) -> Path:
    """Write an HF checkpoint of the megarl checkpoint `ckpt_dir` into `out_dir`; returns `out_dir`.

    InputError when `ckpt_dir` is not a complete megarl checkpoint or its recorded
    tokenizer dir is gone; RuntimeError when called in a process that already runs
    torch.distributed.
    """
    from safetensors.torch import save_file

    from megarl.engines.checkpoint import read_checkpoint_info

    ckpt_dir, out_dir = Path(ckpt_dir).expanduser().resolve(), Path(out_dir).expanduser().resolve()
    info = read_checkpoint_info(ckpt_dir)
    tokenizer_dir = Path(info.tokenizer_path).expanduser() if info.tokenizer_path else None
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        raise InputError(f"checkpoint {ckpt_dir}: tokenizer_path {info.tokenizer_path!r} does not exist")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError("export_checkpoint needs its own process: torch.distributed is already initialised here")
    dtype = getattr(torch, info.params_dtype)
    weights = _hf_weights(ckpt_dir, info.hf_config, info.params_dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: tensor.to(dtype).contiguous() for name, tensor in weights.items()},
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    # `dtype` is what transformers 5 reads, `torch_dtype` what older readers (SGLang) do.
    config = {**info.hf_config, "dtype": info.params_dtype, "torch_dtype": info.params_dtype}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if tokenizer_dir is not None and tokenizer_dir.resolve() != out_dir:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, out_dir / name)
    return out_dir
