"""Padding helpers, the synthetic arithmetic task, RLDataset and PromptLoader (padding, positions,
length filtering, deterministic shuffling, exact resume), and `megarl preprocess arithmetic`."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from megarl.cli import main
from megarl.data.dataset import PromptLoader, RLDataset
from megarl.data.padding import left_pad, position_ids_from_mask, right_pad
from megarl.data.rows import make_row, write_rows
from megarl.data.synthetic import arithmetic_rows, worked_solution, write_arithmetic_dataset
from megarl.errors import InputError
from megarl.protocol import Batch


def test_left_and_right_pad():
    ids, mask = left_pad([[5, 6, 7], [8], []], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert ids.dtype == mask.dtype == torch.long
    ids, mask = left_pad([[5, 6], [8]], pad_id=9, length=4)
    assert ids.tolist() == [[9, 9, 5, 6], [9, 9, 9, 8]] and mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    ids, lengths = right_pad([[5, 6], [8], []], pad_id=9, length=3)
    assert ids.tolist() == [[5, 6, 9], [8, 9, 9], [9, 9, 9]] and lengths.tolist() == [2, 1, 0]
    with pytest.raises(ValueError, match="length 2: the longest sequence has 3"):
        left_pad([[1, 2, 3]], pad_id=0, length=2)
    with pytest.raises(ValueError, match="length 1: the longest sequence has 2"):
        right_pad([[1, 2]], pad_id=0, length=1)
    assert left_pad([], pad_id=0)[0].shape == (0, 0)


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]


def test_arithmetic_rows_schema_and_answers():
    rows = arithmetic_rows(50, seed=3, split="train", max_operand=20, start_index=100)
    a, b = (int(x) for x in rows[0]["extra_info"]["question"][: -len("=?")].split("+"))
    question = f"{a:02d}+{b:02d}=?"  # operands zero-padded to the width of max_operand
    assert rows[0] == {
        "data_source": "megarl/arithmetic",
        "prompt": [{"role": "user", "content": f'Answer after "####". {question}'}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": "train", "index": 100, "answer": f"#### {a + b}", "question": question},
    }
    for offset, row in enumerate(rows):
        left, right = (int(x) for x in row["extra_info"]["question"][: -len("=?")].split("+"))
        assert 0 <= left <= 20 and 0 <= right <= 20
        assert row["reward_model"]["ground_truth"] == str(left + right)
        assert row["extra_info"]["index"] == 100 + offset
    assert rows == arithmetic_rows(50, seed=3, split="train", max_operand=20, start_index=100)
    assert rows != arithmetic_rows(50, seed=4, split="train", max_operand=20, start_index=100)
    test_rows = arithmetic_rows(50, seed=3, split="test", max_operand=20)
    assert [row["extra_info"]["question"] for row in test_rows] != [row["extra_info"]["question"] for row in rows]


def test_worked_solutions_add_column_by_column_and_score_full_marks():
    from megarl.rewards.gsm8k import compute_score

    assert worked_solution(7, 45, 2) == ("ones: 7 + 5 + 0 = 12, write 2 carry 1\n"
                                         "tens: 0 + 4 + 1 = 05, write 5 carry 0\n"
                                         "#### 52")
    rows = arithmetic_rows(200, seed=1, split="train", max_operand=99999, solution="worked")
    assert [row["prompt"] for row in rows] == [row["prompt"] for row in
                                               arithmetic_rows(200, seed=1, split="train", max_operand=99999)]
    for row in rows:
        a, b = (int(x) for x in row["extra_info"]["question"][: -len("=?")].split("+"))
        *lines, answer = row["extra_info"]["answer"].split("\n")
        assert len(lines) == 5 and compute_score(answer, row["reward_model"]["ground_truth"]) == 1.0
        # Read the written digits back (the ones first) and the last carry: together they are the sum.
        written = [int(line.split("write ")[1][0]) for line in lines]
        carries = [int(line[-1]) for line in lines]
        assert sum(digit * 10**column for column, digit in enumerate(written)) + carries[-1] * 10**5 == a + b
        # Every column adds its two digits and the carry the column below wrote.
        for column, line in enumerate(lines):
            carry_in = carries[column - 1] if column else 0
            assert f"{a // 10**column % 10} + {b // 10**column % 10} + {carry_in} = " in line
    assert lines[4].startswith("column 5: ")
    with pytest.raises(ValueError, match="solution must be one of"):
        arithmetic_rows(1, seed=0, split="train", solution="steps")


def test_write_arithmetic_dataset_holds_out_test_pairs(tmp_path):
    # 16 pairs in all; 10 test rows hold out most of them, yet train never sees one.
    train_path, test_path = write_arithmetic_dataset(tmp_path, num_train=200, num_val=10, seed=0, max_operand=3)
    train = pq.read_table(train_path).to_pylist()
    test = pq.read_table(test_path).to_pylist()
    assert (len(train), len(test)) == (200, 10)
    assert not {row["extra_info"]["question"] for row in train} & {row["extra_info"]["question"] for row in test}
    assert {row["extra_info"]["split"] for row in test} == {"test"}
    with pytest.raises(InputError, match=r"data.synthetic.num_val: leaves no .* \(got 16\)"):
        write_arithmetic_dataset(tmp_path, num_train=1, num_val=16, seed=0, max_operand=3)


def test_cli_preprocess_arithmetic(tmp_path, capsys):
    out = tmp_path / "arith"
    assert main(["preprocess", "arithmetic", "--output", str(out), "--seed", "5"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"{out / 'train.parquet'}: 5000 rows", f"{out / 'test.parquet'}: 500 rows"]
    train = pq.read_table(out / "train.parquet").to_pylist()
    test = pq.read_table(out / "test.parquet").to_pylist()
    assert (len(train), len(test)) == (5000, 500)
    assert not {row["prompt"][0]["content"] for row in train} & {row["prompt"][0]["content"] for row in test}


def write_prompts(path, contents, data_source="megarl/arithmetic"):
    rows = [
        make_row(
            data_source=data_source,
            prompt_text=text,
            ground_truth=str(i),
            split="train",
            index=i,
            answer="",
            question=text,
        )
        for i, text in enumerate(contents)
    ]
    return write_rows(rows, path)


def chat_ids(tokenizer, text):
    prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(prompt, add_special_tokens=False)


def test_dataset_tokenizes_filters_and_keeps_fields(tmp_path, tokenizer):
    contents = ["short", "a much longer prompt " * 6, "What is 1 + 2?"]
    first = write_prompts(tmp_path / "a.parquet", contents[:2])
    second = write_prompts(tmp_path / "b.parquet", contents[2:], data_source="openai/gsm8k")
    limit = len(chat_ids(tokenizer, "What is 1 + 2?"))
    dataset = RLDataset.from_files([first, str(second)], tokenizer, max_prompt_length=limit)
    assert len(dataset) == 2 and dataset.num_dropped == 1 and dataset.num_rows == 3
    assert dataset[0]["input_ids"] == chat_ids(tokenizer, "short")
    assert dataset[1]["input_ids"] == chat_ids(tokenizer, "What is 1 + 2?")
    assert dataset.data_sources == ["megarl/arithmetic", "openai/gsm8k"]
    assert dataset[1]["reward_model"] == {"style": "rule", "ground_truth": "0"}
    assert dataset[1]["extra_info"]["question"] == "What is 1 + 2?"
    assert dataset[1]["raw_prompt"] == [{"role": "user", "content": "What is 1 + 2?"}]
    assert dataset[1]["index"] == 1


class _NoTemplate:
    """A tokenizer without a chat template (a base model's)."""

    chat_template = None
    name_or_path = "base-model"


def test_dataset_input_errors(tmp_path, tokenizer):
    missing = tmp_path / "missing.parquet"
    with pytest.raises(InputError) as error:
        RLDataset.from_files([missing, tmp_path / "other.parquet"], tokenizer, max_prompt_length=64)
    assert error.value.problems == [
        f"data file {missing}: no such file",
        f"data file {tmp_path / 'other.parquet'}: no such file",
    ]

    good = make_row(data_source="x", prompt_text="q", ground_truth="1", split="train", index=0, answer="", question="q")
    no_truth = {**good, "reward_model": {"style": "rule", "ground_truth": None}}
    no_source = {**good, "data_source": None}
    bad_prompt = {**good, "prompt": []}
    with pytest.raises(InputError, match="has no chat template"):
        RLDataset.from_files([write_rows([good], tmp_path / "good.parquet")], _NoTemplate(), max_prompt_length=64)

    path = write_rows([good, no_truth, no_source, bad_prompt], tmp_path / "bad.parquet")
    with pytest.raises(InputError) as error:
        RLDataset.from_files([path], tokenizer, max_prompt_length=64)
    assert error.value.problems == [
        f"{path} row 1: reward_model.ground_truth is missing "
        "(reward_model = {'style': 'rule', 'ground_truth': None})",
        f"{path} row 2: data_source is missing or empty (got None)",
        f"{path} row 3: prompt is not a non-empty list of messages (got [])",
    ]


@pytest.fixture
def ten_prompts(tmp_path, tokenizer):
    # Prompt lengths differ (1 to 10 "x" words), so batches really are left-padded.
    path = write_prompts(tmp_path / "ten.parquet", [" ".join(["x"] * (i + 1)) for i in range(10)])
    return RLDataset.from_files([path], tokenizer, max_prompt_length=128)


def test_batches_are_left_padded_with_positions(ten_prompts, tokenizer):
    loader = PromptLoader(ten_prompts, 4, shuffle=False, seed=0)
    batch = next(loader)
    expected = [chat_ids(tokenizer, " ".join(["x"] * (i + 1))) for i in range(4)]
    width = len(expected[-1])
    assert batch["input_ids"].shape == (4, width)
    for row, ids in enumerate(expected):
        pad = width - len(ids)
        assert batch["input_ids"][row].tolist() == [tokenizer.pad_token_id] * pad + ids
        assert batch["attention_mask"][row].tolist() == [0] * pad + [1] * len(ids)
        assert batch["position_ids"][row].tolist() == [0] * pad + list(range(len(ids)))
    assert batch["index"].tolist() == [0, 1, 2, 3]
    assert batch["raw_prompt"].shape == (4,) and batch["raw_prompt"][0] == [{"role": "user", "content": "x"}]
    assert [info["ground_truth"] for info in batch["reward_model"]] == ["0", "1", "2", "3"]
    assert len(Batch.from_dict(batch)) == 4


def index_stream(loader, count):
    return [next(loader)["index"].tolist() for _ in range(count)]


def test_shuffling_is_deterministic_and_reshuffles_each_epoch(ten_prompts):
    loader = PromptLoader(ten_prompts, 5, shuffle=True, seed=7)
    assert len(loader) == loader.batches_per_epoch == 2
    stream = index_stream(loader, 6)
    epochs = [stream[0] + stream[1], stream[2] + stream[3], stream[4] + stream[5]]
    for order in epochs:
        assert sorted(order) == list(range(10))  # each epoch is a permutation of the dataset
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(10))
    assert index_stream(PromptLoader(ten_prompts, 5, shuffle=True, seed=7), 6) == stream
    assert index_stream(PromptLoader(ten_prompts, 5, shuffle=True, seed=8), 2) != stream[:2]
    in_order = PromptLoader(ten_prompts, 5, shuffle=False, seed=7)
    assert index_stream(in_order, 4) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]] * 2


