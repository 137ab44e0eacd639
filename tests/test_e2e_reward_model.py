"""End to end: `megarl train-rm` then `megarl train` on recipes/quickstart-rm-cpu.yaml (shortened), on the
session's Ray cluster.

The reward model gets the recipe's 200 supervised steps, then 500 Bradley-Terry steps
on arithmetic preference pairs; GRPO then trains on its scores alone (`reward.combine:
rm`) for 20 steps. The rule score is never a reward here, yet the greedy validation
rule score on 500 held-out problems must rise. Thresholds come from the seed-0 run of
exactly this configuration (below), with margin for other machines, whose float noise
moves where the warm-ups stop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.commands.rm_training import train_reward_model
from megarl.config import load_recipe
from megarl.controller.run import train

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-rm-cpu.yaml"
# The reward model's backbone gets 400 supervised steps: from the former 200, inside the jump where the model
# learns the carries, its accuracy after these 500 Bradley-Terry steps swung with the CPU (0.928 on one machine,
# 0.678 on another); from 400 it was 0.89 (0.59 at step 50, 0.76 at 200, 0.87 at 400) on the second.
# Seed 0 on the 2-core CI machine, with the 200-step backbone: reward-model validation accuracy 0.928, mean reward/rm_rule_corr 0.41 over
# the steps, validation rule score 0.582 -> 0.628 (+0.046, 23 more of the 500 problems right). Within 20 steps the
# full recipe (1,000 reward-model steps) gained 0.07, a run whose warm-up stopped elsewhere 0.13. The gain
# threshold asks for 5 more problems right; the others for what a reward model that learned anything shows.
MIN_RM_ACCURACY = 0.8
MIN_RM_RULE_CORR = 0.2
MIN_VAL_GAIN = 0.01


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
def test_a_policy_trained_on_the_reward_model_alone_gets_better_at_the_rule(warmed_quickstart, tmp_path):
    # The reward model gets the recipe's own 400 supervised steps; the policy starts where the recipe's warm-up
    # (the quickstart's, shared by the session) leaves it. (A reward model started from that warmed policy
    # instead learned a weaker signal here, mean rm_rule_corr 0.25, and the policy's validation score fell.)
    common = [f"trainer.output_dir={tmp_path}", f"reward_model.path={tmp_path / 'rm'}",
              "trainer.logging.console=false"]
    result = train_reward_model(load_recipe(RECIPE, [*common, "reward_model.train.synthetic.num_train=32000"]))
    run_dir = train(load_recipe(RECIPE, [*common, "trainer.total_steps=20", "trainer.val_every=20",
                                         f"model.path={warmed_quickstart}", "sft_warmup.steps=0"]))
    records = _records(run_dir / "metrics.jsonl")
    steps = [r for r in records if "timing_s/step" in r]
    before, after = records[0]["val/score/mean"], steps[-1]["val/score/mean"]
    corr = sum(r["reward/rm_rule_corr"] for r in steps) / len(steps)
    assert result.val_accuracy > MIN_RM_ACCURACY
    assert len(steps) == 20
    for record in steps:
        # Trained on the model side alone: the outcome reward is the reward model's score (critic/score averages
        # over every row, reward/rm_score over the rows with a response: a rare empty response moves it by ~1/512).
        assert record["critic/score/mean"] == pytest.approx(record["reward/rm_score/mean"], abs=0.02)
        assert record["timing_s/reward_total"] >= record["timing_s/reward"]
    # The reward model agrees with the rule it never saw as a reward.
    assert corr > MIN_RM_RULE_CORR
    assert after - before >= MIN_VAL_GAIN, f"validation rule score went from {before:.3f} to {after:.3f}"
