"""The reward manager: decode each response, score it by its data source, and place the score on
the last valid response token (`token_level_scores`), so `token_level_scores.sum(-1)` is the
outcome reward.

Large batches can be scored in a pool of spawned worker processes (scorers such as
math_verify are CPU-heavy); small ones are scored in-process. Either way the result
is identical and a failing scorer only zeroes its own sample.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import numbers
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megarl.rewards.registry import Scorer, check_data_sources
from megarl.rewards.scoring import SampleScore, install_worker_scorers, score_sample, score_task

logger = logging.getLogger(__name__)


@dataclass
class RewardOutput:
    token_level_scores: torch.Tensor  # [B, R] float32, the score at index valid_response_length - 1
    extra: dict[str, np.ndarray]  # [B] arrays: "score", "scorer_failed", and scorers' extra fields
    num_failed: int


def reward_metrics(output: RewardOutput) -> dict[str, int]:
    return {"reward/scorer_failed": output.num_failed}


def _column(values: Sequence[Any]) -> np.ndarray:
    """One [B] array per extra field: numeric when every present value is a number (missing -> NaN)."""
    present = [value for value in values if value is not None]
    if all(isinstance(value, numbers.Real) for value in present):
        if len(present) == len(values):
            return np.asarray(values)
        return np.array([np.nan if value is None else value for value in values], dtype=np.float64)
    column = np.empty(len(values), dtype=object)
    column[:] = list(values)
    return column


def at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-row scores [B] -> [B, R] float32 with each score on the row's last response token (the last position
    where `response_mask` is 1: with multi-turn episodes the model's last token, not a tool's), so `.sum(-1)` gives
    them back. An empty response (no response token) keeps its score too, at index 0 of its window (outside its
    mask, as verl's reward managers store it outside, at index -1): a format penalty for saying nothing reaches
    the row's outcome reward, and the group baselines."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    last = torch.where(response_mask.bool(), positions, -1).max(-1).values
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    out[torch.arange(len(last)), last.clamp(min=0)] = scores.float()
    return out


class RewardManager:
    """`RewardManager(tokenizer, scorers, num_workers)(batch) -> RewardOutput`.

    `batch` needs `responses` [B, R] (right-padded), `response_mask` [B, R] and the
    non-tensor fields `data_source`, `reward_model` (dicts with "ground_truth") and
    `extra_info`. With `num_workers > 0`, batches of at least `parallel_min_batch`
    samples are scored in that many worker processes.
    """

    def __init__(
        self, tokenizer: Any, scorers: Mapping[str, Scorer], num_workers: int = 0, *, parallel_min_batch: int = 256
    ):
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.tokenizer = tokenizer
        self.scorers = dict(scorers)
        self.num_workers = num_workers
        self.parallel_min_batch = parallel_min_batch
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def __call__(self, batch: Any) -> RewardOutput:
        responses = batch["responses"]
        valid_lengths = batch["response_mask"].sum(-1).long().tolist()
        data_sources = [str(source) for source in batch["data_source"]]
        check_data_sources(data_sources, self.scorers)
        texts = self.tokenizer.batch_decode(
            [row[:length].tolist() for row, length in zip(responses, valid_lengths)], skip_special_tokens=True
        )
        tasks = [
            (source, text, (reward_model or {}).get("ground_truth"), extra_info or {})
            for source, text, reward_model, extra_info in zip(
                data_sources, texts, batch["reward_model"], batch["extra_info"]
            )
        ]
        # An empty response is scored like any other (its scorer may penalise it) and its score stored, so
        # token_level_scores.sum(-1) always equals extra["score"].
        results = self.score_tasks(tasks)
        scores = at_last_token(torch.tensor([result.score for result in results]), batch["response_mask"])
        return RewardOutput(scores, self._extra_fields(results), sum(result.error is not None for result in results))

    def score_tasks(self, tasks: Sequence[tuple[str, str, Any, dict]], *, pooled: bool | None = None
                    ) -> list[SampleScore]:
        """Scores of (data_source, response text, ground truth, extra_info) tasks, in order; a failing scorer gives
        0 and an error for its task only. `pooled`: score in the worker processes (None: when there are workers
        and at least `parallel_min_batch` tasks). Safe to call from several threads at once."""
        tasks = list(tasks)
        check_data_sources([task[0] for task in tasks], self.scorers)
        if not tasks:
            return []
        results = None
        if pooled is None:
            pooled = len(tasks) >= self.parallel_min_batch
        if self.num_workers > 0 and pooled:
            results = self._score_in_pool(tasks)
        if results is None:
            results = [score_sample(self.scorers[task[0]], *task[1:]) for task in tasks]
        errors = [result.error for result in results if result.error is not None]
        if errors:
            logger.warning(
                "%d of %d reward scorer calls failed (scored 0); first: %s", len(errors), len(tasks), errors[0]
            )
        return results

    def _score_in_pool(self, tasks: list[tuple[str, str, str, dict]]) -> list[SampleScore] | None:
        """Score in the worker pool; None (after a warning) when the pool itself fails, e.g. a worker died."""
        try:
            with self._pool_lock:
                if self._pool is None:
                    # spawn, not fork: the trainer process holds threads (Ray, torch)
                    # that a forked child would inherit in an inconsistent state.
                    self._pool = concurrent.futures.ProcessPoolExecutor(
                        max_workers=self.num_workers,
                        mp_context=multiprocessing.get_context("spawn"),
                        initializer=install_worker_scorers,
                        initargs=(self.scorers,),
                    )
                pool = self._pool
            chunk = max(1, len(tasks) // (4 * self.num_workers))
            return list(pool.map(score_task, tasks, chunksize=chunk))
        except Exception as error:  # scoring must not kill the run; fall back to in-process
            logger.warning("reward worker pool failed (%s: %s); scoring in-process", type(error).__name__, error)
            self.close()
            return None

    @staticmethod
    def _extra_fields(results: list[SampleScore]) -> dict[str, np.ndarray]:
        extra = {
            "score": np.array([result.score for result in results], dtype=np.float32),
            "scorer_failed": np.array([result.error is not None for result in results], dtype=bool),
        }
        names = list(dict.fromkeys(name for result in results for name in result.extra))
        for name in names:
            if name not in extra:
                extra[name] = _column([result.extra.get(name) for result in results])
        return extra

    def close(self) -> None:
        """Stop the worker processes (if any); a later call starts a fresh pool."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
