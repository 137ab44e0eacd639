"""MATH rule reward: the last `\\boxed{...}` of a response against the ground truth.

Both sides go through the Hendrycks MATH answer normalisation (the one
lm-evaluation-harness uses for `hendrycks_math`), reimplemented here; when the
optional `math_verify` package is importable it gets a second look at answers
whose normalised strings differ (e.g. `\\frac{2}{4}` vs `\\frac{1}{2}`).
"""

from __future__ import annotations

import functools
import importlib
import re
from types import ModuleType

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)")
_SQRT_BARE_ARGUMENT = re.compile(r"\\sqrt\s*([0-9a-zA-Z])")
_INTEGER_RATIO = re.compile(r"(-?[0-9]+)/([0-9]+)")


def _braced_group(text: str, open_index: int) -> tuple[str, int] | None:
    """The content of the brace group opening at `open_index` and the index after it; None if unbalanced."""
    depth = 0
    for index in range(open_index, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : index], index + 1
    return None


def last_boxed_content(text: str) -> str | None:
    """The argument of the last `\\boxed{...}` / `\\fbox{...}` / `\\boxed x` in `text`, or None.

    An unbalanced last box (a response cut off by the length limit) counts as
    no answer rather than falling back to an earlier box.
    """
    boxes = list(_BOX_COMMAND.finditer(text))
    if not boxes:
        return None
    after = boxes[-1].end()
    rest = text[after:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        group = _braced_group(text, after + len(rest) - len(stripped))
        return group[0] if group else None
    # `\boxed 5$`: TeX takes the next token; the answer runs to a space or `$`.
    if rest[:1].isspace():
        token = re.match(r"[^\s$]+", stripped)
        return token.group(0) if token else None
    return None


def _take_argument(text: str) -> tuple[str | None, str]:
    """One TeX macro argument at the start of `text`: a brace group or a single character."""
    if text.startswith("{"):
        group = _braced_group(text, 0)
        if group is None:
            return None, text
        return group[0], text[group[1] :]
    if text and text[0] not in "\\}":
        return text[0], text[1:]
    return None, text


def _brace_frac_arguments(answer: str) -> str:
    """`\\frac12` / `\\frac1{72}` / `\\frac{1}2` -> `\\frac{1}{2}` ...; malformed fractions stay as written."""
    pieces = answer.split("\\frac")
    repaired = [pieces[0]]
    for piece in pieces[1:]:
        numerator, rest = _take_argument(piece)
        denominator, rest = _take_argument(rest) if numerator is not None else (None, rest)
        if denominator is None:
            repaired.append(piece)
        else:
            repaired.append("{" + numerator + "}{" + denominator + "}" + rest)
    return "\\frac".join(repaired)


def _drop_short_left_side(answer: str) -> str:
    # "x = 3", "k=3": a single equation with a one- or two-character left side
    # names the unknown; the answer is the right side.
    sides = answer.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        return sides[1]
    return answer


def normalize_answer(answer: str) -> str:
    """Hendrycks MATH normalisation: a canonical string, equal for answers that differ only in notation."""
    text = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "")
    text = text.replace("\\$", "")
    # In MATH, `\text{ ...}` with a leading space only ever holds units at the end.
    text = text.split("\\text{ ", 1)[0]
    text = text.replace("\\%", "").replace("%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if text.startswith("."):
        text = "0" + text
    text = _drop_short_left_side(text)
    text = _SQRT_BARE_ARGUMENT.sub(r"\\sqrt{\1}", text)
    text = text.replace(" ", "").rstrip(".")
    text = _brace_frac_arguments(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    ratio = _INTEGER_RATIO.fullmatch(text)
    if ratio:
        text = "\\frac{" + ratio.group(1) + "}{" + ratio.group(2) + "}"
    return text


@functools.lru_cache(maxsize=1)
def _math_verify() -> ModuleType | None:
    try:
        return importlib.import_module("math_verify")
    except ImportError:
        return None


def _math_verify_equal(answer: str, ground_truth: str) -> bool:
    """math_verify's symbolic check when the package is installed; False without it or when it fails."""
    math_verify = _math_verify()
    if math_verify is None:
        return False
    try:
        gold = math_verify.parse("\\boxed{" + ground_truth + "}")
        predicted = math_verify.parse("\\boxed{" + answer + "}")
        return bool(math_verify.verify(gold, predicted))
    except Exception:  # a symbolic backend error is "not shown equal", never a crash
        return False


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer of `solution_str` equals `ground_truth` after normalisation, else 0.0."""
    answer = last_boxed_content(solution_str)
    if answer is None:
        return 0.0
    if normalize_answer(answer) == normalize_answer(str(ground_truth)):
        return 1.0
    return 1.0 if _math_verify_equal(answer, str(ground_truth)) else 0.0
