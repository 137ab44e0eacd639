"""Calling one scorer on one sample safely, in-process or inside a reward worker process.

Kept free of torch so spawned reward workers start fast: they import only this
module and the scorers. A scorer that raises, returns something that is not a
number, or returns a non-finite number yields score 0 and an error string; a
bad sample must never stop a training run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple


class SampleScore(NamedTuple):
    score: float
    extra: dict[str, Any]  # the scorer's extra fields when it returned a dict
    error: str | None  # None when the scorer succeeded


def score_sample(
    scorer: Callable[[str, str, dict], Any], solution_str: str, ground_truth: str, extra_info: dict
) -> SampleScore:
    """Run `scorer`; a float or a dict with "score" (plus extra fields) is a success, anything else a failure."""
    try:
        result = scorer(solution_str, ground_truth, extra_info)
        if isinstance(result, Mapping):
            extra = {key: value for key, value in result.items() if key != "score"}
            value = float(result["score"])
        else:
            extra = {}
            value = float(result)
        if not math.isfinite(value):
            raise ValueError(f"scorer returned a non-finite score {value}")
        return SampleScore(value, extra, None)
    except Exception as error:  # any scorer bug becomes a counted failure, never a crash
        return SampleScore(0.0, {}, f"{type(error).__name__}: {error}")


# Each worker process receives the scorers once (pool initializer) instead of
# with every task: tasks then carry only strings and small dicts.
_worker_scorers: dict[str, Callable[[str, str, dict], Any]] = {}


def install_worker_scorers(scorers: Mapping[str, Callable[[str, str, dict], Any]]) -> None:
    """Pool initializer: remember the scorers in this worker process."""
    _worker_scorers.clear()
    _worker_scorers.update(scorers)


def score_task(task: tuple[str, str, str, dict]) -> SampleScore:
    """Score one (data_source, solution_str, ground_truth, extra_info) in a worker process."""
    data_source, solution_str, ground_truth, extra_info = task
    return score_sample(_worker_scorers[data_source], solution_str, ground_truth, extra_info)
