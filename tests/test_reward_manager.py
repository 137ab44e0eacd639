"""Reward manager and scorer dispatch: placement at the last valid token, failures, custom scorers,
the unknown-data-source check, and the worker-pool path against the in-process path."""

from __future__ import annotations

import itertools
import os
import textwrap

import numpy as np
import pytest
import torch

from megarl.data.padding import right_pad
from megarl.errors import InputError
from megarl.protocol import Batch
from megarl.rewards.manager import RewardManager, reward_metrics
from megarl.rewards.registry import build_scorers, check_data_sources

_module_ids = itertools.count()


@pytest.fixture
def scorer_module(tmp_path, monkeypatch):
    """A uniquely named importable module of custom scorers (also importable in spawned workers)."""
    name = f"megarl_test_scorers_{os.getpid()}_{next(_module_ids)}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            import os

            def length_scorer(solution_str, ground_truth, extra_info):
                if "boom" in solution_str:
                    raise RuntimeError("scorer bug")
                return {"score": len(solution_str) / 10, "chars": len(solution_str), "pid": os.getpid()}

            def tagged_scorer(solution_str, ground_truth, extra_info):
                if extra_info.get("tag") == "nan":
                    return float("nan")
                if extra_info.get("tag") == "text":
                    return "not a number"
                return 0.5 if solution_str == ground_truth else 0.25
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def make_batch(tokenizer, samples, *, width=24):
    """samples: (response text, data_source, ground_truth, extra_info); responses end with <|im_end|>."""
    token_lists = [tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id] for text, *_ in samples]
    token_lists[-1] = []  # the last sample is an empty response: its score sits outside its (empty) mask
    responses, lengths = right_pad(token_lists, tokenizer.pad_token_id, width)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return Batch.from_dict(
        {
            "responses": responses,
            "response_mask": mask,
            "data_source": [source for _, source, _, _ in samples],
            "reward_model": [{"style": "rule", "ground_truth": truth} for _, _, truth, _ in samples],
            "extra_info": [info for *_, info in samples],
        }
    ), lengths


MIXED_SAMPLES = [
    ("12 + 30 = 42\n#### 42", "openai/gsm8k", "42", {}),
    ("#### 41", "megarl/arithmetic", "42", {}),
    ("no answer here", "openai/gsm8k", "42", {}),
    (r"so $\boxed{\dfrac12}$", "DigitalLearningGmbH/MATH-lighteval", r"\frac{1}{2}", {}),
    (r"so $\boxed{3}$", "HuggingFaceH4/MATH-500", "4", {}),
    ("#### 7", "megarl/arithmetic", "7", {}),
]


def test_score_sits_on_the_last_valid_token(tokenizer):
    batch, lengths = make_batch(tokenizer, MIXED_SAMPLES)
    output = RewardManager(tokenizer, build_scorers(), num_workers=0)(batch)
    expected_scores = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # the last one is the emptied response
    scores = output.token_level_scores
    assert scores.dtype == torch.float32 and scores.shape == batch["responses"].shape
    for row, (length, expected) in enumerate(zip(lengths.tolist(), expected_scores)):
        reference = torch.zeros(scores.shape[1])
        reference[max(length - 1, 0)] = expected  # an empty response keeps its score at index 0
        torch.testing.assert_close(scores[row], reference, rtol=0, atol=0)
    assert scores.sum(-1).tolist() == expected_scores
    assert output.extra["score"].tolist() == expected_scores
    assert output.extra["scorer_failed"].tolist() == [False] * 6
    assert output.num_failed == 0 and reward_metrics(output) == {"reward/scorer_failed": 0}


