"""GSM8K rule reward: strict/flexible extraction, the 300-character tail, score/format_score/0."""

from __future__ import annotations

import pytest

from megarl.rewards.gsm8k import TAIL_CHARS, compute_score, extract_answer


@pytest.mark.parametrize(
    "response, expected",
    [
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
        ("The total is 1,200 dollars.\n#### 1,200", "1200"),
        ("She is left with #### -5", "-5"),
        ("first guess #### 3 then correction #### 4", "4"),  # the last one counts
        ("#### 2.50", "2.50"),
        ("#### 72.", "72."),  # as the reference regex: a trailing dot stays, so it is a wrong answer
        ("####72", None),  # the space after #### is part of the format
        ("The answer is 72", None),
        ("", None),
    ],
)
def test_strict_extraction(response, expected):
    assert extract_answer(response, "strict") == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("The answer is 72", "72"),
        ("So 3 apples and then 1,234 pears", "1234"),
        ("It costs -7 dollars.", "-7"),  # the sentence dot is not part of the number
        ("Total: 15. Done.", "15"),  # "." alone is not a number
        ("Hello, world.", None),  # "," and "." alone are not numbers
        ("#### 8", "8"),
        ("no digits here", None),
    ],
)
def test_flexible_extraction(response, expected):
    assert extract_answer(response, "flexible") == expected


def test_score_format_score_and_zero():
    assert compute_score("Work... #### 72", "72") == 1.0
    assert compute_score("Work... #### 71", "72") == 0.0
    assert compute_score("Work... #### 71", "72", format_score=0.1) == 0.1
    assert compute_score("Work... 72", "72", format_score=0.1) == 0.0  # no "####": no answer at all
    assert compute_score("Work... #### 72", "72", score=2.5) == 2.5
    assert compute_score("#### 1,000,000", "1000000") == 1.0
    assert compute_score("#### -3", "-3") == 1.0
    assert compute_score("#### 3", "-3") == 0.0
    assert compute_score("#### 72.", "72", format_score=0.1) == 0.1


def test_flexible_mode_scores():
    assert compute_score("I think it is 72.", "72", method="flexible") == 1.0
    assert compute_score("I think it is 70.", "72", method="flexible", format_score=0.2) == 0.2
    assert compute_score("I do not know.", "72", method="flexible", format_score=0.2) == 0.0
    assert compute_score("I think it is 72.", "72", method="strict") == 0.0


def test_only_the_last_300_characters_are_searched():
    answer = "#### 72"
    inside = answer + "x" * (TAIL_CHARS - len(answer))  # exactly 300 characters: the answer is at the start
    assert len(inside) == TAIL_CHARS
    assert compute_score(inside, "72") == 1.0
    outside = answer + "x" * (TAIL_CHARS - len(answer) + 1)  # one more character pushes "#" out
    assert compute_score(outside, "72") == 0.0
    # Cutting into the number keeps only its tail, as a plain slice would.
    assert extract_answer("#### 123" + "y" * (TAIL_CHARS - 2), "strict") is None
    assert extract_answer("1234" + "y" * (TAIL_CHARS - 2), "flexible") == "34"


def test_ground_truth_compared_as_string():
    assert compute_score("#### 72", 72) == 1.0  # non-string ground truths are compared via str()
    assert compute_score("#### 72.0", "72") == 0.0  # no numeric equivalence, like the reference


def test_unknown_method_is_an_error():
    with pytest.raises(ValueError, match="strict.*flexible.*'fuzzy'"):
        compute_score("#### 1", "1", method="fuzzy")
