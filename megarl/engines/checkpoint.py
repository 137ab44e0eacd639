"""Distributed checkpoints of an engine: model, optimizer and LR schedule via megatron's dist_checkpointing.

A checkpoint dir holds megatron's sharded checkpoint (`metadata.json`, `common.pt`,
`*.distcp`) plus `megarl_checkpoint.json`: the HF config, tokenizer path, parameter
dtype, the model's head (`lm`: a policy; `value`: a critic; `score`: a reward model)
and the layout it was saved at. Tensors are stored by global (layout-free) keys,
so a checkpoint saved at one TP/PP/VPP/EP layout loads at any other; the vocab-padded
embedding and output layer may change padding (megatron marks them shape-mismatch
tolerant). The JSON file is written last, after every rank finished: a dir without it
is an incomplete save.

Each rank's RNG states (torch CPU, CUDA, megatron's tensor-parallel tracker) are saved
too, one object per rank; like megatron, they are restored only at the layout they were
saved at (at another layout a rank has no counterpart, and keeps its seeded state).
The LR schedule is restored as the loading engine's settings at the saved step count,
so a resumed run may change its total steps (and with them the decay horizon).

Checkpoints do not depend on the layer spec: megatron's local spec already stores its
norms under Transformer Engine's names (`...linear_qkv.layer_norm_weight`); the one
key the two specs disagree on (a MoE layer's pre-MLP norm) is stored under the local
spec's key, and `_extra_state` entries (TE's FP8 metadata; None in local layers;
megarl never trains in FP8) are left out. `load_policy_weights` loads only the
weights of a policy checkpoint, optionally without the output layer (a value model
starting from the actor's backbone): each rank reads only its own shards.

A policy with LoRA adapters (`megarl.engines.lora`) checkpoints its adapters alone (and their
optimizer state): the frozen base is where the engine loaded it from, recorded with the LoRA
settings under `lora` in `megarl_checkpoint.json` (its `base`: the HF dir, or the seed of a
random base), so a checkpoint weighs megabytes. Adapters are stored under global keys, split
as their linears' weights are, so they too load at any layout.

Save and load are collectives over all ranks of the engine. A save is synchronous: megatron's
writer hands its results from one function to the next in this process through an in-process
queue (`_in_process_write_results`), not through the spawn-started multiprocessing Manager it
would start otherwise (a whole Python process per rank, ~5 CPU s at its first save, and a script
that saves would have to guard its entry point with `if __name__ == "__main__":`).
"""

from __future__ import annotations

import json
import os
import queue
from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megarl.engines.distributed import parallel_layout
from megarl.engines.gpt import ADAPTERS_PREFIX, GPTModelChunks
from megarl.engines.optim import TrainState
from megarl.errors import InputError
from megarl.models.spec import arch_from_hf

METADATA_FILE = "megarl_checkpoint.json"
FORMAT_VERSION = 1


