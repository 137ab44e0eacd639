"""A rule scorer of your own: partial credit for arithmetic answers that are close to the sum.

A scorer is a plain function `(solution_str, ground_truth, extra_info) -> float` (or a dict with
a "score" and extra fields of your own). `solution_str` is the decoded response, `ground_truth`
the row's `reward_model.ground_truth`, `extra_info` its `extra_info` (see docs/data.md). It runs
in the reward worker processes, so it must be importable by its module path and must not rely on
state of the driver. An exception or a non-finite result scores the sample 0 and counts in
`reward/scorer_failed`; the run goes on.

Name it in a recipe for the data sources it scores (examples/custom-scorer-cpu.yaml):

    reward:
      scorers:
        megarl/arithmetic: examples.custom_scorer:close_enough

and run from the repository root with the root on the import path:

    PYTHONPATH=$PWD megarl train examples/custom-scorer-cpu.yaml
"""

from __future__ import annotations

import re

_FINAL = re.compile(r"####\s*(-?\d+)")


def close_enough(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    """1 for the right sum after `####`, 0.5 when it is off by at most 1% of the sum (at least 1), else 0."""
    found = _FINAL.findall(solution_str[-300:])
    if not found:
        return 0.0
    answer, truth = int(found[-1]), int(ground_truth)
    if answer == truth:
        return 1.0
    return 0.5 if abs(answer - truth) <= max(1, abs(truth) // 100) else 0.0
