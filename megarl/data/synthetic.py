"""The synthetic `megarl/arithmetic` task: "07+45=?" in GSM8K row format.

A task small models can learn on CPU in minutes, scored by the GSM8K strict
scorer. The reference solution, which the optional SFT warm-up teaches, comes in
two forms:
- "answer": exactly `#### <sum>`, so responses are a few tokens long;
- "worked": the sum worked column by column before the answer, one line per column
  ("ones: 7 + 5 + 0 = 12, write 2 carry 1"), as a GSM8K solution works its steps.
  Responses are then ~30 tokens per column (builtin tokenizer), long enough for generation to weigh as
  much as training in a step (the asynchronous quickstart's split).
Operands are zero-padded to a fixed width and placed right before the answer, and
a worked line writes every sum with two digits, so every digit sits at a fixed
distance from the tokens that use it: a tiny model finds the digits by position
quickly, and what is left to learn is the arithmetic (the carry).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Collection
from pathlib import Path

from megarl import atomic
from megarl.data.rows import make_row, write_rows
from megarl.errors import InputError

DATA_SOURCE = "megarl/arithmetic"
INSTRUCTION = 'Answer after "####".'
SOLUTION_FORMS = ("answer", "worked")
# Worked solutions name their first columns; wider operands go on as "column 5", "column 6", ...
COLUMN_NAMES = ("ones", "tens", "hundreds", "thousands")


def worked_solution(a: int, b: int, width: int) -> str:
    """`a + b` worked column by column from the ones up, then `#### <sum>`. Each column's sum is written with two
    digits, so a column's line has one layout whatever its digits."""
    lines, carry = [], 0
    for column in range(width):
        digit_a, digit_b = a // 10**column % 10, b // 10**column % 10
        total = digit_a + digit_b + carry
        name = COLUMN_NAMES[column] if column < len(COLUMN_NAMES) else f"column {column + 1}"
        lines.append(f"{name}: {digit_a} + {digit_b} + {carry} = {total:02d}, write {total % 10} carry {total // 10}")
        carry = total // 10
    return "\n".join(lines) + f"\n#### {a + b}"


def arithmetic_pairs(
    num: int, *, seed: int, split: str, max_operand: int = 99, exclude_pairs: Collection[tuple[int, int]] = ()
) -> list[tuple[int, int]]:
    """`num` operand pairs drawn uniformly from [0, max_operand]^2, skipping `exclude_pairs`.

    The stream depends on both `seed` and `split`, so train and test drawn with
    one seed are different samples.
    """
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    excluded = set(exclude_pairs)
    in_range = {(a, b) for a, b in excluded if 0 <= a <= max_operand and 0 <= b <= max_operand}
    if num > 0 and len(in_range) >= (max_operand + 1) ** 2:
        raise ValueError(f"exclude_pairs covers all {(max_operand + 1) ** 2} pairs with max_operand={max_operand}")
    # A string seed is hashed deterministically (not with PYTHONHASHSEED).
    rng = random.Random(f"megarl/arithmetic:{seed}:{split}")
    pairs: list[tuple[int, int]] = []
    while len(pairs) < num:
        pair = (rng.randint(0, max_operand), rng.randint(0, max_operand))
        if pair not in excluded:
            pairs.append(pair)
    return pairs


def arithmetic_rows(
    num: int,
    *,
    seed: int,
    split: str,
    max_operand: int = 99,
    start_index: int = 0,
    exclude_pairs: Collection[tuple[int, int]] = (),
    solution: str = "answer",
) -> list[dict]:
    """`num` GSM8K-format rows of "a+b=?" for the pairs of `arithmetic_pairs` (same arguments), each with its
    reference solution in the form `solution` names (one of SOLUTION_FORMS)."""
    if solution not in SOLUTION_FORMS:
        raise ValueError(f"solution must be one of {SOLUTION_FORMS}, got {solution!r}")
    rows = []
    width = len(str(max_operand))
    pairs = arithmetic_pairs(num, seed=seed, split=split, max_operand=max_operand, exclude_pairs=exclude_pairs)
    for offset, (a, b) in enumerate(pairs):
        question = f"{a:0{width}d}+{b:0{width}d}=?"
        rows.append(
            make_row(
                data_source=DATA_SOURCE,
                prompt_text=f"{INSTRUCTION} {question}",
                ground_truth=str(a + b),
                split=split,
                index=start_index + offset,
                answer=worked_solution(a, b, width) if solution == "worked" else f"#### {a + b}",
                question=question,
            )
        )
    return rows


def arithmetic_splits(
    num_train: int, num_val: int, seed: int, max_operand: int = 99, solution: str = "answer"
) -> dict[str, list[dict]]:
    """{"train": rows, "test": rows} of the task; no test (a, b) pair appears in train."""
    pairs = (max_operand + 1) ** 2
    if num_val >= pairs:
        raise InputError(
            f"data.synthetic.num_val: leaves no (a, b) pair for training: max_operand = {max_operand} makes {pairs} "
            f"pairs (got {num_val})"
        )
    held_out = arithmetic_pairs(num_val, seed=seed, split="test", max_operand=max_operand)
    return {
        "train": arithmetic_rows(num_train, seed=seed, split="train", max_operand=max_operand, exclude_pairs=held_out,
                                 solution=solution),
        "test": arithmetic_rows(num_val, seed=seed, split="test", max_operand=max_operand, solution=solution),
    }


def write_arithmetic_dataset(
    out_dir: Path, num_train: int, num_val: int, seed: int, max_operand: int = 99
) -> tuple[Path, Path]:
    """Write `train.parquet` and `test.parquet` under `out_dir` (the rows of `arithmetic_splits`)."""
    splits = arithmetic_splits(num_train, num_val, seed, max_operand)
    train_path, val_path = Path(out_dir) / "train.parquet", Path(out_dir) / "test.parquet"
    atomic.write_files({train_path: functools.partial(write_rows, splits["train"]),
                        val_path: functools.partial(write_rows, splits["test"])})
    return train_path, val_path
