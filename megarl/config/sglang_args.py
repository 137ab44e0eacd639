"""Which SGLang server arguments a recipe's `rollout.sglang` (and `reward.judge.sglang`) block may pass through.

megarl sets some arguments itself (model, parallelism, memory share, address, secrets, weight version,
memory-saver switches); a pass-through key naming one of them is a user error naming the recipe field to
use instead, so a run never starts with two values for one flag. `--admin-api-key` is refused outright:
with it SGLang answers every weight and memory call that lacks that key with 401, and megarl's calls carry
the run's API key. Keys are SGLang flag names, `snake_case` or `kebab-case`.
"""

from __future__ import annotations

import re
from typing import Any

# SGLang flag (without dashes) -> the recipe field that sets it.
OWNED_FLAGS = {
    "model-path": "model (the fleet loads the run's weights)",
    "tp-size": "rollout.tp",
    "tp": "rollout.tp",
    "tensor-parallel-size": "rollout.tp",
    "mem-fraction-static": "rollout.mem_fraction",
    "host": "rollout.host",
    "port": "rollout.port",
    "api-key": "nothing (every run gets its own key)",
    "admin-api-key": ("nothing (megarl's weight and memory calls carry the run's API key; with an admin key "
                      "SGLang would answer each of them 401)"),
    "config": "nothing (megarl passes the run's secrets in a config file of its own)",
    "weight-version": "nothing (the fleet tracks weight versions)",
    "skip-tokenizer-init": "nothing (megarl sends and reads token ids)",
    "enable-memory-saver": "nothing (set by the placement)",
    "enable-weights-cpu-backup": "nothing (set by the placement)",
    "enable-deterministic-inference": "rollout.deterministic",
}
_KEY = re.compile(r"^[a-z][a-z0-9]*([_-][a-z0-9]+)*$")


def sglang_block_problems(block: dict[str, Any], *, where: str) -> list[str]:
    """One line per key of `block` that is not an SGLang argument name or that megarl sets itself."""
    problems = []
    for key in block:
        if not isinstance(key, str) or not _KEY.match(key):
            problems.append(f"{where}.{key}: not an SGLang argument name (lowercase words joined by _ or -)")
        elif key.replace("_", "-") in OWNED_FLAGS:
            problems.append(f"{where}.{key}: set by megarl; use {OWNED_FLAGS[key.replace('_', '-')]}")
    return problems
