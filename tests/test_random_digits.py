"""The `megarl/random_digits` benchmark task: prompts of one exact token length, its scorer, its recipe keys."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megarl.config import load_recipe
from megarl.data.dataset import RLDataset
from megarl.data.random_digits import DATA_SOURCE, write_random_digits_dataset
from megarl.errors import InputError
from megarl.rewards.registry import build_scorers

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml"


@pytest.mark.parametrize("length", [9, 48, 200])
def test_every_prompt_has_exactly_the_length(tmp_path, tokenizer, length):
    train, test = write_random_digits_dataset(tmp_path, num_train=50, num_val=10, seed=3, prompt_length=length,
                                              tokenizer=tokenizer)
    for path in (train, test):
        dataset = RLDataset.from_files([path], tokenizer, max_prompt_length=length)
        assert len(dataset) == pq.read_table(path).num_rows and dataset.num_dropped == 0
        assert {len(ids) for ids in dataset.input_ids} == {length}
        assert set(dataset.data_sources) == {DATA_SOURCE}
    rows = pq.read_table(train).to_pylist()
    # Seeded: the same files again; train and test are different draws; the ground truth is the digit string.
    again, _ = write_random_digits_dataset(tmp_path / "again", num_train=50, num_val=10, seed=3,
                                           prompt_length=length, tokenizer=tokenizer)
    assert pq.read_table(again).to_pylist() == rows
    assert rows[0]["reward_model"]["ground_truth"] != pq.read_table(test).to_pylist()[0]["reward_model"]["ground_truth"]
    assert all(row["prompt"][0]["content"].endswith(row["reward_model"]["ground_truth"]) for row in rows)


def test_no_validation_file_without_validation_rows(tmp_path, tokenizer):
    train, test = write_random_digits_dataset(tmp_path, num_train=4, num_val=0, seed=0, prompt_length=20,
                                              tokenizer=tokenizer)
    assert test is None and train.exists() and not (tmp_path / "test.parquet").exists()


def test_a_length_the_template_alone_exceeds_is_refused(tmp_path, tokenizer):
    with pytest.raises(InputError, match=r"data.synthetic.prompt_length: the chat template .* \(got 8\)"):
        write_random_digits_dataset(tmp_path, num_train=4, num_val=0, seed=0, prompt_length=8, tokenizer=tokenizer)
    assert not list(tmp_path.iterdir())


def test_scorer_is_registered_and_graded():
    score = build_scorers()[DATA_SOURCE]
    assert score("a1b2", "0000", {}) == 0.5
    assert score("", "0000", {}) == 0.0 and score("12345", "0", {}) == 1.0


def test_recipe_keys(tmp_path):
    keys = ["data.synthetic.task=random_digits", "data.synthetic.prompt_length=30", "rollout.ignore_eos=true"]
    recipe = load_recipe(QUICKSTART, keys)
    assert recipe.data.synthetic.prompt_length == 30 and recipe.rollout.ignore_eos is True
    with pytest.raises(InputError, match=r"data.synthetic.prompt_length: longer than data.max_prompt_length = 48 "
                                         r"\(got 49\)"):
        load_recipe(QUICKSTART, ["data.synthetic.task=random_digits", "data.synthetic.prompt_length=49"])
