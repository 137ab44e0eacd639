"""The synthetic `megarl/guessing` task: rows for the `guessing` environment of multi-turn runs.

Each row's prompt is the game's first observation, its ground truth the secret (a whole number
from 1 to `high`), and its reference answer the first guess of bisection. The environment plays
the rest of the game (`megarl.agent.envs.guessing`); train and test draw their secrets from
streams of their own.
"""

from __future__ import annotations

import random

from megarl.data.rows import make_row

DATA_SOURCE = "megarl/guessing"


def guessing_rows(num: int, *, seed: int, split: str, high: int = 100) -> list[dict]:
    rng = random.Random(f"megarl/guessing:{seed}:{split}")
    question = f"Guess my number (1-{high}). One number per turn; I say higher, lower or correct."
    return [make_row(data_source=DATA_SOURCE, prompt_text=question, ground_truth=str(rng.randint(1, high)),
                     split=split, index=index, answer=str((1 + high) // 2), question=question)
            for index in range(num)]


def guessing_splits(num_train: int, num_val: int, seed: int, high: int = 100) -> dict[str, list[dict]]:
    """{"train": rows, "test": rows} of the game."""
    return {"train": guessing_rows(num_train, seed=seed, split="train", high=high),
            "test": guessing_rows(num_val, seed=seed, split="test", high=high)}
