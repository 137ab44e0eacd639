"""MATH rule reward: last boxed answer extraction and Hendrycks normalisation, checked against hand-written values."""

from __future__ import annotations

import sys
import types

import pytest

from megarl.rewards import math as math_reward
from megarl.rewards.math import compute_score, last_boxed_content, normalize_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is $\boxed{5}$.", "5"),
        (r"$\boxed{\frac{1}{\sqrt{2}}}$", r"\frac{1}{\sqrt{2}}"),  # nested braces
        (r"first \boxed{1}, then \boxed{\{a, b\}}", r"\{a, b\}"),  # the last box; escaped braces balance
        (r"\fbox{42}", "42"),
        (r"\boxed{1} and finally \fbox{x^{2}}", "x^{2}"),
        (r"$\boxed 7$", "7"),  # the space form runs to "$"
        (r"\boxed 7 apples", "7"),
        (r"\boxed {8}", "8"),
        (r"the answer is 5", None),
        (r"\boxed{\frac{1}{2}", None),  # cut off by the length limit: unbalanced
        (r"\boxed", None),
    ],
)
def test_last_boxed_content(text, expected):
    assert last_boxed_content(text) == expected


@pytest.mark.parametrize(
    "answer, normalised",
    [
        (r"\dfrac12", r"\frac{1}{2}"),
        (r"\tfrac{3}{4}", r"\frac{3}{4}"),
        (r"\frac1{72}", r"\frac{1}{72}"),
        (r"\frac{1}2", r"\frac{1}{2}"),
        ("0.5", r"\frac{1}{2}"),
        (".5", r"\frac{1}{2}"),  # leading "0." repair, then 0.5 -> 1/2
        ("3/4", r"\frac{3}{4}"),
        ("-3/4", r"\frac{-3}{4}"),
        (r"10\%", "10"),
        ("10%", "10"),
        (r"5^\circ", "5"),
        (r"90^{\circ}", "90"),
        (r"12\text{ cm}", "12"),
        (r"\$18.90", "18.90"),
        ("x = 3", "3"),
        ("k=-2", "-2"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"\frac{\sqrt3}{2}", r"\frac{\sqrt{3}}{2}"),
        (r"a \! b", "ab"),
        ("3.", "3"),
        (r"\frac{.5}{2}", r"\frac{0.5}{2}"),
        ("1\n000", "1000"),
        (r"\\frac{1}{2}", r"\frac{1}{2}"),  # doubled backslashes
        ("2x + 1", "2x+1"),
        (r"y = 2x + 1", "2x+1"),
        (r"area = 5", "area=5"),  # a long left-hand side is kept
        ("1/x", "1/x"),  # only integer ratios become fractions
    ],
)
def test_normalize_answer(answer, normalised):
    assert normalize_answer(answer) == normalised


@pytest.mark.parametrize(
    "answer, ground_truth",
    [
        (r"\dfrac12", r"\frac{1}{2}"),
        ("0.5", r"\frac12"),
        (r"10\%", "10"),
        (r"5^\circ", "5"),
        (r"12\text{ cm}", "12"),
        ("x = 3", "3"),
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
        (r"2 \sqrt 3", r"2\sqrt{3}"),
    ],
)
def test_equivalent_answers_score_one(answer, ground_truth):
    assert compute_score(rf"We get $\boxed{{{answer}}}$.", ground_truth) == 1.0


@pytest.mark.parametrize(
    "response, ground_truth",
    [
        (r"$\boxed{\frac{1}{3}}$", r"\frac12"),
        (r"$\boxed{x = 3}$", "4"),
        (r"$\boxed{100}$", "10"),
        (r"$\boxed{2/4}$", r"\frac{1}{2}"),  # not equal as strings; only math_verify would know
        ("The answer is 5.", "5"),  # no box, no answer
        (r"$\boxed{5$", "5"),  # unbalanced
    ],
)
def test_wrong_or_missing_answers_score_zero(response, ground_truth):
    assert compute_score(response, ground_truth) == 0.0


def test_only_the_last_box_counts():
    assert compute_score(r"maybe \boxed{4}? no: \boxed{5}", "5") == 1.0
    assert compute_score(r"maybe \boxed{5}? no: \boxed{4}", "5") == 0.0


@pytest.fixture
def fake_math_verify(monkeypatch):
    """A stand-in `math_verify` module that knows only 2/4 == 1/2 (the real one is not installed)."""
    calls = []

    def parse(text):
        return text

    def verify(gold, predicted):
        calls.append((gold, predicted))
        if predicted == r"\boxed{crash}":
            raise RuntimeError("symbolic backend failed")
        return (gold, predicted) == (r"\boxed{\frac{1}{2}}", r"\boxed{2/4}")

    monkeypatch.setitem(sys.modules, "math_verify", types.SimpleNamespace(parse=parse, verify=verify))
    math_reward._math_verify.cache_clear()
    yield calls
    math_reward._math_verify.cache_clear()


def test_math_verify_is_consulted_when_installed(fake_math_verify):
    assert compute_score(r"$\boxed{2/4}$", r"\frac{1}{2}") == 1.0
    assert compute_score(r"$\boxed{3/4}$", r"\frac{1}{2}") == 0.0
    assert compute_score(r"$\boxed{crash}$", r"\frac{1}{2}") == 0.0  # a backend error is a non-match
    assert compute_score(r"$\boxed{0.5}$", r"\frac{1}{2}") == 1.0  # string match first: no call needed
    assert (r"\boxed{\frac{1}{2}}", r"\boxed{0.5}") not in fake_math_verify
    assert len(fake_math_verify) == 3
