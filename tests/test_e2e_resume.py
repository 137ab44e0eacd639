"""End to end: exact resume (GRPO and PPO), resume into another layout, metrics and TensorBoard after a resume.

A run of 2N steps (N = 2, a checkpoint every N steps) is the reference. Its run
directory is copied without the newest checkpoint, so the copy holds the checkpoint
of step N and the metrics of all 2N steps; `train` on the copy resumes from step N,
drops the records of steps N+1..2N and runs them again. Every per-step metric must
equal the reference's bit for bit, apart from timings (wall clock) and the rollout
engine's log-probs, whose last bits depend on how requests were batched inside the
engine (see test_e2e_quickstart). Any state the checkpoint missed (loader position,
KL controller, sampling seeds, optimizer, LR schedule, update counter, reference
weights, weight version) changes the sampled tokens or the update and shows up here.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megarl.config import load_recipe
from megarl.controller.checkpointing import MARKER
from megarl.controller.run import train

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
N = 2
# Small and fast: a short warm-up leaves the score near 0, so the entropy bonus makes sure every update
# moves the actor (and with it the next step's samples).
TINY = ["trainer.logging.console=false", "sft_warmup.steps=5", "sft_warmup.batch_size=32", "data.synthetic.num_val=16",
        "trainer.val_every=2", "actor.entropy_coeff=0.01", f"trainer.checkpoint.save_every={N}",
        "trainer.checkpoint.keep_last=0", "trainer.samples.train_rows=2", "trainer.samples.val_rows=4"]
VOLATILE = ("timing_s/", "perf/", "time", "weight_sync/", "rollout/logprob_diff")


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in record.items() if not k.startswith(VOLATILE)} for record in records]


def _train(recipe_file: str, output_dir: Path, name: str, *overrides: str) -> Path:
    recipe = load_recipe(RECIPES / recipe_file, [f"trainer.output_dir={output_dir}", f"name={name}", *TINY,
                                                 *overrides])
    return train(recipe)


def _copy_at_step(run_dir: Path, target: Path, step: int) -> Path:
    """`run_dir` as it would be had it stopped after writing the checkpoint of `step` (later ones removed)."""
    shutil.copytree(run_dir, target, symlinks=True)
    for path in (target / "checkpoints").iterdir():
        if int(path.name.removeprefix("step_")) > step:
            shutil.rmtree(path)
    return target


def _assert_same_steps(resumed: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]  # no step twice, none missing
    for ours, theirs in zip(_stable(resumed), _stable(reference)):
        assert ours == theirs, {k: (ours.get(k), theirs.get(k)) for k in ours.keys() | theirs.keys()
                                if ours.get(k) != theirs.get(k)}
    for ours, theirs in zip(resumed, reference):
        if "rollout/logprob_diff" in theirs:
            assert ours["rollout/logprob_diff"] == pytest.approx(theirs["rollout/logprob_diff"], abs=1e-6)


def _tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    accumulator = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
def test_grpo_resume_is_exact_and_continues_metrics_tensorboard_and_other_layouts(ray_session, tmp_path):
    # KL in the loss makes the reference role (and its checkpoint) part of the run.
    extra = ["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=16",
             "actor.ppo_micro_batch_size=16", "actor.use_kl_loss=true"]
    reference_dir = _train("quickstart-grpo-cpu.yaml", tmp_path, "full", f"trainer.total_steps={2 * N}", *extra)
    reference = _records(reference_dir)
    assert [r["step"] for r in reference] == [0, 1, 2, 3, 4] and reference[3]["actor/grad_norm"] > 0.0

    resumed_dir = _copy_at_step(reference_dir, tmp_path / "resumed", N)
    assert [r["step"] for r in _records(resumed_dir)] == [0, 1, 2, 3, 4]  # the steps after the checkpoint are in
    train(load_recipe(RECIPES / "quickstart-grpo-cpu.yaml", [f"trainer.output_dir={tmp_path}", "name=resumed",
                                                             *TINY, f"trainer.total_steps={2 * N}", *extra]))
    resumed = _records(resumed_dir)
    _assert_same_steps(resumed, reference)
    marker = json.loads((resumed_dir / "checkpoints" / "step_4" / MARKER).read_text())
    assert marker["roles"] == ["actor", "reference"] and marker["step"] == 4
    # TensorBoard, read by its own reader: the redone steps once each, with the redone values.
    for tag in ("critic/score/mean", "actor/entropy", "val/score/mean"):
        steps, values = zip(*_tensorboard_scalars(resumed_dir, tag))
        assert list(steps) == [r["step"] for r in resumed if tag in r]
        assert list(values) == pytest.approx([r[tag] for r in resumed if tag in r], rel=1e-6)  # stored as float32
    samples = [json.loads(line) for line in (resumed_dir / "samples" / "val_step_4.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and {"prompt", "response", "score", "data_source", "ground_truth"} <= set(samples[0])
    assert len((resumed_dir / "samples" / "train_step_3.jsonl").read_text().splitlines()) == 2

    # The checkpoint of step N, resumed with the actor and reference at TP2 over two processes. The
    # weights load exactly, so step N+1 samples the same tokens; its log-probs and update differ only
    # by the float noise of the TP2 matmuls (summation order: ~1e-6 relative in float32).
    layout_dir = tmp_path / "tp2"
    (layout_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference_dir / "checkpoints" / f"step_{N}", layout_dir / "checkpoints" / f"step_{N}")
    train(load_recipe(RECIPES / "quickstart-grpo-cpu.yaml", [
        f"trainer.output_dir={tmp_path}", "name=tp2", *TINY, f"trainer.total_steps={N + 1}", *extra,
        "placement.gpus_per_node=2", "rollout.num_servers=2", "actor.parallel.tp=2", "reference.parallel.tp=2"]))
    (step,) = [r for r in _records(layout_dir) if r["step"] == N + 1]
    (same,) = [r for r in reference if r["step"] == N + 1]
    for key in ("critic/score/mean", "response_length/mean", "actor/lr", "train/epoch"):
        assert step[key] == same[key], key
    for key in ("actor/entropy", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert math.isclose(step[key], same[key], rel_tol=1e-4, abs_tol=1e-6), (key, step[key], same[key])
    assert json.loads((layout_dir / "checkpoints" / f"step_{N + 1}" / "actor" / "megarl_checkpoint.json")
                      .read_text())["saved_layout"]["tp"] == 2


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
def test_ppo_resume_is_exact_with_critic_and_adaptive_kl(ray_session, tmp_path):
    # The critic warm-up spans the checkpoint's step, the adaptive KL coefficient moves every step.
    extra = ["data.train_batch_size=16", "critic.warmup_steps=1", "critic.ppo_mini_batch_size=32",
             "actor.ppo_mini_batch_size=32", "critic.ppo_micro_batch_size=16", "actor.ppo_micro_batch_size=16",
             "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=100"]
    reference_dir = _train("quickstart-ppo-cpu.yaml", tmp_path, "full", f"trainer.total_steps={2 * N}", *extra)
    reference = _records(reference_dir)
    coefficients = [r["actor/reward_kl_penalty_coeff"] for r in reference if r["step"] > 0]
    assert len(set(coefficients)) == len(coefficients)  # the controller's state changes every step

    resumed_dir = _copy_at_step(reference_dir, tmp_path / "resumed", N)
    train(load_recipe(RECIPES / "quickstart-ppo-cpu.yaml", [f"trainer.output_dir={tmp_path}", "name=resumed",
                                                            *TINY, f"trainer.total_steps={2 * N}", *extra]))
    _assert_same_steps(_records(resumed_dir), reference)
    assert json.loads((resumed_dir / "checkpoints" / "step_4" / MARKER).read_text())["roles"] == [
        "actor", "critic", "reference"]
