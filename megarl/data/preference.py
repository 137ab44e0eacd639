"""Preference pairs for `megarl train-rm`: the parquet format, reading it, and pairs made from the arithmetic task.

A pair row is `prompt` (chat messages, as in the RL data of docs/data.md), `chosen`
and `rejected` (response texts); the reward model should score `chosen` higher. An
optional `margin` column (a finite number per row) asks for a score gap of at least
that much: the loss becomes -log sigmoid(s(chosen) - s(rejected) - margin), as in
TRL's and OpenRLHF's reward trainers; a file without it trains the plain loss.
The arithmetic pairs prefer the task's reference answer (`#### <sum>`) over a wrong
response of the kinds the task's own policy produces: mostly a sum off by a carry or a
digit (at the rates measured on the quickstart policy), else a random number or the
right number without the `####` the rule requires.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megarl import atomic
from megarl.data.rows import preview, read_checked_rows
from megarl.data.synthetic import arithmetic_pairs, arithmetic_rows
from megarl.errors import InputError

PAIR_SCHEMA = pa.schema(
    [
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("chosen", pa.string()),
        ("rejected", pa.string()),
    ]
)
# How far a policy learning addition misses: |answer - sum| and its relative frequency among the wrong answers
# of the CPU quickstart's policy right after its SFT warm-up (200 problems x 8 samples at temperature 1): off by a
# carry (10), a units digit (1, 2) or both (9, 11). Both signs are drawn alike: that policy mostly under-carries
# (-10, -9), but a policy optimised against the reward model drifts to whatever misses the model never saw; trained
# on the measured signs alone, the reward model preferred sum + 10 to the sum, and GRPO taught the policy to add 10.
MISS_SIZES = {1: 320, 10: 250, 9: 196, 2: 99, 8: 71, 11: 57, 3: 28, 19: 21, 20: 17, 7: 17, 12: 17}


def _row_problems(row: dict) -> list[str]:
    problems = []
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        problems.append(f"prompt is not a non-empty list of {{role, content}} messages (got {preview(prompt)})")
    for key in ("chosen", "rejected"):
        if not isinstance(row.get(key), str):
            problems.append(f"{key} is not a string (got {preview(row.get(key))})")
    if "margin" in row:
        margin = row["margin"]
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
            problems.append(f"margin is not a finite number (got {preview(margin)})")
    if not problems and row["chosen"] == row["rejected"]:
        problems.append("chosen and rejected are the same response")
    return problems


def read_pairs(paths: Sequence[Path]) -> list[dict]:
    """All pair rows of the parquet files; InputError naming the file and row of every unusable one."""
    rows = read_checked_rows(paths, what="pair file", row_problems=_row_problems)
    if not rows:
        raise InputError(f"pair files {[str(p) for p in paths]}: no pairs")
    return rows


def write_pairs(rows: Sequence[dict], path: Path) -> Path:
    """`rows` as a pair file; with a `margin` column when the rows have margins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = PAIR_SCHEMA.append(pa.field("margin", pa.float64())) if any("margin" in r for r in rows) else PAIR_SCHEMA
    pq.write_table(pa.Table.from_pylist(list(rows), schema=schema), path)
    return path


def wrong_response(total: int, rng: random.Random) -> str:
    """A response to "a+b=?" that the GSM8K rule scores 0: the sum without `####` (1 in 10), a random number
    (1 in 10), else a near miss of a size drawn from `MISS_SIZES`, above or below the sum."""
    kind = rng.random()
    if kind < 0.1:
        return str(total)
    if kind < 0.2:
        wrong = rng.randint(0, 2 * max(total, 9))
    else:
        wrong = total + rng.choice((-1, 1)) * rng.choices(list(MISS_SIZES), list(MISS_SIZES.values()))[0]
    if wrong < 0 or wrong == total:
        wrong = total + 1
    return f"#### {wrong}"


def arithmetic_preference_rows(num: int, *, seed: int, split: str, max_operand: int,
                               exclude_pairs: Sequence[tuple[int, int]] = ()) -> list[dict]:
    """`num` pairs over the problems `arithmetic_rows` draws (same arguments): reference answer vs a wrong one."""
    rng = random.Random(f"megarl/arithmetic-pairs:{seed}:{split}")
    rows = arithmetic_rows(num, seed=seed, split=split, max_operand=max_operand, exclude_pairs=exclude_pairs)
    return [{"prompt": row["prompt"], "chosen": row["extra_info"]["answer"],
             "rejected": wrong_response(int(row["reward_model"]["ground_truth"]), rng)} for row in rows]


def write_arithmetic_preferences(out_dir: Path, num_train: int, num_val: int, seed: int,
                                 max_operand: int) -> tuple[Path, Path]:
    """`train.parquet` and `val.parquet` of arithmetic pairs; no validation problem appears in training."""
    val_rows = arithmetic_preference_rows(num_val, seed=seed, split="pairs-val", max_operand=max_operand)
    held_out = arithmetic_pairs(num_val, seed=seed, split="pairs-val", max_operand=max_operand)
    train_rows = arithmetic_preference_rows(num_train, seed=seed, split="pairs-train", max_operand=max_operand,
                                            exclude_pairs=held_out)
    train_path, val_path = Path(out_dir) / "train.parquet", Path(out_dir) / "val.parquet"
    atomic.write_files({train_path: functools.partial(write_pairs, train_rows),
                        val_path: functools.partial(write_pairs, val_rows)})
    return train_path, val_path