def _in_process_write_results() -> None:
    """Give megatron's torch_dist writer an in-process queue for its write results.

    `FileSystemWriterAsync` takes that queue from a multiprocessing Manager started with spawn (once per
    process: a fresh interpreter that imports torch, ~5 CPU s per rank; 46 of them in one test suite run) so
    that an asynchronous save, run in another process, can report back. megarl saves synchronously:
    `write_preloaded_data_multiproc` puts the results and `retrieve_write_results` takes them, both in this
    process, so a `queue.Queue` carries them. The writer's own file-writing children keep their queue."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


@dataclass(frozen=True)
class CheckpointInfo:
    """What `megarl_checkpoint.json` records about a checkpoint."""

    hf_config: dict
    tokenizer_path: str | None
    params_dtype: str
    has_optimizer: bool
    saved_layout: dict
    # False when the optimizer had not stepped yet (Adam keeps no state then).
    has_optimizer_state: bool = True
    has_rng_state: bool = False  # checkpoints written before RNG states were saved have none
    head: str = "lm"  # "lm" (policy), "value" (critic) or "score" (reward model); older checkpoints: policies
    # LoRA adapters only: {"rank", "alpha", "dropout", "targets", "init", "base": {"path", "seed"}}; None: full weights
    lora: dict | None = None


def read_checkpoint_info(ckpt_dir: str | Path) -> CheckpointInfo:
    """The metadata of a complete checkpoint; InputError naming the dir if it is not one."""
    path = Path(ckpt_dir).expanduser() / METADATA_FILE
    if not path.is_file():
        raise InputError(f"checkpoint {ckpt_dir}: {METADATA_FILE} not found (not a megarl checkpoint, or incomplete)")
    data = json.loads(path.read_text())
    if data.get("format_version") != FORMAT_VERSION:
        version = data.get("format_version")
        raise InputError(f"checkpoint {ckpt_dir}: format_version={version!r}, expected {FORMAT_VERSION}")
    return CheckpointInfo(
        hf_config=data["hf_config"],
        tokenizer_path=data["tokenizer_path"],
        params_dtype=data["params_dtype"],
        has_optimizer=data["has_optimizer"],
        saved_layout=data["saved_layout"],
        has_optimizer_state=data.get("has_optimizer_state", data["has_optimizer"]),
        has_rng_state=data.get("has_rng_state", False),
        head=data.get("head", "lm"),
        lora=data.get("lora"),
    )


# TE's layer spec keeps a MoE layer's pre-MLP norm as a module of its own; the local spec
# (megatron's `sharded_state_dict_keys_map`) stores it under the fused-norm key.
_KEY_ALIASES = {".pre_mlp_layernorm.": ".mlp.linear_fc1.layer_norm_"}


def checkpoint_key(key: str) -> str:
    """The key a sharded tensor is stored under, the same for either layer spec."""
    for alias, key_in_file in _KEY_ALIASES.items():
        key = key.replace(alias, key_in_file)
    return key


def _stored(name: str, *, backbone_only: bool, adapters_only: bool) -> bool:
    """Whether a chunk's state entry `name` goes into (and comes out of) a checkpoint."""
    if name.endswith("._extra_state") or (backbone_only and name.startswith("output_layer.")):
        return False
    return name.startswith(ADAPTERS_PREFIX) or not adapters_only


def _chunk_state(chunk, *, backbone_only: bool = False, adapters_only: bool = False) -> dict:
    state = {}
    for name, item in chunk.sharded_state_dict().items():
        if not _stored(name, backbone_only=backbone_only, adapters_only=adapters_only):
            continue
        item.key = checkpoint_key(item.key)
        state[name] = item
    return state


def sharded_model_state(model: GPTModelChunks, *, backbone_only: bool = False, adapters_only: bool = False) -> dict:
    """What a checkpoint stores of `model` (`backbone_only`: without the output layer; `adapters_only`: the LoRA
    adapters alone), as megatron's sharded state dict per VPP chunk."""
    # The tensors inside carry global keys, so the dict nesting does not have to match
    # between the saving and the loading layout.
    return {f"model{i}": _chunk_state(chunk, backbone_only=backbone_only, adapters_only=adapters_only)
            for i, chunk in enumerate(model.chunks)}


def _load_into_chunks(model: GPTModelChunks, loaded: dict, *, backbone_only: bool = False,
                      adapters_only: bool = False) -> None:
    """Copy loaded weights into the chunks; only the entries left out of checkpoints may be missing."""
    for i, chunk in enumerate(model.chunks):
        result = chunk.load_state_dict(loaded[f"model{i}"], strict=False)
        missing = [name for name in result.missing_keys
                   if _stored(name, backbone_only=backbone_only, adapters_only=adapters_only)]
        if missing or result.unexpected_keys:
            raise ValueError(f"checkpoint does not fit model chunk {i}: missing {missing[:5]}, "
                             f"unexpected {result.unexpected_keys[:5]}")


def _barrier() -> None:
    torch.distributed.barrier()


