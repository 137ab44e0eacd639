"""Where step metrics go: JSON lines, TensorBoard event files and the console.

One `Tracker` per run. `log(step, metrics)` appends one JSON object per step to
`metrics.jsonl` (flushed at once so a crash loses nothing already logged),
writes scalars to TensorBoard, and advances a console progress bar that shows
the step, the training score and the ETA.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Mapping

SCORE_KEY = "critic/score/mean"
VAL_KEY = "val/score/mean"


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
        start_step: int = 0,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") if jsonl else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
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
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, summary="")
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
        """A line on the console above the progress bar (or plain print)."""
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
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
