"""Where step metrics go: JSON lines, TensorBoard event files, the console and optionally W&B.

One `Tracker` per run. `log(step, metrics)` appends one JSON object per step to
`metrics.jsonl` (flushed at once so a crash loses nothing already logged),
writes scalars to TensorBoard, and advances a console progress bar that shows
the step, the training score and the ETA. A run resumed from the checkpoint of
step N (`resume_step=N`) first drops the records of later steps from
`metrics.jsonl` and has TensorBoard purge them (its `purge_step`), so the redone
steps appear once. Messages go to the console and to `logs/controller.log`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from megarl.tracking.metrics_file import truncate_metrics

logger = logging.getLogger(__name__)
SCORE_KEY = "critic/score/mean"
VAL_KEY = "val/score/mean"


@contextmanager
def controller_log(run_dir: Path) -> Iterator[Path]:
    """While inside, megarl's log records (INFO and up: phases, checkpoints, stops) go to `logs/controller.log`."""
    path = Path(run_dir) / "logs" / "controller.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    root = logging.getLogger("megarl")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield path
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()


def _as_float(value) -> float:
    value = float(value)
    return value if math.isfinite(value) else float("nan")


class Tracker:
    """Fan-out of step metrics to the enabled sinks."""

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        jsonl: bool = True,
        tensorboard: bool = True,
        console: bool = True,
        wandb=None,
        resume_step: int | None = None,
    ):
        """`wandb`: a `WandbSink` or None. `resume_step`: the checkpoint's step when resuming, else None."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        metrics_path = self.run_dir / "metrics.jsonl"
        kept = truncate_metrics(metrics_path, resume_step) if resume_step is not None else []
        self.logged_steps = {record["step"] for record in kept}
        self._jsonl = open(metrics_path, "a", encoding="utf-8") if jsonl else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = {"purge_step": resume_step + 1} if resume_step is not None else {}
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), **purge)
        self._wandb = wandb
        self._progress = None
        self._task = None
        if console:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[summary]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, completed=resume_step or 0, summary="")
        self._last_val: float | None = None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        clean = {key: _as_float(value) for key, value in metrics.items()}
        if self._jsonl is not None:
            record = {"step": step, "time": time.time(), **clean}
            self._jsonl.write(json.dumps(record, allow_nan=True) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(step, clean)
        self.logged_steps.add(step)
        if VAL_KEY in clean:
            self._last_val = clean[VAL_KEY]
        if self._progress is not None:
            parts = []
            if SCORE_KEY in clean:
                parts.append(f"score {clean[SCORE_KEY]:.3f}")
            if self._last_val is not None:
                parts.append(f"val {self._last_val:.3f}")
            if "timing_s/step" in clean:
                parts.append(f"{clean['timing_s/step']:.2f}s/step")
            self._progress.update(self._task, completed=step, summary="  ".join(parts))

    def message(self, text: str) -> None:
        """A line on the console above the progress bar (or plain print), also in the controller log."""
        logger.info(text)
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