def _layout_record(model: GPTModelChunks) -> dict[str, int]:
    layout = parallel_layout()
    return {"tp": layout["tp_size"], "pp": layout["pp_size"], "vpp": len(model.chunks), "dp": layout["dp_size"],
            "world_size": layout["world_size"]}


def _rng_state() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_rng_state() -> ShardedObject:
    """This rank's RNG states as one object of a per-rank array (each rank writes its own)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)


def save_checkpoint(
    model: GPTModelChunks,
    train: TrainState | None,
    ckpt_dir: str | Path,
    *,
    hf_config: dict,
    tokenizer_path: str | None,
    engine_state: dict,
    weights_only: bool = False,
    head: str = "lm",
    lora_record: dict | None = None,
) -> Path:
    """Save model (+ optimizer and LR schedule when `train` and not `weights_only`), `engine_state`
    (plain, identical on all ranks) and each rank's RNG states; collective. An existing checkpoint
    in the dir is replaced. `head` records which model it is (see `CheckpointInfo.head`); `lora_record`
    (a LoRA policy: its settings and base): the adapters alone."""
    if weights_only:
        train = None
    ckpt_dir = Path(ckpt_dir).expanduser().resolve()
    is_writer = torch.distributed.get_rank() == 0
    if is_writer:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        (ckpt_dir / METADATA_FILE).unlink(missing_ok=True)  # incomplete until the new one is written
    _barrier()
    state: dict = {**sharded_model_state(model, adapters_only=lora_record is not None), "engine": engine_state,
                   "rng": _sharded_rng_state()}
    # Before the first step there are no moments to save, and megatron's sharded optimizer
    # state would ask the loader for moments that do not exist.
    with_optimizer_state = train is not None and train.has_state()
    if with_optimizer_state:
        model_state = {k: v for k, v in state.items() if k.startswith("model")}
        state["optimizer"] = train.optimizer.sharded_state_dict(model_state, is_loading=False)
    if train is not None:
        state["scheduler"] = train.scheduler.state_dict()
    _in_process_write_results()
    dist_checkpointing.save(state, str(ckpt_dir))
    _barrier()
    if is_writer:
        info = {
            "format_version": FORMAT_VERSION,
            "hf_config": hf_config,
            "tokenizer_path": tokenizer_path,
            "params_dtype": str(model.config.params_dtype).removeprefix("torch."),
            "has_optimizer": train is not None,
            "has_optimizer_state": with_optimizer_state,
            "has_rng_state": True,
            "head": head,
            "saved_layout": _layout_record(model),
            "lora": lora_record,
        }
        tmp = ckpt_dir / (METADATA_FILE + ".tmp")
        tmp.write_text(json.dumps(info, indent=2, sort_keys=True))
        os.replace(tmp, ckpt_dir / METADATA_FILE)
    _barrier()
    return ckpt_dir


def _check_same_model(info: CheckpointInfo, model: GPTModelChunks, ckpt_dir: Path, *,
                      backbone_only: bool = False) -> None:
    saved = arch_from_hf(info.hf_config)
    ours = model.arch
    # Only dimensions decide whether tensors fit; max_position_embeddings etc. may differ. Whether the LM head
    # is tied matters only where the head is loaded.
    fields = ("model_type", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "head_dim", "vocab_size", "qkv_bias", "qk_layernorm",
              *(() if backbone_only else ("tie_word_embeddings",)), "num_experts", "moe_ffn_hidden_size")
    problems = [
        f"checkpoint {ckpt_dir}: {name}={getattr(saved, name)!r}, the engine's model has {getattr(ours, name)!r}"
        for name in fields
        if getattr(saved, name, None) != getattr(ours, name, None)
    ]
    if problems:
        raise InputError(problems)


def _check_same_adapters(info: CheckpointInfo, lora_record: dict | None, ckpt_dir: Path) -> None:
    """InputError when the checkpoint's LoRA adapters (or full weights) do not fit the engine's."""
    if (info.lora is None) != (lora_record is None):
        held = "LoRA adapters" if info.lora is not None else "full weights"
        ours = "LoRA adapters" if lora_record is not None else "full weights"
        raise InputError(f"checkpoint {ckpt_dir}: holds {held}, the engine trains {ours} (actor.lora differs)")
    if info.lora is not None:
        problems = [f"checkpoint {ckpt_dir}: LoRA {key}={info.lora[key]!r}, the engine's is {lora_record[key]!r}"
                    for key in ("rank", "targets") if info.lora[key] != lora_record[key]]
        if problems:
            raise InputError(problems)


def load_model_state(model: GPTModelChunks, ckpt_dir: Path) -> None:
    """Only the model weights of a checkpoint, into `model` at the current layout; collective."""
    _load_into_chunks(model, dist_checkpointing.load(sharded_model_state(model), str(ckpt_dir)))


def load_policy_weights(model: GPTModelChunks, ckpt_dir: str | Path, *, backbone_only: bool) -> None:
    """The weights of a policy checkpoint (any layout) into `model` at the current layout; collective.

    `backbone_only=True` (a value model) loads everything but the output layer. Each rank
    reads only the shards its own parameters need.
    """
    ckpt_dir = Path(ckpt_dir).expanduser().resolve()
    info = read_checkpoint_info(ckpt_dir)
    if info.lora is not None:
        raise InputError(f"checkpoint {ckpt_dir}: holds LoRA adapters without their base weights; load the base "
                         f"({info.lora['base']}) instead")
    _check_same_model(info, model, ckpt_dir, backbone_only=backbone_only)
    loaded = dist_checkpointing.load(sharded_model_state(model, backbone_only=backbone_only), str(ckpt_dir))
    _load_into_chunks(model, loaded, backbone_only=backbone_only)


def load_checkpoint(
    model: GPTModelChunks, train: TrainState | None, ckpt_dir: str | Path, *, load_optimizer: bool,
    lora_record: dict | None = None,
) -> dict:
    """Load a checkpoint saved at any layout into `model` (and `train`'s optimizer and schedule
    when `load_optimizer`, and the ranks' RNG states when saved at this layout); collective.
    `lora_record`: the engine is a LoRA policy, whose checkpoints hold its adapters alone.
    Returns the saved `engine_state`."""
    ckpt_dir = Path(ckpt_dir).expanduser().resolve()
    info = read_checkpoint_info(ckpt_dir)
    _check_same_model(info, model, ckpt_dir)
    _check_same_adapters(info, lora_record, ckpt_dir)
    adapters_only = lora_record is not None
    with_optimizer = train is not None and load_optimizer
    if with_optimizer and not info.has_optimizer:
        raise InputError(f"checkpoint {ckpt_dir}: saved without optimizer state (load with load_optimizer=False)")
    state = sharded_model_state(model, adapters_only=adapters_only)
    if with_optimizer and info.has_optimizer_state:
        state["optimizer"] = train.optimizer.sharded_state_dict(dict(state), is_loading=True)
    restore_rng = info.has_rng_state and info.saved_layout == _layout_record(model)
    if restore_rng:
        state["rng"] = _sharded_rng_state()
    loaded = dist_checkpointing.load(state, str(ckpt_dir))
    _load_into_chunks(model, loaded, adapters_only=adapters_only)
    if with_optimizer and info.has_optimizer_state:
        train.optimizer.load_state_dict(loaded["optimizer"])
    elif with_optimizer:
        train.reset_state()  # saved before the first step: start fresh
        train.optimizer.reload_model_params()
    if with_optimizer:
        # The engine's own schedule settings win (a resumed run may run longer); the step count is restored.
        train.scheduler.override_opt_param_scheduler = True
        train.scheduler.load_state_dict(loaded["scheduler"])
    elif train is not None:
        # Mixed precision keeps fp32 main copies inside the optimizer: refresh them.
        train.optimizer.reload_model_params()
    if restore_rng:
        _set_rng_state(loaded["rng"])
    return loaded.get("engine", {})