def test_drop_last_and_epoch_counter(ten_prompts):
    loader = PromptLoader(ten_prompts, 4, shuffle=False, seed=0)
    assert loader.batches_per_epoch == 2
    seen = []
    for _ in range(3):
        seen.append((next(loader)["index"].tolist(), loader.epoch))
    assert seen == [([0, 1, 2, 3], 0), ([4, 5, 6, 7], 0), ([0, 1, 2, 3], 1)]  # 8, 9 dropped
    keep = PromptLoader(ten_prompts, 4, shuffle=False, seed=0, drop_last=False)
    assert keep.batches_per_epoch == 3
    assert index_stream(keep, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]
    assert PromptLoader(ten_prompts, 20, shuffle=False, seed=0, drop_last=False).batches_per_epoch == 1
    with pytest.raises(InputError, match="10 prompts .* fewer than one batch of 11"):
        PromptLoader(ten_prompts, 11, shuffle=True, seed=0)


@pytest.mark.parametrize("interrupt_after", [1, 3, 4, 5])  # mid-epoch, at an epoch's end, right after one
def test_resume_equals_uninterrupted(ten_prompts, interrupt_after):
    # 3 batches of 3 per epoch (one prompt dropped), 8 batches span three epochs.
    uninterrupted = PromptLoader(ten_prompts, 3, shuffle=True, seed=11)
    reference = [next(uninterrupted) for _ in range(8)]

    first = PromptLoader(ten_prompts, 3, shuffle=True, seed=11)
    for _ in range(interrupt_after):
        next(first)
    state = first.state_dict()
    assert set(state) == {"epoch", "position", "seed"}

    resumed = PromptLoader(ten_prompts, 3, shuffle=True, seed=999)  # the saved seed wins
    resumed.load_state_dict(state)
    assert resumed.epoch == first.epoch
    for expected in reference[interrupt_after:]:
        batch = next(resumed)
        assert torch.equal(batch["input_ids"], expected["input_ids"])
        assert batch["index"].tolist() == expected["index"].tolist()
        assert list(batch["data_source"]) == list(expected["data_source"])


