"""The metric names of docs/metrics.md, and which names a run or the code uses that the page does not define.

The page's tables list each name in their first column; `a/{x,y}` stands for `a/x` and
`a/y`, and `<role>`-style placeholders for any value (a data source may hold a `/`).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
RECORD_FIELDS = {"step", "time"}  # the record's own fields, not metrics


def documented_names() -> list[str]:
    """Every name of the page's tables, braces expanded (placeholders kept)."""
    names = []
    for written in re.findall(r"^\| `([^`]+)` \|", PAGE.read_text(), flags=re.M):
        parts = re.split(r"\{([^}]*)\}", written)  # literal, choices, literal, ...
        choices = [part.split(",") if index % 2 else [part] for index, part in enumerate(parts)]
        names += ["".join(pieces) for pieces in itertools.product(*choices)]
    return names


def _pattern(name: str) -> re.Pattern:
    return re.compile("".join(".+" if part.startswith("<") else re.escape(part)
                              for part in re.split(r"(<[^>]+>)", name) if part) + "$")


def undocumented(names) -> list[str]:
    """The metric names in `names` that no name of the page covers."""
    patterns = [_pattern(name) for name in documented_names()]
    return sorted({name for name in names if name not in RECORD_FIELDS
                   and not any(pattern.match(name) for pattern in patterns)})