def test_special_tokens_are_skipped_when_decoding(tokenizer, scorer_module):
    # The eos token inside the valid length must not reach the scorer: "#### 7" + <|im_end|> == "#### 7".
    # The second (empty) response is scored as "" like any other: tagged_scorer's 0.25, which the row's sum returns.
    scorers = build_scorers({"exact": f"{scorer_module}:tagged_scorer"})
    batch, _ = make_batch(tokenizer, [("#### 7", "exact", "#### 7", {}), ("x", "exact", "y", {})])
    output = RewardManager(tokenizer, scorers)(batch)
    assert output.extra["score"].tolist() == [0.5, 0.25]
    assert output.token_level_scores.sum(-1).tolist() == [0.5, 0.25]


def test_an_empty_response_gets_its_scorers_penalty(tokenizer, scorer_module):
    # A format penalty for saying nothing (negative) reaches the outcome reward and GRPO's group baseline.
    scorers = build_scorers({"custom": f"{scorer_module}:length_scorer"})
    batch, lengths = make_batch(tokenizer, [("abcd", "custom", "", {}), ("", "custom", "", {})])
    assert lengths.tolist()[-1] == 0
    penalised = RewardManager(tokenizer, {**scorers, "custom": lambda text, truth, info: -1.0 if not text else 1.0})
    output = penalised(batch)
    assert output.token_level_scores.sum(-1).tolist() == [1.0, -1.0]
    from megarl.algorithms.advantages import grpo

    advantages, _ = grpo(output.token_level_scores, batch["response_mask"], np.array(["u", "u"]))
    assert advantages[0, 0] > 0  # the answer beats the empty response of its group


def test_failing_scorers_give_zero_and_are_counted(tokenizer, scorer_module):
    scorers = build_scorers({"custom": f"{scorer_module}:length_scorer", "tagged": f"{scorer_module}:tagged_scorer"})
    samples = [
        ("abcdefghij", "custom", "", {}),
        ("boom", "custom", "", {}),
        ("a", "tagged", "a", {"tag": "nan"}),
        ("a", "tagged", "a", {"tag": "text"}),
        ("a", "tagged", "a", {}),
        ("", "custom", "", {}),
    ]
    batch, lengths = make_batch(tokenizer, samples)
    output = RewardManager(tokenizer, scorers)(batch)
    assert output.extra["score"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.5, 0.0]
    assert output.extra["scorer_failed"].tolist() == [False, True, True, True, False, False]
    assert output.num_failed == 3 and reward_metrics(output) == {"reward/scorer_failed": 3}
    torch.testing.assert_close(output.token_level_scores.sum(-1), torch.tensor([1.0, 0, 0, 0, 0.5, 0]))
    # Extra fields of dict-returning scorers are collected; samples without them get NaN.
    assert output.extra["chars"][0] == 10 and output.extra["chars"][5] == 0  # the empty response is scored
    assert np.isnan(output.extra["chars"][1:5]).all()


def test_unknown_data_source_is_reported_before_scoring(tokenizer):
    scorers = build_scorers()
    with pytest.raises(InputError) as error:
        check_data_sources(["openai/gsm8k", "my/quiz", "my/quiz", "other"], scorers)
    problems = error.value.problems
    assert len(problems) == 2
    assert problems[0].startswith("data_source 'my/quiz' has no reward scorer")
    assert "openai/gsm8k" in problems[0] and "DigitalLearningGmbH/MATH-lighteval" in problems[0]
    assert problems[0].endswith("reward.scorers: {'my/quiz': 'package.module:function'}")
    assert problems[1].startswith("data_source 'other' has no reward scorer")
    check_data_sources(["openai/gsm8k", "lighteval/MATH", "megarl/arithmetic"], scorers)  # no error

    batch, _ = make_batch(tokenizer, [("#### 1", "my/quiz", "1", {}), ("#### 1", "openai/gsm8k", "1", {})])
    with pytest.raises(InputError, match="my/quiz"):
        RewardManager(tokenizer, scorers)(batch)


