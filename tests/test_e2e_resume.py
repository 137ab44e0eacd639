"""End to end: exact resume (GRPO and PPO), resume into another layout, metrics and TensorBoard after a resume.

The session's shortened runs (tests/_e2e.py: 2N steps, N = 2, a checkpoint after every
step) are the references. A run directory is copied without the checkpoints after step
N, so the copy holds the checkpoint of step N and the metrics of all 2N steps; `train`
on the copy resumes from step N, drops the records of steps N+1..2N and runs them
again, here without the sleep/wake cycle (`placement.offload=false`). Every per-step
metric must equal the reference's bit for bit, apart from timings (wall clock) and the
rollout engine's log-probs, whose last bits depend on how requests were batched inside
the engine. Any state the checkpoint missed (loader position, KL controller, sampling
seeds, optimizer, LR schedule, update counter, reference weights, weight version)
changes the sampled tokens or the update and shows up here; so would the sleep/wake
cycle changing a single sampled token, score or update.

The GRPO run's checkpoint of step N also resumes into another layout (the actor at TP2, the
reference at DP2 on ranks of its own, loading what the reference fused into the actor's ranks
saved, two rollout servers), and there a rollout server is killed while the actor updates: the
run goes on, nothing hangs or repeats (this resume shares its start-up).
"""

from __future__ import annotations

import collections
import gc
import json
import math
import os
import shutil
import signal
from pathlib import Path

from _e2e import GRPO_N, GRPO_PROMPTS, records
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megarl.controller.checkpointing import MARKER
from megarl.rollout import RolloutFleet

N = 2  # the step resumed from: half of the references' steps
FAULT_END = N + 3  # the TP2 resume's last step: the server killed in step N+1 serves again by then
VOLATILE = ("timing_s/", "perf/", "time", "weight_sync/", "rollout/logprob_diff")
CYCLE = ("timing_s/onload", "timing_s/offload")


def _stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in record.items() if not k.startswith(VOLATILE)} for record in records]


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


def _the_fleet() -> RolloutFleet:
    """The run's rollout fleet (the only one a run of this process has open)."""
    fleets = [obj for obj in gc.get_objects() if type(obj) is RolloutFleet and not obj._closed]
    assert len(fleets) == 1
    return fleets[0]


