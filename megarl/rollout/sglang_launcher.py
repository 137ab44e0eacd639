"""The `python -m sglang.launch_server` command line of one rollout server.

megarl sets the arguments it owns (model, parallelism, memory share, address,
the `--config` file of the run's secrets, weight version, tokenizer and
memory-saver switches); everything else comes verbatim from the recipe's
`rollout.sglang` block, one key per server argument. A pass-through key that
megarl owns is a user error naming the recipe field to use instead
(`config.sglang_args`), so a run never starts with two values for one flag.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from megarl.config.sglang_args import sglang_block_problems
from megarl.errors import InputError

def passthrough_args(block: dict[str, Any], *, where: str = "rollout.sglang") -> list[str]:
    """`{key: value}` -> `--key value` in the block's order.

    `snake_case` keys become `--kebab-case`; True is a bare flag, False and None
    are left out; a list is `--key v1 v2 ...`; a dict is one JSON argument.
    """
    problems = sglang_block_problems(block, where=where)
    if problems:
        raise InputError(problems)
    argv: list[str] = []
    for key, value in block.items():
        flag = key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(f"--{flag}")
        elif isinstance(value, (list, tuple)):
            if not value or any(isinstance(item, (dict, list, tuple)) for item in value):
                problems.append(f"{where}.{key}: a list must be non-empty and hold plain values, got {value!r}")
                continue
            argv += [f"--{flag}", *(_scalar(item) for item in value)]
        elif isinstance(value, dict):
            argv += [f"--{flag}", json.dumps(value, sort_keys=True)]
        else:
            argv += [f"--{flag}", _scalar(value)]
    if problems:
        raise InputError(problems)
    return argv


def sglang_server_argv(
    *,
    model_path: str | Path,
    host: str,
    port: int,
    tp_size: int,
    mem_fraction_static: float,
    config: str | Path | None,
    weight_version: str | None = None,
    skip_tokenizer_init: bool = True,
    enable_memory_saver: bool = False,
    enable_weights_cpu_backup: bool = False,
    deterministic: bool = False,
    extra: dict[str, Any] | None = None,
    python: str = sys.executable,
    lora_max_rank: int | None = None,
    lora_target_modules: tuple[str, ...] = (),
) -> list[str]:
    """The full argv: megarl's arguments first, then the pass-through block. `config` is the YAML file of
    the run's secrets (the API key), which SGLang reads with `--config`: never a secret on the command line.
    `lora_max_rank`: serve LoRA adapters of at most that rank on `lora_target_modules` (SGLang needs both to load
    adapters at run time)."""
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(model_path)]
    argv += ["--tp-size", str(tp_size), "--mem-fraction-static", _scalar(mem_fraction_static)]
    argv += ["--host", host, "--port", str(port)]
    if config is not None:
        argv += ["--config", str(config)]
    if weight_version is not None:
        argv += ["--weight-version", str(weight_version)]
    if skip_tokenizer_init:
        argv.append("--skip-tokenizer-init")
    if enable_memory_saver:
        argv.append("--enable-memory-saver")
    if enable_weights_cpu_backup:
        argv.append("--enable-weights-cpu-backup")
    if deterministic:
        argv.append("--enable-deterministic-inference")  # SGLang reads sampling_seed only with it
    if lora_max_rank is not None:
        argv += ["--enable-lora", "--max-lora-rank", str(lora_max_rank), "--lora-target-modules", *lora_target_modules]
    return argv + passthrough_args(extra or {})


def _scalar(value: Any) -> str:
    # repr keeps a float's full precision and reads back exactly (0.1 -> "0.1").
    return repr(value) if isinstance(value, float) else str(value)
