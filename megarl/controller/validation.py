"""Greedy evaluation on the held-out split: `val/score/mean`, `val/score/<data_source>` and sample rows."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable

import numpy as np
import torch

from megarl.config.settings import SamplingSettings
from megarl.controller import phases
from megarl.controller.samples import decode_rows
from megarl.protocol import Batch


def validate(
    batches: Iterable[Batch],
    *,
    generate: Callable[..., Batch],
    reward_fn: Callable[[Batch], tuple[torch.Tensor, dict]],
    sampling: SamplingSettings,
    tokenizer,
    sample_rows: int,
) -> tuple[dict[str, float], list[dict]]:
    """Generate once per prompt with `sampling` (greedy at temperature 0) and average the outcome scores per data
    source.

    Returns the metrics and the first `sample_rows` rows decoded (`samples.decode_rows`).
    """
    per_source: dict[str, list[float]] = defaultdict(list)
    samples: list[dict] = []
    for batch in batches:
        rollout = generate(phases.split_generation_batch(batch), sampling, seed=0)
        batch = phases.add_response_mask(batch.union(rollout))
        scores, _ = reward_fn(batch)
        outcome = scores.sum(-1)
        samples += decode_rows(batch, outcome, tokenizer, limit=sample_rows - len(samples))
        for source, score in zip(batch["data_source"], outcome.tolist()):
            per_source[str(source)].append(score)
    every = [score for scores in per_source.values() for score in scores]
    metrics = {"val/score/mean": float(np.mean(every)) if every else float("nan")}
    metrics.update({f"val/score/{source}": float(np.mean(scores)) for source, scores in per_source.items()})
    return metrics, samples