def test_load_state_dict_rejects_out_of_range(ten_prompts):
    loader = PromptLoader(ten_prompts, 3, shuffle=True, seed=0)
    with pytest.raises(ValueError, match="out of range for 10 prompts"):
        loader.load_state_dict({"epoch": 0, "position": 11, "seed": 0})
    assert np.array_equal(next(loader)["index"], next(PromptLoader(ten_prompts, 3, shuffle=True, seed=0))["index"])


def test_preference_pairs_carry_an_optional_margin(tmp_path, tokenizer):
    from megarl.commands.rm_training import Pairs
    from megarl.data.preference import read_pairs, write_pairs
    from megarl.data.rm_inputs import RewardModelInputs

    prompt = [{"role": "user", "content": "1+1=?"}]
    plain = write_pairs([{"prompt": prompt, "chosen": "#### 2", "rejected": "#### 3"}], tmp_path / "plain.parquet")
    with_margin = write_pairs([{"prompt": prompt, "chosen": "#### 2", "rejected": "3", "margin": 1.5}],
                              tmp_path / "margin.parquet")
    rows = read_pairs([plain, with_margin])
    assert "margin" not in rows[0] and rows[1]["margin"] == 1.5
    pairs = Pairs.build(rows, RewardModelInputs(tokenizer, tokenizer, max_length=64))
    # A file without the column trains the plain loss (margin 0); the update rows carry the margins.
    assert pairs.margin.tolist() == [0.0, 1.5]
    assert pairs.batch(np.array([1, 0]))["margin"].tolist() == [1.5, 0.0]

    bad = write_pairs([{"prompt": prompt, "chosen": "a", "rejected": "b", "margin": float("nan")}],
                      tmp_path / "bad.parquet")
    with pytest.raises(InputError) as caught:
        read_pairs([bad])
    assert caught.value.problems == [f"{bad} row 0: margin is not a finite number (got nan)"]
