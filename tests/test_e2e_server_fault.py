"""End to end: a rollout server killed while a two-rank actor updates; the run goes on, nothing hangs or repeats.

The GRPO quickstart, colocated with the sleep/wake cycle, the actor at TP2 (two ranks
whose every call is a gloo collective) and two CPU rollout servers, 4 steps. At the
start of step 2's `update_actor` the driver SIGKILLs server 0 (found through the run's
own fleet). The death shows when the fleet resumes its weights for the sync; the sync
goes to server 1; the restart waits until the fleet holds its memory again; the
restarted server gets its weights from the driver, never from a thread of the fleet
(its push, a collective over the actor's ranks, could otherwise meet the driver's own
calls in another order on each rank and hang gloo). Every step must finish, each
step's trained batch must hold every prompt exactly `rollout.n` times (no row lost
or trained twice), and by step 4 server 0 must serve again.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import signal
from pathlib import Path

import pytest

from megarl.config import load_recipe
from megarl.controller.run import train
from megarl.rollout import RolloutFleet

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml"
PROMPTS, N, STEPS = 8, 4, 4


def _the_fleet() -> RolloutFleet:
    """The run's rollout fleet (the only one this run starts)."""
    fleets = [obj for obj in gc.get_objects() if type(obj) is RolloutFleet and not obj._closed]
    assert len(fleets) == 1
    return fleets[0]


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_server_killed_during_update_actor_of_a_two_rank_actor(ray_session, tmp_path):
    killed, seen = [], {}

    def on_phase(step: int, phase: str) -> None:
        fleet = _the_fleet()
        if step == 2 and phase == "update_actor" and not killed:
            victim = fleet.status()[0]
            os.kill(victim["pid"], signal.SIGKILL)
            killed.append(victim)
        if phase == "gen":
            seen[step] = [(server["state"], server["restarts"]) for server in fleet.status()]

    recipe = load_recipe(RECIPE, [
        f"trainer.output_dir={tmp_path}", "name=fault", "trainer.logging.console=false", "sft_warmup.steps=0",
        f"trainer.total_steps={STEPS}", "trainer.val_before_train=false", "trainer.val_every=0",
        f"data.train_batch_size={PROMPTS}", f"rollout.n={N}", "actor.ppo_mini_batch_size=32",
        "actor.ppo_micro_batch_size=16", "actor.ppo_epochs=1", f"trainer.samples.train_rows={PROMPTS * N}",
        "trainer.checkpoint.save_every=0", "placement.gpus_per_node=2", "rollout.num_servers=2",
        "actor.parallel.tp=2",
    ])
    run_dir = train(recipe, on_phase=on_phase)

    assert len(killed) == 1
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        rows = [json.loads(line) for line in (run_dir / "samples" / f"train_step_{step}.jsonl").read_text().splitlines()]
        assert len(rows) == PROMPTS * N
        assert set(collections.Counter(row["prompt"] for row in rows).values()) == {N}, step
    assert seen[1] == [("up", 0), ("up", 0)]
    assert seen[STEPS] == [("up", 1), ("up", 0)]  # restarted once, synced by the driver, serving again
