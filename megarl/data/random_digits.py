"""The synthetic `megarl/random_digits` task: prompts of random digits (nothing else), all of one token length.

A benchmark task (`megarl bench --synthetic`), not a learning one: every prompt
is the same number of tokens after the chat template, so two runs process the
same token counts whatever the data. Digits are single tokens in megarl's
builtin tokenizer (and in Qwen's), so the length is set by the number of digits;
a tokenizer that merges digits is refused, naming the lengths it produced. The
ground truth is the digit string itself; the scorer (`megarl.rewards.digits`)
gives responses graded scores, so GRPO groups carry non-zero advantages and the
update phases do the work they do in a real run.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

from megarl import atomic
from megarl.data.dataset import tokenize_prompts
from megarl.data.rows import make_row, write_rows
from megarl.errors import InputError

DATA_SOURCE = "megarl/random_digits"


def digits_for_length(tokenizer: Any, prompt_length: int) -> int:
    """How many digits make a prompt of `prompt_length` tokens under the tokenizer's chat template."""
    overhead = len(tokenize_prompts(tokenizer, [[{"role": "user", "content": ""}]])[0])
    digits = prompt_length - overhead
    if digits < 1:
        raise InputError(f"data.synthetic.prompt_length: the chat template alone takes "
                         f"{overhead} tokens, leaving no room for digits (got {prompt_length})")
    return digits


def random_digit_rows(num: int, *, digits: int, seed: int, split: str) -> list[dict]:
    """`num` rows, each a prompt of `digits` random digits; the stream depends on `seed` and `split`."""
    rng = random.Random(f"megarl/random_digits:{seed}:{split}")
    rows = []
    for index in range(num):
        text = "".join(rng.choice("0123456789") for _ in range(digits))
        rows.append(make_row(data_source=DATA_SOURCE, prompt_text=text, ground_truth=text, split=split,
                             index=index, answer=text, question=text))
    return rows


def random_digits_splits(*, num_train: int, num_val: int, seed: int, prompt_length: int,
                         tokenizer: Any) -> dict[str, list[dict]]:
    """{"train": rows} and, when `num_val` > 0, {"test": rows}, whose prompts are `prompt_length` tokens."""
    digits = digits_for_length(tokenizer, prompt_length)
    splits = {"train": random_digit_rows(num_train, digits=digits, seed=seed, split="train")}
    if num_val:
        splits["test"] = random_digit_rows(num_val, digits=digits, seed=seed, split="test")
    lengths = {len(ids) for rows in splits.values()
               for ids in tokenize_prompts(tokenizer, [row["prompt"] for row in rows])}
    if lengths != {prompt_length}:
        raise InputError(f"data.synthetic.task: random_digits needs a tokenizer that gives each digit a token of "
                         f"its own; {getattr(tokenizer, 'name_or_path', 'the tokenizer')!r} made prompts of "
                         f"{min(lengths)}..{max(lengths)} tokens instead of {prompt_length} (got 'random_digits')")
    return splits


def write_random_digits_dataset(out_dir: Path, *, num_train: int, num_val: int, seed: int, prompt_length: int,
                                tokenizer: Any) -> tuple[Path, Path | None]:
    """Write `train.parquet` (and `test.parquet` when `num_val` > 0): the rows of `random_digits_splits`."""
    splits = random_digits_splits(num_train=num_train, num_val=num_val, seed=seed, prompt_length=prompt_length,
                                  tokenizer=tokenizer)
    paths = {split: Path(out_dir) / f"{split}.parquet" for split in splits}
    atomic.write_files({paths[split]: functools.partial(write_rows, rows) for split, rows in splits.items()})
    return paths["train"], paths.get("test")
