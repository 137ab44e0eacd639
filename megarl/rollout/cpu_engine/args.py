"""The command line of `python -m megarl.rollout.cpu_engine`, parsed and checked without torch.

Arguments may also come from `--config FILE.yaml`, as SGLang 0.5.23's do: a mapping of flag names
(`api-key: KEY`; true for a switch) placed before the command line's arguments, so the command line wins.
That keeps the API key off the command line, which every local user can read. Bad arguments are one line
and exit status 2, before anything is loaded: a missing tokenizer directory, a model directory without
config.json, with a config.json that is no JSON object or with an unreadable safetensors file, a timeout
that is not a positive number, LoRA flags SGLang refuses (its messages). Nothing here imports torch,
transformers or the server, so a bad argument fails in a fraction of a second, not after seconds of imports.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import yaml
from safetensors import safe_open

# SGLang's --dtype names -> the torch dtype's name ("auto" keeps the checkpoint's torch_dtype).
DTYPE_NAMES = {"auto": "auto", "float32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "float16": "float16", "half": "float16"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megarl.rollout.cpu_engine", description=__doc__)
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="read further arguments from this YAML mapping of flag names (the command line wins)")
    parser.add_argument("--model-path", required=True, help="HF model dir (config.json + safetensors)")
    parser.add_argument("--tokenizer-path", default=None, help="tokenizer dir (default: the model dir, if it has one)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on all but /health")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--max-batch", type=int, default=256, help="most sequences decoded together")
    parser.add_argument("--weight-version", default="default", help="initial weight_version")
    parser.add_argument("--seed", type=int, default=0, help="seed for requests without sampling_seed")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_NAMES),
                        help="weight dtype, as SGLang's --dtype ('auto': the checkpoint's torch_dtype); float32 by "
                             "default because bf16 matmuls on CPU are slow and round log-probs")
    parser.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--enable-memory-saver", action="store_true",
                        help="allow /release_memory_occupation and /resume_memory_occupation (SGLang's flag)")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true",
                        help="resume released weights from a host copy (without it they come back undefined: NaN)")
    parser.add_argument("--health-check-timeout-s", type=float, default=20.0,
                        help="how long /health waits for its one-token generation (SGLANG_HEALTH_CHECK_TIMEOUT)")
    parser.add_argument("--weight-update-group-timeout-s", type=float, default=600.0,
                        help="how long joining or receiving from a weight-update group may take")
    parser.add_argument("--max-request-bytes", type=int, default=16 << 20,
                        help="largest request body; a larger one gets 413 before it is read (a body is decoded "
                             "on a worker thread, but while it is the event loop waits for the interpreter: the "
                             "bound keeps that wait short)")
    parser.add_argument("--max-sequences", type=int, default=256,
                        help="most sequences (prompts x n) one /generate may ask for; more get 400")
    parser.add_argument("--max-reply-entries", type=int, default=1 << 22,
                        help="most token entries one reply may hold, counted as n x tokens x (1 + top_logprobs_num); "
                             "a request that could exceed it gets 400")
    pool = parser.add_argument_group("KV-cache pool (SGLang's rule: megarl.rollout.cpu_engine.kv_pool)")
    pool.add_argument("--device-memory-bytes", type=int, default=None,
                      help="the memory SGLang would find free on its device at start (a CPU has none to measure); "
                           "with --mem-fraction-static it sizes the pool, as on a GPU")
    pool.add_argument("--mem-fraction-static", type=float, default=None,
                      help="SGLang's flag: the share of the free memory the weights and the KV pool take")
    pool.add_argument("--max-total-tokens", type=int, default=None,
                      help="SGLang's flag: the most tokens the pool holds (only ever lowers it)")
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="honour each request's sampling_seed (SGLang's flag: without it a seed is ignored)")
    lora = parser.add_argument_group("LoRA serving (SGLang's flags)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-paths)")
    lora.add_argument("--lora-paths", nargs="*", default=None,
                      help="adapters loaded at start: PATH | NAME=PATH | JSON {lora_name, lora_path, pinned}")
    lora.add_argument("--max-lora-rank", type=int, default=None, help="largest rank a loaded adapter may have")
    lora.add_argument("--lora-target-modules", nargs="*", default=None,
                      help="modules adapters may target (q_proj ... down_proj, or all)")
    lora.add_argument("--max-loras-per-batch", type=int, default=8,
                      help="most adapters (the base model counting as one) in one running batch")
    lora.add_argument("--max-loaded-loras", type=int, default=None,
                      help="most adapters loaded; beyond it the least recently used unpinned one is unloaded")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = with_config(argv)
    except ValueError as error:
        parser.error(str(error))
    args = parser.parse_args(argv)
    for problem in check_lora_args(enable_lora=args.enable_lora, lora_paths=args.lora_paths,
                                   max_lora_rank=args.max_lora_rank, lora_target_modules=args.lora_target_modules,
                                   max_loras_per_batch=args.max_loras_per_batch,
                                   max_loaded_loras=args.max_loaded_loras):
        parser.error(problem)
    for flag in ("max_batch", "threads", "max_request_bytes", "max_sequences", "max_reply_entries",
                 "device_memory_bytes", "max_total_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be >= 1 (got {getattr(args, flag)})")
    if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static <= 1:
        parser.error(f"--mem-fraction-static: must be in (0, 1] (got {args.mem_fraction_static})")
    if (args.device_memory_bytes is None) != (args.mem_fraction_static is None):
        parser.error("--device-memory-bytes and --mem-fraction-static: give both (the pool is the fraction of that "
                     f"memory less the weights) or neither (got {args.device_memory_bytes}, "
                     f"{args.mem_fraction_static})")
    for flag in ("health_check_timeout_s", "weight_update_group_timeout_s"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and value > 0):
            parser.error(f"--{flag.replace('_', '-')}: must be a positive number of seconds (got {value})")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port: {args.port} is not a TCP port (0-65535)")
    model = Path(args.model_path)
    if not (model / "config.json").is_file():
        parser.error(f"--model-path: {model} holds no config.json (not an HF model directory)")
    problem = _unreadable_config(model / "config.json")
    if problem:
        parser.error(f"--model-path: {model / 'config.json'} is not an HF model config ({problem})")
    for weights in sorted(model.glob("*.safetensors")):
        problem = _unreadable_safetensors(weights)
        if problem:
            parser.error(f"--model-path: {weights} is not a readable safetensors file ({problem})")
    if args.tokenizer_path is not None and not Path(args.tokenizer_path).is_dir():
        parser.error(f"--tokenizer-path: {args.tokenizer_path} is not a directory")
    return args


def with_config(argv: list[str]) -> list[str]:
    """`argv` with `--config FILE.yaml` replaced by the file's arguments, placed first (SGLang's rule: the
    command line wins over the file, the file over the defaults). ValueError naming what is wrong."""
    at = [index for index, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        raise ValueError("--config: given more than once; one config file at most")
    index = at[0]
    if argv[index] == "--config":
        if index + 1 >= len(argv):
            raise ValueError("--config: no file given")
        path, rest = Path(argv[index + 1]), argv[:index] + argv[index + 2:]
    else:
        path, rest = Path(argv[index].split("=", 1)[1]), argv[:index] + argv[index + 1:]
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ValueError(f"--config: {path} is not a YAML file (.yaml or .yml)")
    try:
        content = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--config: cannot read {path}: {error}".replace("\n", " ")) from None
    content = {} if content is None else content
    if not isinstance(content, dict):
        raise ValueError(f"--config: {path} must hold a mapping of flag names to values")
    return [*_as_flags(content), *rest]


def _as_flags(content: dict) -> list[str]:
    flags = []
    for key, value in content.items():
        if value is True:
            flags.append(f"--{key}")
        elif isinstance(value, list):
            flags += [f"--{key}", *map(str, value)] if value else []
        elif value is not False and value is not None:
            flags += [f"--{key}", str(value)]
    return flags


def _unreadable_config(path: Path) -> str | None:
    """Why transformers could not read `path` as a model config (it must be a JSON object); None when it can."""
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return f"{type(error).__name__}: {error}".replace("\n", " ")[:200]
    return None if isinstance(content, dict) else f"a JSON {type(content).__name__}, not an object"


def _unreadable_safetensors(path: Path) -> str | None:
    """Why `path` cannot be opened as safetensors (its header is read, not its tensors); None when it can.
    The numpy reader parses the header exactly as torch's does (same errors) without importing torch."""
    try:
        with safe_open(str(path), framework="numpy") as opened:
            opened.keys()
    except Exception as error:  # noqa: BLE001 - safetensors raises several types for a bad header
        return f"{type(error).__name__}: {error}".replace("\n", " ")[:200]
    return None


def check_lora_args(*, enable_lora: bool, lora_paths: list[str] | None, max_lora_rank: int | None,
                    lora_target_modules: list[str] | None, max_loras_per_batch: int,
                    max_loaded_loras: int | None) -> list[str]:
    """SGLang's start-up checks of the LoRA server arguments (its messages); empty when they fit."""
    if not (enable_lora or lora_paths):
        return []
    problems = []
    if lora_target_modules and "all" in lora_target_modules and len(lora_target_modules) != 1:
        problems.append("If 'all' is specified in --lora-target-modules, it should be the only module specified.")
    if not lora_paths and not (max_lora_rank and lora_target_modules):
        problems.append("When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
                        "--lora-target-modules for LoRA initialization.")
    if max_loaded_loras is not None and max_loaded_loras < max_loras_per_batch:
        problems.append("max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                        f"max_loaded_loras={max_loaded_loras}, max_loras_per_batch={max_loras_per_batch}")
    return problems
