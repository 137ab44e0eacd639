"""`megarl preprocess`: local GSM8K / MATH files (or the synthetic task) -> train.parquet / test.parquet.

No dataset hub is reachable from our machines, so the input is a local jsonl or
parquet file, or a directory of them; the split comes from the file name
(`train*` / `test*`, as in the Hugging Face dataset layouts). Every bad row is
reported (file, line/row, field, value) in one InputError.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from megarl import atomic
from megarl.data.rows import make_row, preview, raise_problems, write_rows
from megarl.data.synthetic import write_arithmetic_dataset
from megarl.errors import InputError
from megarl.rewards import gsm8k
from megarl.rewards.math import last_boxed_content
from megarl.userfiles import directory_problem, file_problem

SPLITS = ("train", "test")
SUFFIXES = (".jsonl", ".parquet")
ARITHMETIC_SIZES = {"train": 5000, "test": 500}

# The last "#### <number>" of a GSM8K reference answer; commas are thousands
# separators ("#### 1,200") and are removed from the ground truth.
_GSM8K_FINAL = re.compile(r"####\s*(-?[0-9][0-9.,]*)")


def _gsm8k_ground_truth(answer: str) -> str | None:
    matches = _GSM8K_FINAL.findall(answer)
    return matches[-1].replace(",", "").rstrip(".") if matches else None


@dataclass(frozen=True)
class SourceFormat:
    data_source: str
    question_field: str
    answer_field: str
    instruction: str
    ground_truth: Callable[[str], str | None]  # None when the reference answer has no final answer
    final_answer_hint: str  # names the missing final answer in error lines
    # Why the scorer could never match a final answer (None: it can); None when every final answer can match.
    ground_truth_problem: Callable[[str], str | None] | None = None


FORMATS = {
    "gsm8k": SourceFormat(
        data_source="openai/gsm8k",
        question_field="question",
        answer_field="answer",
        instruction="Let's think step by step and output the final answer after \"####\".",
        ground_truth=_gsm8k_ground_truth,
        final_answer_hint="'#### <number>'",
        ground_truth_problem=gsm8k.ground_truth_problem,
    ),
    "math": SourceFormat(
        data_source="DigitalLearningGmbH/MATH-lighteval",
        question_field="problem",
        answer_field="solution",
        instruction="Let's think step by step and output the final answer within \\boxed{}.",
        ground_truth=last_boxed_content,
        final_answer_hint="'\\boxed{...}'",
    ),
}


def _split_of(path: Path) -> str | None:
    return next((split for split in SPLITS if path.name.startswith(split)), None)


def find_split_files(input_path: Path) -> dict[str, list[Path]]:
    """{split: files} for a file named train*/test* or a directory holding such .jsonl/.parquet files."""
    if not input_path.exists():
        raise InputError(f"--input {input_path}: no such file or directory")
    if not input_path.is_dir() and (problem := file_problem(input_path)) is not None:
        # A FIFO would block the read and a device (/dev/null, /dev/zero) is no data set.
        raise InputError(f"--input {input_path}: {problem.replace('not a regular file', 'not a data file or directory')}")
    if input_path.is_file():
        split = _split_of(input_path)
        if split is None or input_path.suffix not in SUFFIXES:
            raise InputError(
                f"--input {input_path}: expected a file named train*.jsonl, train*.parquet, test*.jsonl or "
                "test*.parquet (the split comes from the name), or a directory of them"
            )
        return {split: [input_path]}
    files: dict[str, list[Path]] = {}
    for path in sorted(input_path.iterdir()):
        split = _split_of(path)
        if split is not None and path.suffix in SUFFIXES and path.is_file():
            files.setdefault(split, []).append(path)
    if not files:
        raise InputError(f"--input {input_path}: the directory has no train*/test* .jsonl or .parquet files")
    return files


def read_records(path: Path) -> Iterator[tuple[str, object]]:
    """(location, record) per record: jsonl as "FILE line N" (1-based), parquet as "FILE row N" (0-based)."""
    if path.suffix == ".parquet":
        try:
            records = pq.read_table(path).to_pylist()
        except Exception as error:  # pyarrow raises several types for a corrupt file
            raise InputError(f"{path}: not a readable parquet file ({type(error).__name__}: {error})") from error
        for row_number, record in enumerate(records):
            yield f"{path} row {row_number}", record
        return
    with path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise InputError(f"{path} line {line_number}: not UTF-8 text (byte {raw[error.start]:#04x} at "
                                 f"column {error.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{path} line {line_number}: not valid JSON ({error.msg})") from error
            except RecursionError:
                raise InputError(f"{path} line {line_number}: JSON nested too deeply to be a record") from None
            yield f"{path} line {line_number}", record


def convert_split(source: SourceFormat, split: str, files: list[Path]) -> tuple[list[dict], list[str]]:
    """The rows of one split and the problems of the records that could not be converted."""
    rows: list[dict] = []
    problems: list[str] = []
    for path in files:
        for location, record in read_records(path):
            if not isinstance(record, dict):
                problems.append(f"{location}: expected an object with fields, got {preview(record)}")
                continue
            bad_fields = [
                field
                for field in (source.question_field, source.answer_field)
                if not isinstance(record.get(field), str) or not record[field].strip()
            ]
            if bad_fields:
                problems.extend(
                    f"{location}: field {field!r} is missing or not a non-empty string "
                    f"(got {preview(record.get(field))})"
                    for field in bad_fields
                )
                continue
            question, answer = record[source.question_field], record[source.answer_field]
            ground_truth = source.ground_truth(answer)
            if not ground_truth:
                problems.append(
                    f"{location}: field {source.answer_field!r} has no final answer {source.final_answer_hint}: "
                    f"{preview(answer)}"
                )
                continue
            if source.ground_truth_problem is not None and (problem := source.ground_truth_problem(ground_truth)):
                problems.append(f"{location}: field {source.answer_field!r}: its final answer {problem} "
                                f"(got {ground_truth!r})")
                continue
            rows.append(
                make_row(
                    data_source=source.data_source,
                    prompt_text=f"{question} {source.instruction}",
                    ground_truth=ground_truth,
                    split=split,
                    index=len(rows),
                    answer=answer,
                    question=question,
                )
            )
    return rows, problems


def _check_output_dir(output_dir: Path) -> None:
    """--output must be a directory or become one: neither it nor a parent may be a file (or a device)."""
    for where in (output_dir, *output_dir.parents):
        if where.exists():
            problem = directory_problem(where)
            if problem is not None:
                what = "" if where == output_dir else f"its parent {where} "
                raise InputError(f"--output {output_dir}: {what}{problem}")
            return


def preprocess(dataset: str, *, input_path: Path | None, output_dir: Path, seed: int = 0) -> dict[str, int]:
    """Write `output_dir`/{train,test}.parquet for `dataset` ("gsm8k", "math" or "arithmetic"); rows per split.

    Nothing is written when any input row is bad.
    """
    output_dir = Path(output_dir)
    _check_output_dir(output_dir)
    if dataset == "arithmetic":
        # Generated, so --input is not used; the sizes suit CPU runs.
        write_arithmetic_dataset(output_dir, ARITHMETIC_SIZES["train"], ARITHMETIC_SIZES["test"], seed)
        return dict(ARITHMETIC_SIZES)
    if dataset not in FORMATS:
        raise InputError(f"dataset {dataset!r}: unknown; choose one of {', '.join([*FORMATS, 'arithmetic'])}")
    if input_path is None:
        raise InputError(f"preprocess {dataset}: --input is required (a local jsonl/parquet file or directory)")
    split_files = find_split_files(Path(input_path))
    converted = {split: convert_split(FORMATS[dataset], split, files) for split, files in split_files.items()}
    raise_problems([problem for _, problems in converted.values() for problem in problems])
    raise_problems([f"--input {input_path}: the {split} files ({', '.join(map(str, split_files[split]))}) hold no "
                    f"records" for split, (rows, _) in converted.items() if not rows])
    atomic.write_files({output_dir / f"{split}.parquet": functools.partial(write_rows, rows)
                        for split, (rows, _) in converted.items()})
    return {split: len(rows) for split, (rows, _) in converted.items()}
