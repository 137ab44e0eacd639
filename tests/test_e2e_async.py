"""End to end: asynchronous RL with max_staleness 0 is the synchronous loop, metric for metric.

The same two steps of `recipes/quickstart-async-cpu.yaml` (disaggregated: a trainer slot and a rollout slot)
as PPO, with a critic on the trainer's slot (GAE: the critic trains on the batches the actor trains on; GRPO's
whole groups are the same producer and buffer, and its async path runs in test_fleet and test_async_rollout),
once with `rollout.async` off and once with k = 0: every logged metric but timings, the engine's log-prob
difference (its last bits follow how the engine batched requests, see test_e2e_resume) and the async run's own
async/* and rollout_corr/* must be equal, bit for bit, the critic's and the values' included; the async run's
correction weights are exactly 1 and its staleness 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config import load_recipe
from megarl.controller.run import train

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-async-cpu.yaml"
# Short responses keep the test small: the recipe's worked solutions (~66 tokens) give way to the bare answer.
SMALL = ["trainer.total_steps=2", "trainer.val_every=2", "trainer.val_before_train=false", "data.synthetic.num_val=16",
         "data.train_batch_size=8", "data.max_response_length=24", "data.synthetic.solution=answer",
         "trainer.checkpoint.enabled=false", "trainer.logging.console=false", "sft_warmup.steps=3",
         "sft_warmup.batch_size=16", "actor.entropy_coeff=0.01", "actor.ppo_mini_batch_size=32",
         "actor.ppo_micro_batch_size=16"]
# PPO: GAE and a critic beside the actor (no critic warm-up, so both steps update the actor too).
PPO = ["algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=1.0", "critic.optim.lr=1e-3",
       "critic.warmup_steps=0", "critic.ppo_mini_batch_size=32", "critic.ppo_micro_batch_size=16",
       "placement.roles={actor: train, critic: train, rollout: gen}"]
VOLATILE = ("timing_s/", "perf/", "time", "weight_sync/", "rollout/logprob_diff")


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
def test_zero_staleness_is_the_synchronous_loop_metric_for_metric(ray_session, tmp_path):
    runs = {}
    for name, extra in (("sync", ["rollout.async=null"]), ("k0", ["rollout.async.max_staleness=0"])):
        recipe = load_recipe(RECIPE, [f"trainer.output_dir={tmp_path}", f"name={name}", *SMALL, *PPO, *extra])
        runs[name] = _records(train(recipe))
    sync, k0 = runs["sync"], runs["k0"]
    assert [r["step"] for r in k0] == [r["step"] for r in sync] == [1, 2]
    for ours, theirs in zip(k0, sync):
        stable = {k: v for k, v in ours.items() if not k.startswith((*VOLATILE, "async/", "rollout_corr/"))}
        assert stable == {k: v for k, v in theirs.items() if not k.startswith(VOLATILE)}
        assert ours["rollout/logprob_diff"] == pytest.approx(theirs["rollout/logprob_diff"], abs=1e-6)
        assert ours["async/staleness/max"] == 0 and ours["async/dropped_groups"] == 0
        assert ours["rollout_corr/mean"] == ours["rollout_corr/max"] == 1.0 and ours["rollout_corr/clipped"] == 0
    assert "val/score/mean" in k0[-1]
    assert all("critic/vf_loss" in record and "critic/values/mean" in record for record in k0)
