"""Metric sinks across a resume (metrics.jsonl, TensorBoard read back by its own reader, W&B offline) and the
controller state that a checkpoint carries (loader, KL controller, RNGs)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megarl.algorithms.kl import AdaptiveKLController
from megarl.controller import run_state
from megarl.tracking.metrics_file import read_metrics
from megarl.tracking.tracker import Tracker


def _log_steps(run_dir, steps, *, value, resume_step=None, wandb=None):
    tracker = Tracker(run_dir, total_steps=10, console=False, resume_step=resume_step, wandb=wandb)
    for step in steps:
        tracker.log(step, {"critic/score/mean": value(step), "timing_s/step": 0.5})
    tracker.close()
    return tracker


def test_a_resume_redoes_the_steps_after_its_checkpoint_once_in_jsonl_and_tensorboard(tmp_path):
    _log_steps(tmp_path, range(1, 6), value=lambda step: step / 10)  # steps 1..5, the run dies after 5
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "critic/sc')  # torn by the crash
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]

    tracker = _log_steps(tmp_path, range(4, 8), value=lambda step: step + 100.0, resume_step=3)
    assert tracker.logged_steps == {1, 2, 3, 4, 5, 6, 7}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["critic/score/mean"]) for r in records] == [
        (1, 0.1), (2, 0.2), (3, 0.3), (4, 104.0), (5, 105.0), (6, 106.0), (7, 107.0)]

    accumulator = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    events = accumulator.Scalars("critic/score/mean")
    assert [event.step for event in events] == [1, 2, 3, 4, 5, 6, 7]
    assert [event.value for event in events] == pytest.approx([0.1, 0.2, 0.3, 104.0, 105.0, 106.0, 107.0])


def test_wandb_sink_is_offline_and_keeps_one_run_id_across_resumes(tmp_path, monkeypatch):
    # wandb comes with the `test` extra (a run needs the `wandb` extra only when the sink is enabled).
    from megarl.tracking.wandb_sink import ID_FILE, WandbSink

    monkeypatch.setenv("WANDB_SILENT", "true")
    ids = []
    for steps, resume in ((range(1, 3), None), (range(3, 5), 2)):
        sink = WandbSink(tmp_path, name="run", project="megarl-test", entity=None, mode="offline", config={"seed": 0})
        ids.append(sink.run_id)
        _log_steps(tmp_path, steps, value=float, resume_step=resume, wandb=sink)
    assert ids[0] == ids[1] == (tmp_path / ID_FILE).read_text().strip()
    runs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{ids[0]}*"))
    assert len(runs) == 2  # both sessions wrote the same run, offline (nothing was uploaded)
    for run in runs:
        (log,) = run.glob("run-*.wandb")
        assert b"critic/score/mean" in log.read_bytes()


def test_controller_state_round_trips_through_json(tmp_path):
    from megarl.data.dataset import PromptLoader

    class Rows:  # the loader only needs len() and items for this
        pad_id = 0

        def __len__(self):
            return 10

        def __getitem__(self, index):
            return {"input_ids": [index + 1], "data_source": "d", "reward_model": {}, "extra_info": {},
                    "raw_prompt": [], "index": index}

    loader, kl_ctrl = PromptLoader(Rows(), 4, shuffle=True, seed=3), AdaptiveKLController(0.1, 0.05, 100)
    for _ in range(3):  # into the second epoch
        next(loader)
    kl_ctrl.update(0.2, n_steps=16)
    random.random(), np.random.rand(), torch.rand(1)
    state = json.loads(json.dumps(run_state.capture(step=3, weight_version=3, loader=loader, kl_ctrl=kl_ctrl)))
    expected = (next(loader)["index"].tolist(), random.random(), np.random.rand(), torch.rand(1).item())

    fresh_loader, fresh_kl = PromptLoader(Rows(), 4, shuffle=True, seed=3), AdaptiveKLController(0.1, 0.05, 100)
    run_state.restore(state, loader=fresh_loader, kl_ctrl=fresh_kl)
    assert (next(fresh_loader)["index"].tolist(), random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert fresh_kl.value == kl_ctrl.value and state["step"] == 3 and state["weight_version"] == 3
