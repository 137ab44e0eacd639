"""Robustness tier: every value `megarl validate` accepts, `megarl train` accepts.

A sweep and a property test (hypothesis, `_recipe_values.py`) put edge values into the numeric fields of the
schema and the inline model config and build, from every recipe validate lets through, what a run builds
before its first step. Fixed cases pin the kinds of value a hostile-input probe found `train` crashing on
after validate had passed them (variants of them: other keys, other edges): each is refused by `megarl
validate` with exit 2 and a line naming the key and the value.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _engine_spawn import run_spawned
from _recipe_values import check_drawn_recipes
from megarl.cli import main
from megarl.data.rows import make_row, write_rows

pytestmark = pytest.mark.robust

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml"
# A small generated data set keeps `validate` (which builds the data sets as a run does) quick.
SMALL = ["data.synthetic.num_train=200", "data.synthetic.num_val=20", "sft_warmup.batch_size=64"]


def test_whatever_validate_accepts_builds_the_model_optimizer_sampling_and_data():
    """~650 swept and 60 drawn recipes in one spawned megatron rank (~30 s of CPU): each is refused line by
    line or builds; both must happen often, or the values miss the boundary."""
    (counts,) = run_spawned(check_drawn_recipes, max_examples=60, timeout_s=600)
    assert counts["refused"] >= 300 and counts["built"] >= 40, counts


def validate(capsys, *overrides: str) -> tuple[int, list[str]]:
    """`megarl validate QUICKSTART --set ...` in this process: (exit status, stderr lines)."""
    args = ["validate", str(QUICKSTART)]
    for override in [*SMALL, *overrides]:
        args += ["--set", override]
    status = main(args)
    return status, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("overrides, line", [
    # seeds, optimizer, sampling, KL: negative, past 32 or 64 bits, infinite, NaN, outside Adam's range
    (["seed=-7"], "seed: Input should be greater than or equal to 0 (got -7)"),
    (["seed=1099511627776"], "seed: Input should be less than or equal to 4294967295 (got 1099511627776)"),
    (["data.synthetic.seed=18446744073709551616"],
     "data.synthetic.seed: an integer outside the 64-bit range (got 18446744073709551616)"),
    (["actor.optim.betas=[0.9, 1.0]"], "actor.optim.betas[1]: Input should be less than 1 (got 1.0)"),
    (["actor.optim.eps=.nan"], "actor.optim.eps: Input should be a finite number (got nan)"),
    (["actor.optim.lr=1e300"], "actor.optim.lr: Input should be less than or equal to 10 (got 1e+300)"),
    (["sft_warmup.lr=-.inf"], "sft_warmup.lr: Input should be a finite number (got -inf)"),
    (["actor.optim.min_lr=0.001"], "actor.optim.min_lr: must be at most actor.optim.lr = 0.0005 (got 0.001)"),
    (["actor.optim.warmup_steps=500"],
     "actor.optim.warmup_steps: must be fewer than the run's 240 optimizer steps (got 500)"),
    (["rollout.val_temperature=.nan"], "rollout.val_temperature: Input should be a finite number (got nan)"),
    (["rollout.temperature=1e-8"], "rollout.temperature: must be 0 (greedy) or at least 1e-06"),
    (["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.target_kl=.inf"],
     "algorithm.kl_ctrl.target_kl: Input should be a finite number (got inf)"),
    (["trainer.checkpoint.preempt_timeout_s=1e12"],
     "trainer.checkpoint.preempt_timeout_s: Input should be less than or equal to 2592000 (got 1000000000000.0)"),
    (["rollout.engine_threads=4096"], "rollout.engine_threads: Input should be less than or equal to 1024 (got 4096)"),
    # the inline model config: heads that do not divide, zero or negative sizes, odd head dims, wrong types
    (["model.config.num_attention_heads=12"],
     "model.config.hidden_size: must be divisible by num_attention_heads = 12 (or give head_dim) (got 128)"),
    (["model.config.num_key_value_heads=-2"],
     "model.config.num_key_value_heads: must be an integer in 1..2147483647 (got -2)"),
    (["model.config.hidden_size=136"], "model.config.hidden_size: hidden_size / num_attention_heads = 17 must be "
     "even (rotary embeddings rotate pairs) (got 136)"),
    (["model.config.intermediate_size=0"], "model.config.intermediate_size: must be an integer in 1..2147483647"),
    (["model.config.vocab_size='512'"], "model.config.vocab_size: must be an integer in 1..2147483647 (got '512')"),
    (["model.config.vocab_size=300"],
     "model.config.vocab_size: smaller than the 512 ids of the tokenizer 'builtin' (got 300)"),
    (["model.config.model_type=mistral"], "model.config.model_type: not a supported model_type; known: llama"),
    (["model.config.rms_norm_eps=1"], "model.config.rms_norm_eps: transformers cannot build this config: "
     "TypeError: Field 'rms_norm_eps' expected float, got int (value: 1) (got 1)"),
    # data the loaders cannot draw a batch from
    (["data.max_prompt_length=10"], "data.train_batch_size: more than the prompts a step can draw: 0 of the 200 "
     "training prompts fit data.max_prompt_length = 10 (got 64)"),
    (["data.train_batch_size=4611686018427387904"],
     "data.train_batch_size: more than the data.synthetic.num_train = 200 prompts (got 4611686018427387904)"),
    (["data.train_batch_size=256", "actor.ppo_mini_batch_size=256"],
     "data.train_batch_size: more than the data.synthetic.num_train = 200 prompts (got 256)"),
    (["sft_warmup.batch_size=512"], "sft_warmup.batch_size: more than the data.synthetic.num_train = 200 prompts"),
    # worked solutions (~64 tokens) do not fit the quickstart's 12-token responses: the warm-up would cut them
    (["data.synthetic.solution=worked"], "data.max_response_length: 200 of the 200 training reference solutions that "
     "sft_warmup teaches take more than 11 tokens (the room left for EOS); prompt 0's takes 64 (got 12)"),
    (["data.synthetic.task=random_digits", "data.synthetic.solution=worked"], "data.synthetic.solution: only the "
     "addition task has worked solutions, not data.synthetic.task = random_digits (got 'worked')"),
])
def test_values_train_could_not_run_are_refused_at_validate(capsys, overrides, line):
    status, lines = validate(capsys, *overrides)
    assert status == 2 and lines and all(text.startswith("error: ") for text in lines), lines
    assert any(line in text for text in lines), lines


def _gsm8k_file(path: Path, answers: list[str], *, question: str = "What is 2+2?") -> Path:
    rows = [make_row(data_source="openai/gsm8k", prompt_text=question, ground_truth=answer, split="train",
                     index=index, answer=f"#### {answer}", question=question) for index, answer in enumerate(answers)]
    return write_rows(rows, path)


def test_data_files_a_run_could_not_use_are_refused_at_validate(capsys, tmp_path):
    """A train file of 0 rows, ground truths no response can match, and rows all longer than max_prompt_length."""
    files = ["data.synthetic=null", "data.val_files=[]", "trainer.val_every=0", "trainer.val_before_train=false",
             "sft_warmup.steps=0", "data.train_batch_size=2", "actor.ppo_mini_batch_size=16",
             "actor.ppo_micro_batch_size=16"]
    empty = _gsm8k_file(tmp_path / "empty.parquet", [])
    status, lines = validate(capsys, *files, f"data.train_files=[{empty}]")
    assert status == 2 and lines == [f"error: data.train_files: the files hold no prompts (got ['{empty}'])"]

    odd = _gsm8k_file(tmp_path / "odd.parquet", ["4", "3.1.4", "1,000", "-2.5"])
    status, lines = validate(capsys, *files, f"data.train_files=[{odd}]")
    assert status == 2 and lines == [
        f"error: data.train_files: {odd} row {row}: reward_model.ground_truth is not a number a response could "
        f"match (digits, an optional '-' and at most one decimal point) (got {truth!r})"
        for row, truth in ((1, "3.1.4"), (2, "1,000"))]
    # The user's own scorer for the source decides what a ground truth is.
    status, _ = validate(capsys, *files, f"data.train_files=[{odd}]",
                         "reward.scorers={openai/gsm8k: 'megarl.rewards.gsm8k:compute_score'}")
    assert status == 0

    long = _gsm8k_file(tmp_path / "long.parquet", ["4", "5"], question="2+2? " * 40)
    status, lines = validate(capsys, *files, f"data.train_files=[{long}]")
    assert status == 2 and lines == ["error: data.train_batch_size: more than the prompts a step can draw: 0 of the "
                                     "2 training prompts fit data.max_prompt_length = 48 (got 2)"]
