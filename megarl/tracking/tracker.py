"""Where metrics go: JSON lines, TensorBoard event files, the console and optionally W&B.

One `Tracker` per run. `log(step, metrics)` appends one JSON object per step to
`metrics.jsonl` (flushed at once so a crash loses nothing already logged), writes
scalars to TensorBoard, and shows the step on the console (`megarl.tracking.console`:
a bar on a terminal, one line per step in a file). `log_sft(step, metrics)` does the
same for the SFT warm-up's steps, into `sft_metrics.jsonl` and TensorBoard's `sft` run
(`tensorboard/sft/`), so `metrics.jsonl` keeps one record per RL step and a resume's
purge of later RL steps cannot hide warm-up points. A run resumed from the checkpoint of
step N (`resume_step=N`) first drops the records of later steps from `metrics.jsonl`
and has TensorBoard purge them (its `purge_step`), so the redone steps appear once.
Messages go to the console and to `logs/controller.log`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from megarl.tracking.console import progress_console
from megarl.tracking.metrics_file import truncate_metrics

logger = logging.getLogger(__name__)
SFT_METRICS = "sft_metrics.jsonl"


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


def _after_the_newest_event_file(log_dir: Path) -> None:
    """Wait until the second after the newest event file in `log_dir` was made. TensorBoard reads a directory's
    event files in name order, and a name is `events.out.tfevents.<second>.<host>.<pid>.<counter>`: a resume made
    within the same second by the same process (an in-process run resumed at once) could sort before the file it
    continues when its counter goes from 9 to 10, and the purge of the redone steps would then apply backwards."""
    seconds = [int(part) for path in log_dir.glob("events.out.tfevents.*")
               if (part := path.name.split(".")[3]).isdigit()]
    while seconds and time.time() < max(seconds) + 1:
        time.sleep(0.05)


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
            if resume_step is not None:
                _after_the_newest_event_file(self.run_dir / "tensorboard")
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), **purge)
        self._wandb = wandb
        self._console = progress_console(total_steps, resume_step) if console else None
        self._sft_jsonl = None
        self._sft_tb = None

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
        if self._console is not None:
            self._console.step(step, clean)

    def log_sft(self, step: int, metrics: Mapping[str, float], *, limit: int, summary: str) -> None:
        """Warm-up step `step` of at most `limit`: its `sft/*` metrics to `sft_metrics.jsonl` and TensorBoard's
        `sft` run; the console shows `summary` (what the stopping rule compares, against its target)."""
        clean = {key: _as_float(value) for key, value in metrics.items()}
        if self._jsonl is not None:
            if self._sft_jsonl is None:  # a warm-up runs in fresh runs only: a new file
                self._sft_jsonl = open(self.run_dir / SFT_METRICS, "w", encoding="utf-8")
            self._sft_jsonl.write(json.dumps({"sft/step": step, "time": time.time(), **clean}, allow_nan=True) + "\n")
            self._sft_jsonl.flush()
        if self._tb is not None:
            if self._sft_tb is None:
                from torch.utils.tensorboard import SummaryWriter

                self._sft_tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard" / "sft"))
            for key, value in clean.items():
                self._sft_tb.add_scalar(key, value, step)
            self._sft_tb.flush()
        if self._console is not None:
            self._console.sft(step, limit, summary)

    def message(self, text: str) -> None:
        """A line on the console (above the progress bar, or plain print), also in the controller log."""
        logger.info(text)
        if self._console is not None:
            self._console.message(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._console is not None:
            self._console.close()
            self._console = None
        for writer in (self._tb, self._sft_tb):
            if writer is not None:
                writer.close()
        self._tb = self._sft_tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
        for handle in (self._jsonl, self._sft_jsonl):
            if handle is not None:
                handle.close()
        self._jsonl = self._sft_jsonl = None
