"""Export a megarl distributed checkpoint (any layout) as an HF checkpoint, in one CPU process.

`export_checkpoint(ckpt_dir, out_dir)` (the `megarl export CKPT --hf OUT` verb) starts a
world-size-1 gloo process group, builds the model at TP1/PP1 from the HF config saved
in the checkpoint's metadata, lets dist_checkpointing reshard the saved shards into it,
then builds the HF tensors one at a time (`megarl.models.hf_sources`) and writes them
(in the dtype the engine trained in) as safetensors files of at most `max_shard_bytes`
(`model.safetensors`, or `model-0000i-of-0000n.safetensors` and the HF index), with
`config.json` and the tokenizer files recorded at save time. A policy's checkpoint
becomes a `*ForCausalLM`; a reward model's (`megarl train-rm`) a one-label
`*ForSequenceClassification`: the backbone and `score.weight`, no LM head. A critic's
value head has no HF form and is refused. No GPU and no other input is needed. It needs
a process of its own: torch.distributed must not be initialised yet (the CLI is such a
process). Memory: the model once, in its dtype, plus one output file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from megarl.errors import InputError
from megarl.models.spec import reward_model_hf_config

# HF's usual size of one safetensors file of a checkpoint.
MAX_SHARD_BYTES = 5 * 10**9
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


def with_the_users_umask(path: Path) -> None:
    """Give `path` the mode of any file the user creates (0666 less the umask): safetensors writes 0600,
    which hides an exported model from the group that is meant to serve it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


@contextmanager
def world_of_one():
    """A world-size-1 gloo process group at TP1/PP1 for the duration of the block (the CPU compatibility layer
    installed first); RuntimeError when torch.distributed already runs in this process."""
    from megarl.engines import cpu_compat

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError("export needs its own process: torch.distributed is already initialised here")
    cpu_compat.install()
    from megarl.engines.distributed import destroy_distributed, set_model_parallel

    with tempfile.TemporaryDirectory(prefix="megarl-export-") as rendezvous:
        # A file rendezvous needs no free port; world size 1 never talks to anyone.
        torch.distributed.init_process_group(
            backend="gloo", init_method=f"file://{rendezvous}/store", rank=0, world_size=1
        )
        try:
            set_model_parallel(tp=1, pp=1)
            yield
        finally:
            destroy_distributed()


def _write_hf_weights(ckpt_dir: Path, hf_config: dict, params_dtype: str, out_dir: Path, max_shard_bytes: int,
                      *, head: str) -> None:
    """The checkpoint's weights resharded into a TP1/PP1 model, written as HF tensors one at a time."""
    from megarl.engines import checkpoint, gpt
    from megarl.engines.reward_model import attach_score_head
    from megarl.models import hf_param_shapes, hf_sources
    from megarl.models.layout import SCORE_HEAD

    with world_of_one():
        # Checkpoints do not depend on the layer spec, and the local one runs anywhere.
        model = gpt.build_gpt(hf_config, params_dtype=params_dtype, transformer_impl="local",
                              value_head=head == "score")
        if head == "score":
            attach_score_head(model)  # a reward model's config is its backbone's, saved tied (no LM head)
        checkpoint.load_model_state(model, ckpt_dir)
        weights = gpt.chunk_weights(model.chunks[0])  # TP1/PP1: local names are the full layout's
        sources = hf_sources(model.arch, padded_vocab=model.padded_vocab)
        writer = ShardedWriter(out_dir, max_shard_bytes)
        for name, shape in hf_param_shapes(model.arch).items():
            tensor = torch.empty(shape, dtype=model.config.params_dtype)
            for param, piece in sources[name]:
                tensor.narrow(piece.dim, piece.src_start, piece.length).copy_(
                    weights[param].narrow(piece.dim, piece.dst_start, piece.length))
            writer.add(name, tensor)
        if head == "score":
            writer.add(SCORE_HEAD, weights["output_layer.weight"].clone())
        writer.close()


class ShardedWriter:
    """HF safetensors output in files of at most `max_bytes` (one tensor larger than that gets a file alone):
    `model.safetensors` when one file suffices, else numbered files and `model.safetensors.index.json`."""

    def __init__(self, out_dir: Path, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out_dir / f"part-{len(self.files)}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        with_the_users_umask(path)
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending:
            self._flush()
        count = len(self.files)
        if count == 1:
            os.replace(self.out_dir / "part-0.safetensors", self.out_dir / "model.safetensors")
            return
        weight_map, total = {}, 0
        for index, names in enumerate(self.files):
            final = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.out_dir / f"part-{index}.safetensors", self.out_dir / final)
            weight_map.update({name: final for name in names})
            total += (self.out_dir / final).stat().st_size
        index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2))


def export_checkpoint(ckpt_dir: Path, out_dir: Path, *, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write an HF checkpoint of the megarl checkpoint `ckpt_dir` into `out_dir`; returns `out_dir`.

    InputError when `ckpt_dir` is not a complete megarl checkpoint or its recorded
    tokenizer dir is gone; RuntimeError when called in a process that already runs
    torch.distributed.
    """
    from megarl.engines.checkpoint import read_checkpoint_info

    ckpt_dir, out_dir = Path(ckpt_dir).expanduser().resolve(), Path(out_dir).expanduser().resolve()
    info = read_checkpoint_info(ckpt_dir)
    if info.lora is not None:
        raise InputError(f"checkpoint {ckpt_dir}: holds LoRA adapters, not full weights: export them with --lora OUT "
                         f"(a PEFT adapter) or --merge OUT (an HF checkpoint with the adapters merged)")
    if info.head not in ("lm", "score"):
        raise InputError(f"checkpoint {ckpt_dir}: a {info.head} model (a critic) has no HF checkpoint form; "
                         f"export a policy's or a reward model's checkpoint")
    tokenizer_dir = checked_tokenizer_dir(info, ckpt_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_hf_weights(ckpt_dir, info.hf_config, info.params_dtype, out_dir, max_shard_bytes, head=info.head)
    write_config_and_tokenizer(info, tokenizer_dir, out_dir)
    return out_dir


def checked_tokenizer_dir(info, ckpt_dir: Path) -> Path | None:
    """The tokenizer dir a checkpoint recorded (None: none); InputError when it is gone."""
    tokenizer_dir = Path(info.tokenizer_path).expanduser() if info.tokenizer_path else None
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        raise InputError(f"checkpoint {ckpt_dir}: tokenizer_path {info.tokenizer_path!r} does not exist")
    return tokenizer_dir


def write_config_and_tokenizer(info, tokenizer_dir: Path | None, out_dir: Path) -> None:
    """`config.json` (in the engine's dtype; a reward model's as a one-label sequence classifier) and the recorded
    tokenizer's files, next to exported weights."""
    if info.head == "score":
        config = reward_model_hf_config(info.hf_config, pad_token_id=info.hf_config.get("pad_token_id"),
                                        dtype=info.params_dtype)
    else:
        # `dtype` is what transformers 5 reads, `torch_dtype` what older readers (SGLang) do.
        config = {**info.hf_config, "dtype": info.params_dtype, "torch_dtype": info.params_dtype}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if tokenizer_dir is not None and tokenizer_dir.resolve() != out_dir:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, out_dir / name)
