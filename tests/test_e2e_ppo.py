"""End to end: `megarl train` on the PPO quickstart (GAE + critic), shortened, on the session's Ray cluster.

Checks the contract of a PPO run with both KL options on (KL in the reward with the
adaptive controller, and KL in the actor loss), on the session's shortened PPO run
(tests/_e2e.py, which test_e2e_resume also resumes): every phase timer incl. `values`,
`update_critic` and `ref`, the critic and KL metrics, the critic warm-up freezing the
actor, the controller's coefficient update; and that PPO improves the training score.
"""

from __future__ import annotations

import json
from pathlib import Path

from _e2e import PPO_KL
import pytest

from megarl.config import load_recipe
from megarl.controller.run import train

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-ppo-cpu.yaml"

TIMING_KEYS = ["gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
               "update_weights", "step"]
METRIC_KEYS = [
    *(f"critic/{group}/{stat}" for group in ("score", "rewards", "advantages", "returns", "values")
      for stat in ("mean", "max", "min")),
    "critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "critic/grad_norm", "critic/lr",
    "actor/entropy", "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff",
    "perf/throughput", "rollout/logprob_diff",
]
# Logged only by steps that update the actor (not during the critic warm-up).
ACTOR_UPDATE_KEYS = ["actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "actor/lr",
                     "actor/kl_loss"]


def _run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    recipe = load_recipe(QUICKSTART, [f"trainer.output_dir={tmp_path}", f"name={name}",
                                      "trainer.logging.console=false", *overrides])
    run_dir = train(recipe)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.dist
def test_ppo_with_both_kl_options_logs_the_contract(ppo_reference):
    # The session's shortened PPO run (tests/_e2e.py). Its short warm-up leaves the score (and so the
    # advantages) near 0: the entropy bonus still moves the actor.
    horizon, target, coef = PPO_KL["horizon"], PPO_KL["target"], PPO_KL["coef"]
    steps = [record for record in ppo_reference.records() if "timing_s/step" in record]
    assert [record["step"] for record in steps] == [1, 2, 3, 4]
    for record in steps[1:]:
        missing = [f"timing_s/{key}" for key in TIMING_KEYS if f"timing_s/{key}" not in record]
        missing += [key for key in METRIC_KEYS + ACTOR_UPDATE_KEYS if key not in record]
        assert not missing, f"step {record['step']} lacks {missing}"
    # The actor is frozen during the critic warm-up (step 1): everything but its update runs, and with
    # weights that did not change there is nothing to sync.
    frozen = ("update_actor", "update_weights")
    missing = [f"timing_s/{key}" for key in TIMING_KEYS if key not in frozen and f"timing_s/{key}" not in steps[0]]
    assert not missing + [key for key in METRIC_KEYS if key not in steps[0]]
    assert not {"timing_s/update_actor", "timing_s/update_weights", *ACTOR_UPDATE_KEYS} & set(steps[0])
    for record in steps:
        assert record["rollout/logprob_diff"] < 1e-4
        assert 0.0 <= record["critic/vf_clipfrac"] <= 1.0 and record["critic/vf_loss"] >= 0.0
    # The reference holds the post-warm-up actor: before the first actor update the KL is exactly 0.
    assert steps[0]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert steps[1]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    assert steps[2]["actor/reward_kl_penalty"] > 0.0
    # The adaptive controller: value *= 1 + clip(kl / target - 1, -0.2, 0.2) * samples / horizon.
    samples = 16 * 2  # train_batch_size * rollout.n
    expected = coef
    for record in steps:
        assert record["actor/reward_kl_penalty_coeff"] == pytest.approx(expected, rel=1e-9)
        error = min(max(record["actor/reward_kl_penalty"] / target - 1.0, -0.2), 0.2)
        expected *= 1.0 + error * samples / horizon


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
def test_ppo_improves_the_training_score(warmed_quickstart, tmp_path):
    # From where the recipe's own warm-up (stopped by its held-out accuracy) leaves the policy (and the critic's
    # backbone), the critic warm-up, then PPO steps, without validation. Nothing reads a checkpoint of this run (the
    # contract and resume tests use ppo_reference's): the final save of actor and critic (~6 s) is skipped.
    records = _run(tmp_path, "learn", "trainer.total_steps=14", "trainer.val_every=0",
                   f"model.path={warmed_quickstart}", "sft_warmup.steps=0", "trainer.checkpoint.enabled=false")
    scores = [record["critic/score/mean"] for record in records if "critic/score/mean" in record]
    assert len(scores) == 14
    first, last = sum(scores[:4]) / 4, sum(scores[-4:]) / 4
    assert 0.0 < first < 0.8, f"the warm-up should leave the model imperfect, got {first:.3f}"
    assert last - first >= 0.05, f"score went from {first:.3f} to {last:.3f}"
