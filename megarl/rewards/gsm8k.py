"""GSM8K rule reward: find the final number in a response and compare it with the ground truth.

Strict mode checks the format the prompt asks for (`#### <number>`); flexible
mode accepts the last number anywhere in the tail of the response. Only the last
300 characters are searched: the answer is at the end, and regexes over very
long degenerate responses are slow.
"""

from __future__ import annotations

import re

TAIL_CHARS = 300

# The number pattern of the reference implementation: digits, dots and commas,
# optionally negative. A trailing sentence dot ("#### 72.") stays part of the
# number in strict mode, so it does not equal "72": the format is part of the test.
_STRICT_ANSWER = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")
# What an extracted answer can equal: digits, at most one decimal point, no commas (they are removed).
_GROUND_TRUTH = re.compile(r"-?[0-9]+(\.[0-9]+)?")


def ground_truth_problem(ground_truth: object) -> str | None:
    """Why no response could ever match `ground_truth` (e.g. "1.2.3", "1,200", "seven"), or None when one can."""
    if _GROUND_TRUTH.fullmatch(str(ground_truth)) is None:
        return "is not a number a response could match (digits, an optional '-' and at most one decimal point)"
    return None


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer in the last `TAIL_CHARS` characters (commas removed), or None when there is none."""
    tail = solution_str[-TAIL_CHARS:]
    if method == "strict":
        matches = _STRICT_ANSWER.findall(tail)
        return matches[-1].replace(",", "") if matches else None
    if method == "flexible":
        # Punctuation alone ("." or ",") also matches the pattern and is not a
        # number; a number at the end of a sentence loses the sentence's dot.
        for candidate in reversed(_NUMBER.findall(tail)):
            if any(char.isdigit() for char in candidate):
                return candidate.replace(",", "").rstrip(".")
        return None
    raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` when the extracted answer equals the ground truth (as strings), `format_score` when it
    is a wrong number, 0.0 when no answer is found."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth) else format_score
