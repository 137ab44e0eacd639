"""`megarl plot` on a recorded metrics file (4 PPO steps with KL in the reward, validation at steps 0, 2, 4),
checked through the figure's own data: panel titles, line values, stacked timing bars."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megarl.cli import main
from megarl.tracking.plots import PANELS, PHASES, build_figure

RECORDED = Path(__file__).parent / "fixtures" / "metrics_ppo.jsonl"


def _records() -> list[dict]:
    return [json.loads(line) for line in RECORDED.read_text().splitlines()]


def _axes(figure) -> dict:
    return {axes.get_title(): axes for axes in figure.axes}


def test_panels_hold_the_recorded_values():
    records = _records()
    axes = _axes(build_figure([("ppo", records)]))
    assert list(axes) == [*PANELS, "Time per step: ppo"]
    for title, key in [("Training score and reward", "critic/rewards/mean"), ("KL", "actor/reward_kl_penalty"),
                       ("Entropy", "actor/entropy"), ("Response length", "response_length/mean"),
                       ("Validation score", "val/score/megarl/arithmetic")]:
        (line,) = [line for line in axes[title].get_lines() if line.get_label() == key]
        expected = [(r["step"], r[key]) for r in records if key in r]
        assert list(zip(line.get_xdata(), line.get_ydata())) == expected, (title, key)
    assert [line.get_label() for line in axes["Validation score"].get_lines()] == [
        "val/score/mean", "val/score/megarl/arithmetic"]
    assert list(axes["Validation score"].get_lines()[0].get_xdata()) == [0, 2, 4]


def test_timing_panel_stacks_every_phase_per_step_under_the_step_time():
    records = [r for r in _records() if "timing_s/step" in r]
    timing = _axes(build_figure([("ppo", _records())]))["Time per step: ppo"]
    phases = [c.get_label() for c in timing.containers]
    assert phases == [p for p in PHASES if any(f"timing_s/{p}" in r for r in records)]
    assert "update_actor" in phases and "values" in phases  # PPO: critic phases too
    tops = [0.0] * len(records)
    for container in timing.containers:
        for index, (bar, record) in enumerate(zip(container.patches, records)):
            assert bar.get_x() + bar.get_width() / 2 == record["step"]
            assert bar.get_y() == pytest.approx(tops[index])
            assert bar.get_height() == pytest.approx(record.get(f"timing_s/{container.get_label()}", 0.0))
            tops[index] += bar.get_height()
    (step_line,) = timing.get_lines()
    assert list(step_line.get_ydata()) == [r["timing_s/step"] for r in records]
    for top, record in zip(tops, records):
        assert top <= record["timing_s/step"] * 1.001  # phases are inside the step


def test_cli_draws_a_run_that_is_still_writing_and_compares_runs(tmp_path, capsys):
    running, other = tmp_path / "running", tmp_path / "other"
    for run in (running, other):
        run.mkdir()
        shutil.copy(RECORDED, run / "metrics.jsonl")
    with open(running / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 5, "critic/score/me')  # the line being written
    assert main(["plot", str(running)]) == 0
    png = running / "plots" / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot written: {png}" in capsys.readouterr().out
    out = tmp_path / "both.png"
    assert main(["plot", str(running), "--compare", str(other), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    figure = build_figure([("running", _records()), ("other", _records())])
    titles = [axes.get_title() for axes in figure.axes]
    assert titles[-2:] == ["Time per step: running", "Time per step: other"]
    labels = [line.get_label() for line in _axes(figure)["Entropy"].get_lines()]
    assert labels == ["running: actor/entropy", "other: actor/entropy"]


def test_plot_of_a_dir_without_metrics_is_bad_input(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: plot: {tmp_path / 'metrics.jsonl'} not found")


def test_overlapped_timings_are_a_line_beside_the_stack_and_the_warm_up_loss_has_its_panel():
    records = _records()
    for record in records:
        if "timing_s/step" in record:  # scoring busy during generation: more than the reward phase's own share
            record["timing_s/reward_total"] = record["timing_s/gen"] + record["timing_s/reward"]
    sft = [{"sft/step": step, "sft/loss": 2.0 / step} for step in range(1, 6)]
    axes = _axes(build_figure([("ppo", records)], {"ppo": sft}))
    timing = axes["Time per step: ppo"]
    assert "reward_total" not in [container.get_label() for container in timing.containers]
    (overlapped,) = [line for line in timing.get_lines() if line.get_label() == "reward_total (overlaps)"]
    assert list(overlapped.get_ydata()) == [r["timing_s/reward_total"] for r in records if "timing_s/step" in r]
    (loss,) = axes["SFT warm-up loss"].get_lines()
    assert list(zip(loss.get_xdata(), loss.get_ydata())) == [(r["sft/step"], r["sft/loss"]) for r in sft]
    assert axes["SFT warm-up loss"].get_xlabel() == "warm-up step"
