"""Metric sinks across a resume (metrics.jsonl, TensorBoard read back by its own reader, W&B offline) and the
controller state that a checkpoint carries (loader, KL controller, RNGs)."""

from __future__ import annotations

import json
import random
import re
import time

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


def test_into_a_file_the_progress_is_one_plain_line_per_step(tmp_path):
    from megarl.tracking.console import LineConsole, progress_console

    log = tmp_path / "log"
    with open(log, "w") as stream:
        console = progress_console(3, None, stream)
        assert isinstance(console, LineConsole)  # a file is no terminal
        console.step(0, {"val/score/mean": 0.25})  # validation before training: no line of its own
        timings = {"timing_s/gen": 2.0, "timing_s/reward": 0.1, "timing_s/reward_total": 1.9,
                   "timing_s/update_actor": 1.5, "timing_s/update_weights": 0.4, "timing_s/step": 4.0}
        for step in (1, 2):
            console.step(step, {"critic/score/mean": 0.5 + step / 10, **timings})
        console.step(3, {"critic/score/mean": 0.8, "val/score/mean": 0.75, **timings})
    lines = log.read_text().splitlines()
    assert len(lines) == 3
    # The first step's pace is its own timer (4 s): 2 steps left, 8 s.
    assert re.match(r"step 1/3  score 0\.600  val 0\.250 \(step 0\)  4\.0 s/step  elapsed \d:\d\d:\d\d  ETA 0:00:08  ",
                    lines[0])
    assert lines[2].startswith("step 3/3  score 0.800  val 0.750 (step 3)")
    # Phase shares of the step; reward_total overlaps gen, so it is no share; under 1% is left out.
    assert lines[0].endswith("gen 50% reward 2% update_actor 38% update_weights 10%")


def test_the_warm_up_writes_its_own_metrics_and_progress_and_leaves_the_step_records_alone(tmp_path, capsys):
    from megarl.tracking.console import SFT_EVERY

    tracker = Tracker(tmp_path, total_steps=4)  # console on: pytest's captured stderr is no terminal
    limit = SFT_EVERY + 5
    for step in range(1, limit + 1):
        tracker.log_sft(step, {"sft/loss": 1.0 / step, "sft/grad_norm": 0.5}, limit=limit,
                        summary=f"loss {1.0 / step:.4f}")
    tracker.log(1, {"critic/score/mean": 0.5, "timing_s/step": 1.0})
    tracker.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    sft = read_metrics(tmp_path / "sft_metrics.jsonl")
    assert [(r["sft/step"], r["sft/loss"]) for r in sft] == [(step, 1.0 / step) for step in range(1, limit + 1)]
    accumulator = EventAccumulator(str(tmp_path / "tensorboard" / "sft"), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert [event.step for event in accumulator.Scalars("sft/loss")] == list(range(1, limit + 1))
    err = capsys.readouterr().err.splitlines()
    assert [line.split("  ")[0] for line in err] == [f"sft warm-up 1/{limit}", f"sft warm-up {SFT_EVERY}/{limit}",
                                                      f"sft warm-up {limit}/{limit}", "step 1/4"]
    assert err[2].startswith(f"sft warm-up {limit}/{limit}  loss {1.0 / limit:.4f}  elapsed ")


def test_a_resumed_event_file_is_made_in_a_later_second_than_the_one_it_continues(tmp_path):
    # TensorBoard reads event files in name order, and the name's last part is a per-process counter that sorts
    # 10 before 9: a resume made by the same process within the same second would be read first (CI of d897649).
    from megarl.tracking.tracker import _after_the_newest_event_file

    now = int(time.time())
    (tmp_path / f"events.out.tfevents.{now}.host.1.9").write_bytes(b"")
    _after_the_newest_event_file(tmp_path)
    assert time.time() >= now + 1
