"""The LLM judge's text side: its user message from a template, and parsers that read a score from its verdict.

A parser is `parser(text) -> float | None`; None means the verdict holds no score.
Parsers are registered by name in `megarl.registry.JUDGE_PARSERS`
(`reward.judge.parser`): `score_tag` (the default), `last_number`, `fraction`,
`yes_no`. A fraction is never read as one of its numbers: only `fraction` reads
it. `read_verdicts` applies one to a batch of verdicts and keeps failures
visible: a verdict without a score, or with one outside the judge's
`score_range`, gets `fail_score` and is counted; it is never a silent 0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from megarl.registry import JUDGE_PARSERS

_NUMBER = r"-?\d+(?:\.\d+)?"
# A number, or a fraction "a/b" (spaces allowed around the slash): read as one item, so "7/10" is not "10".
_NUMBER_OR_FRACTION = re.compile(rf"({_NUMBER})(?:\s*/\s*(\d+(?:\.\d+)?))?")
_SCORE_TAG = re.compile(r"<score>\s*(-?\d+(?:\.\d+)?)\s*</score>", re.IGNORECASE)
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


@JUDGE_PARSERS.register("score_tag")
def parse_score_tag(text: str) -> float | None:
    """The number in the last `<score>...</score>` tag (the default: the judge says which number is the score).
    A tag holding anything but one number ("<score>7/10</score>") holds no score."""
    tags = _SCORE_TAG.findall(text)
    return float(tags[-1]) if tags else None


@JUDGE_PARSERS.register("last_number")
def parse_last_number(text: str) -> float | None:
    """The last number in the verdict; None when the verdict ends on a fraction ("... I give it 7/10" is neither
    7 nor 10: ask for `fraction` if the judge grades so)."""
    items = _NUMBER_OR_FRACTION.findall(text)
    if not items or items[-1][1]:
        return None
    return float(items[-1][0])


@JUDGE_PARSERS.register("fraction")
def parse_fraction(text: str) -> float | None:
    """The last fraction "a/b" in the verdict, read as the number a / b ("7/10" reads 0.7: set `score_range`
    to [0, 1]); None without one, or with b = 0."""
    fractions = [(a, b) for a, b in _NUMBER_OR_FRACTION.findall(text) if b]
    if not fractions or float(fractions[-1][1]) == 0:
        return None
    return float(fractions[-1][0]) / float(fractions[-1][1])


@JUDGE_PARSERS.register("yes_no")
def parse_yes_no(text: str) -> float | None:
    """1.0 for a final "yes", 0.0 for a final "no" (the last of the two words in the verdict)."""
    words = _YES_NO.findall(text)
    return (1.0 if words[-1].lower() == "yes" else 0.0) if words else None


def judge_message(template: str, *, prompt: Sequence[dict], response: str, ground_truth: str | None,
                  data_source: str) -> str:
    """The judge's user message: `template` filled with the row's last user message, response and ground truth."""
    user = [message["content"] for message in prompt if message.get("role") == "user"]
    return template.format(prompt=user[-1] if user else "", response=response,
                           ground_truth="" if ground_truth is None else ground_truth, data_source=data_source)


@dataclass(frozen=True)
class Verdicts:
    texts: list[str]  # the judge's outputs
    scores: list[float]
    failed: list[bool]  # the verdict held no score in range; its score is the fail score


def read_verdicts(texts: Sequence[str], *, parser: str, score_range: tuple[float, float],
                  fail_score: float) -> Verdicts:
    """Scores of the judge's verdicts; unreadable or out-of-range ones get `fail_score` and are marked failed."""
    parse = JUDGE_PARSERS.get(parser).target
    low, high = score_range
    scores, failed = [], []
    for text in texts:
        value = parse(text)
        ok = value is not None and math.isfinite(value) and low <= value <= high
        scores.append(value if ok else fail_score)
        failed.append(not ok)
    return Verdicts(list(texts), scores, failed)
