"""End to end: `megarl train` on the quickstart recipe (shortened), on the session's Ray cluster.

Checks the contract of a run on the session's shortened GRPO run (tests/_e2e.py):
every timing key and metric name of docs/metrics.md that the recipe's phases produce,
files in the run dir, and that weight sync is verified by `rollout/logprob_diff` ~ 0
right after each sync (the CPU engine really drops its weights while the engines
train, so a sync that missed a tensor shows); the progress it writes into a file (no
terminal) and its controller.log; that no process of the run holds its API key on its
command line; and that GRPO improves the training score. That a fixed
seed reproduces the run, also with the sleep/wake cycle switched off, is checked by
test_e2e_resume on the same run.
"""

from __future__ import annotations

import json
from pathlib import Path

from _e2e import STEPS, WARMUP_STEPS
import pytest

from megarl.config import load_recipe
from megarl.controller.run import train

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml"

TIMING_KEYS = ["gen", "onload", "reward", "reward_total", "old_log_prob", "ref", "adv", "update_actor", "offload",
               "update_weights", "step"]
METRIC_KEYS = [
    *(f"critic/{group}/{stat}" for group in ("score", "rewards", "advantages", "returns")
      for stat in ("mean", "max", "min")),
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
    "actor/kl_loss",
    *(f"{group}/{stat}" for group in ("response_length", "prompt_length")
      for stat in ("mean", "max", "min", "clip_ratio")),
    "perf/throughput", "perf/weight_sync_gbps", "rollout/logprob_diff",
    "perf/max_memory_gb/actor", "perf/max_memory_gb/rollout", "perf/train_state_gb/reference",
]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    recipe = load_recipe(QUICKSTART, [f"trainer.output_dir={tmp_path}", f"name={name}",
                                      "trainer.logging.console=false", *overrides])
    return _records(train(recipe))


def _check_the_log_of_a_file(err: str, run_dir: Path) -> None:
    """stderr went to a file (no terminal): the banner, the warm-up's progress and its end, then exactly one
    plain line per step; controller.log has the banner, the warm-up's end and each validation."""
    lines = err.splitlines()
    warmup, total = WARMUP_STEPS, STEPS
    stops = load_recipe(QUICKSTART).sft_warmup
    warmup_limit = f"at most {warmup}" if stops.stop_loss or stops.stop_accuracy else f"{warmup}"
    start = lines.index(f"megarl train full: fresh run, {total} steps after an SFT warm-up of {warmup_limit} steps")
    assert lines[start + 1] == f"  run dir  {run_dir}"
    assert lines[start + 2].startswith("  metrics  metrics.jsonl, sft_metrics.jsonl (the warm-up), tensorboard/")
    assert lines[start + 4].startswith("  layout   device cpu, colocated")
    sft = [line.split("  ")[0] for line in lines if line.startswith("sft warm-up")]
    assert sft[:2] == ["sft warm-up 1/5", "sft warm-up 5/5"] and len(sft) == 3
    assert sft[2].startswith("sft warm-up done at step 5, loss ") and sft[2].endswith("step limit reached)")
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split("  ")[0] for line in steps] == [f"step {step}/{total}" for step in range(1, total + 1)]
    assert " val " in steps[1] and "(step 2)" in steps[1] and "s/step  elapsed " in steps[0] and "gen " in steps[0]
    log = (run_dir / "logs" / "controller.log").read_text()
    for text in ("megarl train full: fresh run", "sft warm-up done at step 5", "validation at step 0: val/score/mean",
                 "validation at step 2: val/score/mean", "validation at step 4: val/score/mean"):
        assert text in log, text
    assert len((run_dir / "sft_metrics.jsonl").read_text().splitlines()) == warmup


@pytest.mark.e2e
@pytest.mark.dist
def test_short_run_logs_the_contract(grpo_reference):
    # The session's shortened run (tests/_e2e.py): KL in the loss switches the reference role (and
    # `timing_s/ref`) on. That a fixed seed reproduces a run, with or without the sleep/wake cycle, is
    # test_e2e_resume's check on the same run.
    first = grpo_reference.records()
    # Its API key was known to the test: no process the run started carried it on its command line.
    assert grpo_reference.watched.servers and not grpo_reference.watched.leaks, grpo_reference.watched.leaks
    _check_the_log_of_a_file(grpo_reference.stderr, grpo_reference.run_dir)
    steps = [record for record in first if "timing_s/step" in record]
    assert [record["step"] for record in steps] == [1, 2, 3, 4]
    for record in steps:
        missing = [f"timing_s/{key}" for key in TIMING_KEYS if f"timing_s/{key}" not in record]
        missing += [key for key in METRIC_KEYS if key not in record]
        assert not missing, f"step {record['step']} lacks {missing}"
        # The engine sampled with the weights the actor scores with: log-probs agree.
        assert record["rollout/logprob_diff"] < 1e-4
    assert "val/score/mean" in first[0] and "val/score/megarl/arithmetic" in steps[-1]
    run_dir = grpo_reference.run_dir
    # The reference shares the actor's pool and layout: it runs inside the actor's ranks (no processes, logs or
    # memory peak of its own), and holds the weights alone (no gradients or optimizer state beside them).
    assert sorted(path.name for path in (run_dir / "logs").glob("reference-*.log")) == []
    assert all("perf/max_memory_gb/reference" not in record for record in steps)
    assert 0 < steps[0]["perf/train_state_gb/reference"] < steps[0]["perf/train_state_gb/actor"] / 3
    assert "name: full\n" in (run_dir / "recipe.yaml").read_text()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    # Saved every step, the 3 newest kept; the same command again resumes a finished run: nothing to do.
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["step_2", "step_3", "step_4"]
    assert (run_dir / "checkpoints" / "step_4" / "actor" / "megarl_checkpoint.json").exists()
    assert grpo_reference.train(run_dir.parent, "full") == run_dir and grpo_reference.records() == first


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
def test_grpo_improves_the_training_score(warmed_quickstart, tmp_path):
    # From where the recipe's own warm-up (stopped by its held-out accuracy) leaves the policy, 12 GRPO steps
    # without validation, with dynamic micro-batches (packed sequences) in log-probs and updates. Nothing reads a
    # checkpoint of this run (the contract and resume tests use grpo_reference's): the final save (~4 s) is skipped.
    records = _run(tmp_path, "learn", "trainer.total_steps=12", "trainer.val_every=0",
                   "actor.max_tokens_per_microbatch=1024", f"model.path={warmed_quickstart}", "sft_warmup.steps=0",
                   "trainer.checkpoint.enabled=false")
    scores = [record["critic/score/mean"] for record in records if "critic/score/mean" in record]
    assert len(scores) == 12
    first, last = sum(scores[:4]) / 4, sum(scores[-4:]) / 4
    assert 0.0 < first < 0.8, f"the warm-up should leave the model imperfect, got {first:.3f}"
    assert last - first >= 0.05, f"score went from {first:.3f} to {last:.3f}"
    assert max(record["rollout/logprob_diff"] for record in records if "timing_s/step" in record) < 1e-4