def _tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    accumulator = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def _resume_without_the_cycle(reference, tmp_path: Path) -> list[dict]:
    """The reference's copy at step N resumed to its end without the sleep/wake cycle: its records."""
    resumed_dir = _copy_at_step(reference.run_dir, tmp_path / "resumed", N)
    assert [r["step"] for r in records(resumed_dir)] == [0, 1, 2, 3, 4]  # the steps after the checkpoint are in
    assert reference.train(tmp_path, "resumed", "placement.offload=false") == resumed_dir
    resumed = records(resumed_dir)
    assert all(key in r for r in reference.records() if r["step"] > N and "timing_s/step" in r for key in CYCLE)
    assert not any(key in r for r in resumed if r["step"] > N for key in CYCLE)
    return resumed


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
def test_grpo_resume_is_exact_and_continues_metrics_tensorboard_and_other_layouts(grpo_reference, tmp_path):
    reference = grpo_reference.records()
    assert [r["step"] for r in reference] == [0, 1, 2, 3, 4] and reference[3]["actor/grad_norm"] > 0.0
    resumed = _resume_without_the_cycle(grpo_reference, tmp_path)
    _assert_same_steps(resumed, reference)
    resumed_dir = tmp_path / "resumed"
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

    # The checkpoint of step N, resumed with the actor at TP2 over two processes, the reference at DP2 (a layout
    # other than the actor's, so on two ranks of its own: the reference saved from inside the actor's ranks loads
    # there) and two rollout servers, to step N+3. The weights load exactly, so step N+1 samples the same tokens;
    # its log-probs and update differ only by the float noise of the TP2 matmuls (summation order: ~1e-6
    # relative in float32).
    # At the start of step N+1's update_actor the driver SIGKILLs server 0 (found through the run's own fleet):
    # see _a_server_killed_during_update_actor.
    killed, seen = [], {}

    def on_phase(step: int, phase: str) -> None:
        fleet = _the_fleet()
        if step == N + 1 and phase == "update_actor" and not killed:
            victim = fleet.status()[0]
            os.kill(victim["pid"], signal.SIGKILL)
            killed.append(victim)
        if phase == "gen":
            seen[step] = [(server["state"], server["restarts"]) for server in fleet.status()]

    layout_dir = tmp_path / "tp2"
    (layout_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(grpo_reference.run_dir / "checkpoints" / f"step_{N}", layout_dir / "checkpoints" / f"step_{N}")
    rows = GRPO_PROMPTS * GRPO_N  # every sample of a step is written, so each step's batch can be counted
    grpo_reference.train(tmp_path, "tp2", f"trainer.total_steps={FAULT_END}", "placement.gpus_per_node=2",
                         "rollout.num_servers=2", "actor.parallel.tp=2", "reference.parallel.tp=1",
                         f"trainer.samples.train_rows={rows}", "trainer.checkpoint.save_every=0", on_phase=on_phase)
    (step,) = [r for r in records(layout_dir) if r["step"] == N + 1]
    (same,) = [r for r in reference if r["step"] == N + 1]
    for key in ("critic/score/mean", "response_length/mean", "actor/lr", "train/epoch"):
        assert step[key] == same[key], key
    for key in ("actor/entropy", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert math.isclose(step[key], same[key], rel_tol=1e-4, abs_tol=1e-6), (key, step[key], same[key])
    assert json.loads((layout_dir / "checkpoints" / f"step_{FAULT_END}" / "actor" / "megarl_checkpoint.json")
                      .read_text())["saved_layout"]["tp"] == 2
    assert sorted(path.name for path in (layout_dir / "logs").glob("reference-*.log")) == [
        "reference-0.log", "reference-1.log"]
    assert not list((grpo_reference.run_dir / "logs").glob("reference-*.log"))  # saved by the fused reference
    _a_server_killed_during_update_actor(layout_dir, killed, seen, rows=rows)


def _a_server_killed_during_update_actor(run_dir: Path, killed: list, seen: dict, *, rows: int) -> None:
    """Server 0 SIGKILLed at the start of step N+1's `update_actor` of a TP2 actor (two ranks whose every call is
    a gloo collective), colocated with the sleep/wake cycle: the death shows when the fleet resumes its weights
    for the sync; the sync goes to server 1; the restart waits until the fleet holds its memory again; the
    restarted server gets its weights from the driver, never from a thread of the fleet (its push, a collective
    over the actor's ranks, could otherwise meet the driver's own calls in another order on each rank and hang
    gloo). Every step must finish, each step's trained batch must hold every prompt exactly `rollout.n` times
    (no row lost or trained twice), and two steps later server 0 must serve again."""
    assert len(killed) == 1
    assert [r["step"] for r in records(run_dir)] == list(range(N + 1, FAULT_END + 1))
    for step in range(N + 1, FAULT_END + 1):
        samples = [json.loads(line) for line in
                   (run_dir / "samples" / f"train_step_{step}.jsonl").read_text().splitlines()]
        assert len(samples) == rows
        assert set(collections.Counter(row["prompt"] for row in samples).values()) == {GRPO_N}, step
    assert seen[N + 1] == [("up", 0), ("up", 0)]
    assert seen[FAULT_END] == [("up", 1), ("up", 0)]  # restarted once, synced by the driver, serving again


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
def test_ppo_resume_is_exact_with_critic_and_adaptive_kl(ppo_reference, tmp_path):
    # The critic warm-up spans the checkpoint's step, the adaptive KL coefficient moves every step.
    reference = ppo_reference.records()
    coefficients = [r["actor/reward_kl_penalty_coeff"] for r in reference if r["step"] > 0]
    assert len(set(coefficients)) == len(coefficients)  # the controller's state changes every step
    _assert_same_steps(_resume_without_the_cycle(ppo_reference, tmp_path), reference)
    assert json.loads((tmp_path / "resumed" / "checkpoints" / "step_4" / MARKER).read_text())["roles"] == [
        "actor", "critic", "reference"]
