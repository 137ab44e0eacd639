"""The scorer of the `megarl/random_digits` benchmark task: the share of a response's characters that are digits.

It has no meaning beyond being cheap and graded: the responses of a random model score
differently from one another, so GRPO groups carry non-zero advantages and a
benchmark step's updates see the values of a real run (their cost does not depend on them).
"""

from __future__ import annotations


def compute_score(solution_str: str) -> float:
    """Digits / characters of the response; 0 for an empty one."""
    return sum(char.isdigit() for char in solution_str) / len(solution_str) if solution_str else 0.0
