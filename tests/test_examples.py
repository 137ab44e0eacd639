"""The examples of examples/ do what docs/extending.md says: the custom scorer scores and a recipe names it,
the custom estimator computes its formula and its launcher makes `megarl` accept it by name."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _megarl(*args: str, launcher: str | None = None) -> subprocess.CompletedProcess:
    """`megarl ARGS` (or `python LAUNCHER ARGS`) from the repository root with the root on the import path, as the
    examples' docstrings say to run them."""
    command = [sys.executable, launcher] if launcher else [sys.executable, "-m", "megarl"]
    return subprocess.run([*command, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_custom_scorer_gives_partial_credit_and_a_recipe_names_it_per_data_source():
    from examples.custom_scorer import close_enough

    assert close_enough("7 + 5 = 12 #### 12", "12", {}) == 1.0
    assert close_enough("#### 13", "12", {}) == 0.5  # off by one
    assert close_enough("#### 1505", "1500", {}) == 0.5 and close_enough("#### 1516", "1500", {}) == 0.0
    assert close_enough("twelve", "12", {}) == 0.0
    done = _megarl("validate", "examples/custom-scorer-cpu.yaml")
    assert done.returncode == 0, done.stderr
    assert "megarl/arithmetic: examples.custom_scorer:close_enough" in done.stdout


@pytest.fixture
def group_median():
    from megarl.registry import ADVANTAGE_ESTIMATORS

    module = importlib.import_module("examples.custom_estimator")
    yield module.group_median
    ADVANTAGE_ESTIMATORS.remove("group_median")  # this process's registry, as other tests expect it
    sys.modules.pop("examples.custom_estimator")


def test_the_custom_estimator_subtracts_its_groups_median(group_median):
    from megarl.algorithms.advantages import estimate_advantages
    from megarl.registry import ADVANTAGE_ESTIMATORS

    assert ADVANTAGE_ESTIMATORS.get("group_median").meta == {"needs_critic": False, "needs_groups": True}
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    rewards = torch.zeros(6, 3)
    rewards[torch.arange(6), mask.sum(-1).long() - 1] = scores  # the outcome at each response's last token
    index = ["a", "a", "a", "b", "b", "b"]
    advantages, returns = estimate_advantages("group_median", token_level_rewards=rewards, response_mask=mask,
                                              index=index, values=None, gamma=1.0, lam=1.0, norm_by_std=True)
    median = {"a": 0.0, "b": 1.0}  # [1, 0, 0] and [1, 1, 0.5]
    expected = torch.stack([(score - median[uid]) * row for score, uid, row in zip(scores, index, mask)])
    assert torch.equal(advantages, expected) and torch.equal(returns, expected)


def test_the_estimators_launcher_makes_megarl_accept_it_by_name():
    done = _megarl("validate", "recipes/quickstart-grpo-cpu.yaml", "--set", "algorithm.adv_estimator=group_median",
                   launcher="examples/custom_estimator.py")
    assert done.returncode == 0, done.stderr
    assert "adv_estimator: group_median" in done.stdout and "needs no critic" in done.stdout
    plain = _megarl("validate", "recipes/quickstart-grpo-cpu.yaml", "--set", "algorithm.adv_estimator=group_median")
    assert plain.returncode == 2 and "group_median" in plain.stderr