def test_custom_scorer_by_import_path_and_bad_paths(scorer_module):
    scorers = build_scorers(
        {"openai/gsm8k": f"{scorer_module}:tagged_scorer", "new/source": f"{scorer_module}:length_scorer"}
    )
    assert scorers["openai/gsm8k"]("7", "7", {}) == 0.5  # a custom entry overrides a default
    assert scorers["new/source"]("abc", "", {})["chars"] == 3
    assert scorers["DigitalLearningGmbH/MATH-lighteval"](r"\boxed{2}", "2", {}) == 1.0

    with pytest.raises(InputError) as error:
        build_scorers(
            {
                "a": "no_such_module_xyz:score",
                "b": f"{scorer_module}:missing_function",
                "c": "no-colon-here",
            }
        )
    problems = error.value.problems
    assert len(problems) == 3
    assert problems[0].startswith("custom scorer for data_source 'a': 'no_such_module_xyz:score': cannot import")
    assert f"'{scorer_module}:missing_function'" in problems[1] and "no function 'missing_function'" in problems[1]
    assert "'no-colon-here'" in problems[2] and "expected 'package.module:function'" in problems[2]


def test_gsm8k_options_reach_the_scorer():
    scorers = build_scorers(gsm8k_method="flexible", format_score=0.1, score=2.0)
    assert scorers["openai/gsm8k"]("it is 42.", "42", {}) == 2.0
    assert scorers["megarl/arithmetic"]("it is 41.", "42", {}) == 0.1
    with pytest.raises(ValueError, match="gsm8k_method"):
        build_scorers(gsm8k_method="loose")


@pytest.mark.dist
def test_worker_pool_matches_in_process(tokenizer, scorer_module):
    scorers = build_scorers({"custom": f"{scorer_module}:length_scorer"})
    samples = MIXED_SAMPLES[:-1] + [("boom", "custom", "", {}), ("abcd", "custom", "", {}), ("", "custom", "", {})]
    batch, _ = make_batch(tokenizer, samples * 3)
    serial = RewardManager(tokenizer, scorers, num_workers=0)(batch)
    with RewardManager(tokenizer, scorers, num_workers=2, parallel_min_batch=4) as manager:
        parallel = manager(batch)
        again = manager(batch)  # the pool is reused
    torch.testing.assert_close(parallel.token_level_scores, serial.token_level_scores, rtol=0, atol=0)
    torch.testing.assert_close(again.token_level_scores, serial.token_level_scores, rtol=0, atol=0)
    assert parallel.num_failed == serial.num_failed == 3
    for key in ("score", "scorer_failed", "chars"):
        np.testing.assert_array_equal(parallel.extra[key], serial.extra[key])
    # The custom scorer reports its process id: the pool path really ran elsewhere.
    worker_pids = {pid for pid in parallel.extra["pid"] if not np.isnan(pid)}
    assert worker_pids and os.getpid() not in worker_pids
    assert set(serial.extra["pid"][~np.isnan(serial.extra["pid"])]) == {os.getpid()}


def test_small_batches_stay_in_process(tokenizer, scorer_module):
    scorers = build_scorers({"custom": f"{scorer_module}:length_scorer"})
    batch, _ = make_batch(tokenizer, [("abc", "custom", "", {}), ("de", "custom", "", {}), ("", "custom", "", {})])
    with RewardManager(tokenizer, scorers, num_workers=2, parallel_min_batch=64) as manager:
        output = manager(batch)
    assert output.extra["pid"][:2].tolist() == [os.getpid()] * 2


def test_a_pool_that_cannot_start_falls_back_to_in_process(tokenizer, caplog):
    # A lambda cannot be pickled into a spawned worker; scoring must still happen.
    scorers = {"lambda": lambda solution, truth, info: float(solution == truth)}
    batch, _ = make_batch(tokenizer, [("7", "lambda", "7", {}), ("8", "lambda", "7", {}), ("", "lambda", "", {})])
    with RewardManager(tokenizer, scorers, num_workers=2, parallel_min_batch=1) as manager:
        output = manager(batch)
    assert output.extra["score"].tolist() == [1.0, 0.0, 1.0] and output.num_failed == 0  # "" == "" too
    assert "reward worker pool failed" in caplog.text
