"""Preprocessors: GSM8K / MATH from jsonl and parquet fixtures to the exact rows of docs/data.md,
and one InputError line per bad input naming the file, the row and the value."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.cli import main
from megarl.data.preprocess import preprocess
from megarl.errors import InputError

GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

GSM8K_TRAIN = [
    {"question": "Natalia sold 48 clips. How many?", "answer": "She sold 48.\n#### 48"},
    {"question": "A car costs $1,200 more. Total?", "answer": "1000 + 200 = 1200\n#### 1,200"},
]
GSM8K_TEST = [{"question": "How far below zero?", "answer": "It is -3 degrees.\n#### -3"}]
MATH_TRAIN = [
    {"problem": "Compute $1/2 + 0$.", "solution": r"It is $\boxed{\frac{1}{2}}$.", "level": "Level 1"},
    {"problem": "Find $x$.", "solution": r"First \boxed{2}, no: $\boxed{\sqrt{\frac{3}{4}}}$", "type": "Algebra"},
]
MATH_TEST = [{"problem": "What is 6*7?", "solution": r"The product is \fbox{42}."}]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def write_parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def expected_row(data_source, instruction, record, question_key, answer_key, ground_truth, split, index):
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": record[question_key] + " " + instruction}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": record[answer_key], "question": record[question_key]},
    }


def gsm8k_row(record, truth, split, index):
    return expected_row("openai/gsm8k", GSM8K_INSTRUCTION, record, "question", "answer", truth, split, index)


def math_row(record, truth, split, index):
    return expected_row(
        "DigitalLearningGmbH/MATH-lighteval", MATH_INSTRUCTION, record, "problem", "solution", truth, split, index
    )


def read_rows(path):
    table = pq.read_table(path)
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    return table.to_pylist()


@pytest.mark.parametrize("writer, suffix", [(write_jsonl, "jsonl"), (write_parquet, "parquet")])
def test_gsm8k(tmp_path, writer, suffix):
    source = tmp_path / "gsm8k"
    source.mkdir()
    writer(source / f"train-00000-of-00001.{suffix}", GSM8K_TRAIN)
    writer(source / f"test-00000-of-00001.{suffix}", GSM8K_TEST)
    (source / "README.md").write_text("ignored")
    counts = preprocess("gsm8k", input_path=source, output_dir=tmp_path / "out")
    assert counts == {"train": 2, "test": 1}
    assert read_rows(tmp_path / "out" / "train.parquet") == [
        gsm8k_row(GSM8K_TRAIN[0], "48", "train", 0),
        gsm8k_row(GSM8K_TRAIN[1], "1200", "train", 1),
    ]
    assert read_rows(tmp_path / "out" / "test.parquet") == [gsm8k_row(GSM8K_TEST[0], "-3", "test", 0)]


@pytest.mark.parametrize("writer, suffix", [(write_jsonl, "jsonl"), (write_parquet, "parquet")])
def test_math(tmp_path, writer, suffix):
    writer(tmp_path / f"train.{suffix}", MATH_TRAIN)
    writer(tmp_path / f"test.{suffix}", MATH_TEST)
    assert preprocess("math", input_path=tmp_path / f"train.{suffix}", output_dir=tmp_path / "out") == {"train": 2}
    assert read_rows(tmp_path / "out" / "train.parquet") == [
        math_row(MATH_TRAIN[0], r"\frac{1}{2}", "train", 0),
        math_row(MATH_TRAIN[1], r"\sqrt{\frac{3}{4}}", "train", 1),  # the last box, nested braces
    ]
    assert preprocess("math", input_path=tmp_path / f"test.{suffix}", output_dir=tmp_path / "out") == {"test": 1}
    assert read_rows(tmp_path / "out" / "test.parquet") == [math_row(MATH_TEST[0], "42", "test", 0)]


def test_several_files_per_split_are_concatenated_in_name_order(tmp_path):
    write_jsonl(tmp_path / "train-2.jsonl", [GSM8K_TRAIN[1]])
    write_jsonl(tmp_path / "train-1.jsonl", [GSM8K_TRAIN[0]])
    assert preprocess("gsm8k", input_path=tmp_path, output_dir=tmp_path / "out") == {"train": 2}
    rows = read_rows(tmp_path / "out" / "train.parquet")
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["48", "1200"]
    assert [row["extra_info"]["index"] for row in rows] == [0, 1]


def problems_of(dataset, input_path, output_dir):
    with pytest.raises(InputError) as error:
        preprocess(dataset, input_path=input_path, output_dir=output_dir)
    return error.value.problems


def test_missing_and_misnamed_inputs(tmp_path):
    out = tmp_path / "out"
    assert problems_of("gsm8k", tmp_path / "nope", out) == [f"--input {tmp_path / 'nope'}: no such file or directory"]
    other = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_TRAIN)
    (problem,) = problems_of("gsm8k", other, out)
    assert problem.startswith(f"--input {other}: expected a file named train*.jsonl")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert problems_of("math", empty, out) == [
        f"--input {empty}: the directory has no train*/test* .jsonl or .parquet files"
    ]
    assert problems_of("gsm8k", None, out) == [
        "preprocess gsm8k: --input is required (a local jsonl/parquet file or directory)"
    ]
    assert problems_of("squad", tmp_path, out) == ["dataset 'squad': unknown; choose one of gsm8k, math, arithmetic"]
    assert not out.exists()


def test_bad_rows_are_all_reported_with_file_row_and_value(tmp_path):
    train = write_jsonl(
        tmp_path / "train.jsonl",
        [
            GSM8K_TRAIN[0],
            {"question": "No final answer?", "answer": "It is 5."},
            {"answer": "#### 3"},
            {"question": "", "answer": "#### 3"},
        ],
    )
    with open(train, "a") as handle:
        handle.write("\n[1, 2]\n")  # a blank line is skipped; line 6 is not an object
    test = write_parquet(tmp_path / "test.parquet", [{"question": "Q", "answer": "#### x"}])
    problems = problems_of("gsm8k", tmp_path, tmp_path / "out")
    assert problems == [
        f"{test} row 0: field 'answer' has no final answer '#### <number>': '#### x'",
        f"{train} line 2: field 'answer' has no final answer '#### <number>': 'It is 5.'",
        f"{train} line 3: field 'question' is missing or not a non-empty string (got None)",
        f"{train} line 4: field 'question' is missing or not a non-empty string (got '')",
        f"{train} line 6: expected an object with fields, got [1, 2]",
    ]
    assert not (tmp_path / "out").exists()  # nothing is written when any row is bad


def test_math_rows_without_solution_or_box(tmp_path):
    path = write_parquet(
        tmp_path / "train.parquet", [{"problem": "P", "solution": "no box here"}, {"problem": "P", "solution": None}]
    )
    assert problems_of("math", path, tmp_path / "out") == [
        f"{path} row 0: field 'solution' has no final answer '\\boxed{{...}}': 'no box here'",
        f"{path} row 1: field 'solution' is missing or not a non-empty string (got None)",
    ]


def test_invalid_json_and_many_problems_are_capped(tmp_path):
    broken = tmp_path / "train.jsonl"
    broken.write_text('{"question": "Q", "answer": "#### 1"}\n{"question": \n')
    assert problems_of("gsm8k", broken, tmp_path / "out") == [f"{broken} line 2: not valid JSON (Expecting value)"]
    many = write_jsonl(tmp_path / "test.jsonl", [{"question": "Q"}] * 25)
    problems = problems_of("gsm8k", many, tmp_path / "out")
    assert len(problems) == 21 and problems[-1] == "... and 5 more problems like these"


def test_cli_prints_problems_and_exits_2(tmp_path, capsys):
    write_jsonl(tmp_path / "train.jsonl", [{"question": "Q", "answer": "none"}])
    assert main(["preprocess", "gsm8k", "--input", str(tmp_path), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    bad_file = tmp_path / "train.jsonl"
    assert err == f"error: {bad_file} line 1: field 'answer' has no final answer '#### <number>': 'none'\n"
    write_jsonl(tmp_path / "train.jsonl", GSM8K_TRAIN)
    assert main(["preprocess", "gsm8k", "--input", str(tmp_path), "--output", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'out' / 'train.parquet'}: 2 rows\n"
