"""Greedy evaluation on the held-out split: `val/score/mean` and `val/score/<data_source>`."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable

import numpy as np
import torch

from megarl.controller import phases
from megarl.protocol import Batch


def validate(
    batches: Iterable[Batch],
    *,
    generate: Callable[..., Batch],
    reward_fn: Callable[[Batch], tuple[torch.Tensor, dict]],
    temperature: float,
) -> dict[str, float]:
    """Generate once per prompt at `temperature` (0 = greedy) and average the outcome scores."""
    per_source: dict[str, list[float]] = defaultdict(list)
    for batch in batches:
        rollout = generate(phases.split_generation_batch(batch), temperature=temperature, seed=0)
        batch = phases.add_response_mask(batch.union(rollout))
        scores, _ = reward_fn(batch)
        for source, score in zip(batch["data_source"], scores.sum(-1).tolist()):
            per_source[str(source)].append(score)
    every = [score for scores in per_source.values() for score in scores]
    metrics = {"val/score/mean": float(np.mean(every)) if every else float("nan")}
    metrics.update({f"val/score/{source}": float(np.mean(scores)) for source, scores in per_source.items()})
    return metrics
