"""End to end: `megarl train-rm` then `megarl train` on recipes/quickstart-rm-cpu.yaml (shortened), on the
session's Ray cluster.

The reward model is fitted on arithmetic preference pairs starting from the policy's
own SFT warm-up, then GRPO trains on its scores alone (`reward.combine: rm`). The
rule score is never a reward here; the greedy validation rule score on held-out
problems must rise anyway. Thresholds come from seed-0 runs of this configuration
(see the constants), with margin for other machines' float differences.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config import load_recipe
from megarl.controller.rm_training import train_reward_model
from megarl.controller.run import train

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-rm-cpu.yaml"
# Measured (seed 0, this file's settings): RM_ACCURACY_MEASURED validation accuracy of the reward model, and
# greedy validation score VAL_BEFORE -> VAL_AFTER over the GRPO steps.
MIN_RM_ACCURACY = 0.8
MIN_VAL_GAIN = 0.1


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
def test_a_policy_trained_on_the_reward_model_alone_gets_better_at_the_rule(ray_session, tmp_path):
    common = [f"trainer.output_dir={tmp_path}", f"reward_model.path={tmp_path / 'rm'}",
              "trainer.logging.console=false", "data.synthetic.num_val=200"]
    result = train_reward_model(load_recipe(RECIPE, common))
    assert result.val_accuracy > MIN_RM_ACCURACY

    run_dir = train(load_recipe(RECIPE, [*common, "trainer.total_steps=30", "trainer.val_every=30"]))
    records = _records(run_dir / "metrics.jsonl")
    steps = [r for r in records if "timing_s/step" in r]
    assert len(steps) == 30
    for record in steps:
        # Trained on the model side alone: the outcome reward is the reward model's score.
        assert record["critic/score/mean"] == pytest.approx(record["reward/rm_score/mean"], abs=1e-5)
        assert record["timing_s/reward_total"] >= record["timing_s/reward"]
    # The reward model agrees with the rule it never saw as a reward.
    assert sum(r["reward/rm_rule_corr"] for r in steps) / len(steps) > 0.3
    before, after = records[0]["val/score/mean"], steps[-1]["val/score/mean"]
    assert after - before >= MIN_VAL_GAIN, f"validation rule score went from {before:.3f} to {after:.3f}"
