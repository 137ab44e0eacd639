"""The RL data row (docs/data.md): building rows, writing them to parquet, and reporting bad ones.

Every preprocessor and the synthetic task build rows with `make_row` and write
them with `write_rows`, so all parquet files share one explicit Arrow schema.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.errors import InputError
from megarl.userfiles import file_problem

ROW_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()), ("question", pa.string())]
            ),
        ),
    ]
)

# A file with a systematic problem (a missing column) would otherwise produce one
# line per row; the first few name the problem well enough.
MAX_REPORTED_PROBLEMS = 20


def make_row(
    *, data_source: str, prompt_text: str, ground_truth: str, split: str, index: int, answer: str, question: str
) -> dict:
    """One row: a single user message `prompt_text`, a rule reward with `ground_truth`, and the raw example."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": prompt_text}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def write_rows(rows: Sequence[dict], path: Path) -> Path:
    """Write `rows` to `path` as parquet with `ROW_SCHEMA` (parent directories are created); callers that others
    read later write through `megarl.atomic.write_files`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows), schema=ROW_SCHEMA), path)
    return path


def raise_problems(problems: Sequence[str]) -> None:
    """Raise one InputError with the first MAX_REPORTED_PROBLEMS problems (and how many more); no-op if none."""
    if not problems:
        return
    shown = list(problems[:MAX_REPORTED_PROBLEMS])
    if len(problems) > MAX_REPORTED_PROBLEMS:
        shown.append(f"... and {len(problems) - MAX_REPORTED_PROBLEMS} more problems like these")
    raise InputError(shown)


def preview(value: object, limit: int = 60) -> str:
    """A short repr of a bad value for an error line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_checked_rows(paths: Sequence[Path], *, what: str,
                      row_problems: Callable[[dict], list[str]]) -> list[dict]:
    """All rows of the parquet files (`what`: "data file", "pair file"); InputError naming the file and row of
    every unusable one (`row_problems(row)` says what is wrong with a row)."""
    raise_problems([f"{what} {path}: {problem}" for path in paths if (problem := file_problem(path)) is not None])
    rows, problems = [], []
    for path in paths:
        try:
            records = pq.read_table(path).to_pylist()
        except Exception as error:  # pyarrow raises several types for a corrupt file
            raise InputError(f"{what} {path}: not a readable parquet file ({type(error).__name__})") from error
        for number, row in enumerate(records):
            problems.extend(f"{path} row {number}: {problem}" for problem in row_problems(row))
            rows.append(row)
    raise_problems(problems)
    return rows
