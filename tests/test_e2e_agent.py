"""End to end: `megarl train` with `rollout.multi_turn` (the guessing game: every episode runs several turns,
with no tool call needed from a barely warmed-up model), one short step on the session's Ray cluster.

Checks what only the whole run shows: the warm-up on demonstrations, episodes in training and validation,
the multi-turn and tool metric names in metrics.jsonl, the trainer's log-probs on the episodes' ids equal
to the engine's (the trained ids are the generated ids), turns in the sample files, and the sandbox's
processes gone at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from megarl.config import load_recipe
from megarl.controller.run import train

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-tools-cpu.yaml"


@pytest.mark.e2e
@pytest.mark.dist
def test_a_short_multi_turn_run(ray_session, tmp_path):
    recipe = load_recipe(RECIPE, [
        f"trainer.output_dir={tmp_path}", "name=agent", "trainer.logging.console=false",
        "trainer.total_steps=1", "trainer.val_every=1", "trainer.samples.train_rows=2",
        "data.synthetic={task: guessing, num_train: 64, num_val: 4, seed: 0, max_operand: 100}",
        "data.max_prompt_length=80", "data.train_batch_size=4", "rollout.n=2",
        "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=8",
        "rollout.multi_turn.environment=guessing", "rollout.multi_turn.tools=[python]",
        "rollout.multi_turn.max_tokens_per_turn=8", "rollout.multi_turn.max_turns=4",
        "sft_warmup.steps=2", "sft_warmup.batch_size=8",
    ])
    run_dir = train(recipe)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(record for record in records if record["step"] == 1)
    for key in ("multi_turn/turns/mean", "multi_turn/turns/max", "multi_turn/tool_token_share",
                "multi_turn/truncated", "tool/python/calls", "tool/python/errors", "tool/python/timeouts",
                "tool/python/latency_s", "val/score/mean", "val/score/megarl/guessing"):
        assert key in step, key
    assert step["multi_turn/turns/mean"] >= 2 and 0 < step["multi_turn/tool_token_share"] < 1
    assert step["rollout/logprob_diff"] < 1e-4  # the actor scored the very ids the engine sampled
    # At most 4 turns of -0.05 each, or a right guess: the environment's rewards, nothing else.
    assert step["critic/score/max"] <= 1.0 and step["critic/score/min"] >= -0.05 * 4 - 1e-6
    for kind in ("train", "val"):
        rows = [json.loads(line) for line in (run_dir / "samples" / f"{kind}_step_1.jsonl").read_text().splitlines()]
        turns = rows[0]["turns"]
        assert [turn["who"] for turn in turns[:2]] == ["assistant", "user"]
        assert all(turn["tokens"] > 0 and isinstance(turn["text"], str) for turn in turns)
    log = (run_dir / "logs" / "controller.log").read_text()
    assert "tool sandbox: 2 workers" in log and "sft warm-up done at step 2" in log
    leftovers = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
                 if "megarl.agent.sandbox_worker" in " ".join(p.info["cmdline"] or [])
                 and str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
