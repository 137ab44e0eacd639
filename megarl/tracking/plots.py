"""`megarl plot`: one PNG of a run's metrics, readable at a glance, optionally beside other runs.

Panels (each titled as in `PANELS`): training score and reward, validation score (mean
and per data source), KL, entropy, response length, the SFT warm-up's loss per warm-up
step (`sft_metrics.jsonl`), and per run a stacked bar of the phase timers `timing_s/*`
per step with the whole step as a line, so it shows where the time goes; timers of work
that overlaps other phases (`timing_s/reward_total`) are lines of their own, never part
of the stack. Reads the files as they are, so it works on a run that is still writing
(a torn last line is skipped). Drawn with matplotlib's Agg canvas: no display needed.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from megarl.algorithms.metrics import OVERLAPPED_TIMINGS
from megarl.errors import InputError
from megarl.tracking.metrics_file import read_metrics
from megarl.tracking.tracker import SFT_METRICS

# title -> metrics drawn as lines (those a run has), in this order.
PANELS = {
    "Training score and reward": ["critic/score/mean", "critic/rewards/mean"],
    "Validation score": ["val/score/mean"],  # + every val/score/<data_source>
    "KL": ["actor/reward_kl_penalty", "actor/kl_loss", "actor/ppo_kl"],
    "Entropy": ["actor/entropy"],
    "Response length": ["response_length/mean", "response_length/max"],
    "SFT warm-up loss": ["sft/loss"],  # per warm-up step, from sft_metrics.jsonl
}
SFT_PANEL = "SFT warm-up loss"
# Phase timers in the order of the step (docs/step.md); other timing_s/* keys follow, sorted.
PHASES = ["gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights"]
TIMING_TITLE = "Time per step: {name}"


def _series(records: list[dict], key: str, *, x: str = "step") -> tuple[list[int], list[float]]:
    points = [(record[x], record[key]) for record in records if key in record]
    return [step for step, _ in points], [value for _, value in points]


def _panel_keys(title: str, records: list[dict]) -> list[str]:
    keys = [key for key in PANELS[title] if any(key in record for record in records)]
    if title == "Validation score":
        keys += sorted({key for record in records for key in record
                        if key.startswith("val/score/") and key != "val/score/mean"})
    return keys


def _line_panel(axes, title: str, runs: list[tuple[str, list[dict]]], *, x: str = "step") -> None:
    axes.set_title(title)
    axes.set_xlabel("warm-up step" if x == "sft/step" else "step")
    axes.grid(alpha=0.3)
    drawn = 0
    for run_index, (name, records) in enumerate(runs):
        for key_index, key in enumerate(_panel_keys(title, records)):
            steps, values = _series(records, key, x=x)
            label = key if len(runs) == 1 else f"{name}: {key}"
            marker = "o" if title == "Validation score" else None
            axes.plot(steps, values, label=label, marker=marker, markersize=3,
                      linestyle=["-", "--", ":", "-."][key_index % 4], color=f"C{run_index}" if len(runs) > 1 else None)
            drawn += 1
    if drawn:
        axes.legend(fontsize=7)
    else:
        axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes, color="gray")


def _timing_panel(axes, name: str, records: list[dict]) -> None:
    axes.set_title(TIMING_TITLE.format(name=name))
    axes.set_xlabel("step")
    axes.set_ylabel("seconds")
    rows = [record for record in records if "timing_s/step" in record]
    present = {key[len("timing_s/"):] for record in rows for key in record if key.startswith("timing_s/")} - {"step"}
    stacked = present - set(OVERLAPPED_TIMINGS)
    phases = [phase for phase in PHASES if phase in stacked] + sorted(stacked - set(PHASES))
    steps = [record["step"] for record in rows]
    bottom = [0.0] * len(rows)
    for phase in phases:
        heights = [record.get(f"timing_s/{phase}", 0.0) for record in rows]
        axes.bar(steps, heights, bottom=bottom, label=phase, width=0.8)
        bottom = [low + height for low, height in zip(bottom, heights)]
    if rows:
        axes.plot(steps, [record["timing_s/step"] for record in rows], color="black", marker=".", label="step")
        for name in sorted(present & set(OVERLAPPED_TIMINGS)):  # overlaps the stacked phases: a line beside them
            key = f"timing_s/{name}"
            overlapped = [(record["step"], record[key]) for record in rows if key in record]
            axes.plot(*zip(*overlapped), color="gray", linestyle="--", marker=".", label=f"{name} (overlaps)")
        axes.legend(fontsize=7, ncol=2)
    else:
        axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes, color="gray")


def build_figure(runs: list[tuple[str, list[dict]]], sft: dict[str, list[dict]] | None = None) -> Figure:
    """The figure for (name, records) runs (`sft`: each run's warm-up records by name): the `PANELS` grid, then
    one timing panel per run."""
    figure = Figure(figsize=(14, 4 * (3 + len(runs))), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.add_gridspec(3 + len(runs), 2)
    sft_runs = [(name, (sft or {}).get(name, [])) for name, _ in runs]
    for index, title in enumerate(PANELS):
        axes = figure.add_subplot(grid[index // 2, index % 2])
        if title == SFT_PANEL:
            _line_panel(axes, title, sft_runs, x="sft/step")
        else:
            _line_panel(axes, title, runs)
    for index, (name, records) in enumerate(runs):
        _timing_panel(figure.add_subplot(grid[3 + index, :]), name, records)
    for axes in figure.axes:
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
    figure.suptitle(" vs ".join(name for name, _ in runs))
    return figure


def plot_runs(run_dirs: list[Path], *, out: Path | None = None) -> Path:
    """Draw the runs in `run_dirs` (the first decides the default output path); returns the PNG written."""
    runs, sft = [], {}
    for run_dir in run_dirs:
        path = Path(run_dir) / "metrics.jsonl"
        if not path.is_file():
            raise InputError(f"plot: {path} not found (not a run directory, or the run has logged nothing yet)")
        runs.append((Path(run_dir).name, read_metrics(path)))
        if (Path(run_dir) / SFT_METRICS).is_file():
            sft[Path(run_dir).name] = read_metrics(Path(run_dir) / SFT_METRICS)
    out = Path(out) if out is not None else Path(run_dirs[0]) / "plots" / "metrics.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    build_figure(runs, sft).savefig(out, dpi=80)
    return out
