"""End to end: `megarl train-rm` then `megarl train` on recipes/quickstart-rm-cpu.yaml (shortened), on the
session's Ray cluster.

The reward model's backbone continues the session's warmed-up quickstart policy
(`warmed_quickstart`) for 160 supervised steps (`reward_model.train.init_path`, `sft_steps`):
that warm-up is the recipe's own backbone warm-up (same seed-0 model, data and order, lr,
batch and micro-batch) stopped by its held-out accuracy at step 235 (seed 0), so the backbone
gets about the recipe's 400 supervised steps (with fresh Adam moments after the first ~235),
the first ~235 paid for once per session. Then 500 Bradley-Terry steps on arithmetic preference pairs,
validated once, at the end (only the final accuracy is asserted); GRPO then trains on its
scores alone (`reward.combine: rm`) for 15 steps, without a final checkpoint (nothing reads
it), with a KL loss to the reference of 1.5 instead of the recipe's 0.2 (with 0.2, a weaker
reward model was exploited on another machine, below). The rule score is never a reward here, yet the greedy validation rule score on 500
held-out problems must rise. Thresholds come from seed-0 runs of this configuration (below),
with margin for other machines, whose float noise moves where the warm-ups stop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.commands.rm_training import train_reward_model
from megarl.config import load_recipe
from megarl.controller.run import train

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-rm-cpu.yaml"
BACKBONE_STEPS, RM_STEPS = 160, 500  # after the warmed policy's ~235; 32,000 pairs of 64
# This configuration on the 2-core machine, 2026-12-01 (loaded: load 10-20): seed 0: the warm-up stopped at step 232;
# reward-model validation accuracy 0.888 (0.66 after 50 Bradley-Terry steps, 0.80 after 150, 0.91 after 400); mean
# reward/rm_rule_corr 0.58 over the steps; validation rule score 0.454 -> 0.506 (+0.052) after 20 GRPO steps, and
# 0.454 -> 0.518 (+0.064) after 15 (2026-12-02; the test runs 15, ~50 s less). The former configuration
# (the recipe's 400 supervised steps from random weights, validated every 50 steps) had 0.89 at seed 0 here,
# 0.93 / 0.41 / 0.582 -> 0.628 on the CI machine from a 200-step backbone, and 0.68 on another machine from that
# one (inside the jump where the model learns the carries). Seed 1 is hard for both: the former configuration's
# reward model reached 0.798 (0.59 after 200 steps), below the threshold; this one 0.818 (0.72 after 200; its
# warm-up stopped at step 299), then mean rm_rule_corr 0.25 and validation 0.454 -> 0.340 (the policy learned to
# please a weak reward model). A reward model from the warmed policy without further supervised steps learned a
# weak signal too (mean rm_rule_corr 0.25, validation fell). The gain threshold asks for 5 more problems right; the
# others for what a reward model that learned anything shows. With the warm-up stopped by its held-out accuracy
# (2026-12-03, quiet machine, seed 0: step 235, validation 0.464 after it): reward-model accuracy 0.904, mean
# rm_rule_corr 0.61, validation 0.464 -> 0.572 (+0.108) after 15 GRPO steps; the test took 318 s (and 127 s of
# the session's warm-up). On a 2-core Intel Xeon machine (2026-12-03) the same warm-up stops at step 192 with
# validation 0.554, and with the recipe's KL (actor.kl_loss_coef 0.2) the test failed: reward-model accuracy 0.81,
# mean rm_rule_corr 0.27, validation 0.554 -> 0.456 (the policy drifted to sums 10 too high, which the reward model
# scores as right). Varied there (backbone / Bradley-Terry steps -> RM accuracy, corr, validation after 15 steps):
# 240/500 0.914, 0.52, 0.606; 320/500 0.808, 0.33, 0.446; 160/500 with a cosine LR 0.84, 0.26, 0.446; 160/700
# 0.88, 0.49, 0.550; 160/1000 0.902, 0.23, 0.340; 320/1000 0.852, 0.41, 0.570. Pair accuracy does not predict the
# outcome; the policy exploiting the reward model's misses does. What holds the policy where the reward model's
# signal is still right is the KL loss to the reference, as in RLHF: 160/500 with kl_loss_coef 0.2, 0.6 and 1.5
# gave 0.456, 0.544 and 0.594 (mean corr 0.27-0.28 in all three). The test runs KL_LOSS_COEF = 1.5.
MIN_RM_ACCURACY = 0.8
MIN_RM_RULE_CORR = 0.2
MIN_VAL_GAIN = 0.01
KL_LOSS_COEF = 1.5


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
def test_a_policy_trained_on_the_reward_model_alone_gets_better_at_the_rule(warmed_quickstart, tmp_path):
    # The reward model's backbone and the policy both start where the recipe's warm-up (the quickstart's, shared by
    # the session) leaves the policy; the backbone trains on for BACKBONE_STEPS.
    common = [f"trainer.output_dir={tmp_path}", f"reward_model.path={tmp_path / 'rm'}",
              "trainer.logging.console=false"]
    result = train_reward_model(load_recipe(RECIPE, [
        *common, f"reward_model.train.synthetic.num_train={RM_STEPS * 64}", "reward_model.train.mini_batch_size=64",
        f"reward_model.train.init_path={warmed_quickstart}", f"reward_model.train.sft_steps={BACKBONE_STEPS}",
        "reward_model.train.val_every=0"]))
    run_dir = train(load_recipe(RECIPE, [*common, "trainer.total_steps=15", "trainer.val_every=15",
                                         f"model.path={warmed_quickstart}", "sft_warmup.steps=0",
                                         "trainer.checkpoint.enabled=false", f"actor.kl_loss_coef={KL_LOSS_COEF}"]))
    records = _records(run_dir / "metrics.jsonl")
    steps = [r for r in records if "timing_s/step" in r]
    before, after = records[0]["val/score/mean"], steps[-1]["val/score/mean"]
    corr = sum(r["reward/rm_rule_corr"] for r in steps) / len(steps)
    assert result.steps == RM_STEPS and result.val_accuracy > MIN_RM_ACCURACY
    assert len(steps) == 15
    for record in steps:
        # Trained on the model side alone: the outcome reward is the reward model's score (critic/score averages
        # over every row, reward/rm_score over the rows with a response: a rare empty response moves it by ~1/512).
        assert record["critic/score/mean"] == pytest.approx(record["reward/rm_score/mean"], abs=0.02)
        assert record["timing_s/reward_total"] >= record["timing_s/reward"]
    # The reward model agrees with the rule it never saw as a reward.
    assert corr > MIN_RM_RULE_CORR
    assert after - before >= MIN_VAL_GAIN, f"validation rule score went from {before:.3f} to {after:.3f}"
