"""The lines `megarl train` starts with: what runs, where its outputs and logs go, and on which layout.

Shown on the console and written to `logs/controller.log`, so a log file that
someone opens hours later says at its top whether the run started afresh or
resumed (from which checkpoint), where to look next, and how the roles were placed.
"""

from __future__ import annotations

from pathlib import Path

from megarl.config import Recipe, layout_summary
from megarl.controller.checkpointing import StepCheckpoint


def _start(recipe: Recipe, resume_from: StepCheckpoint | None) -> str:
    total = recipe.trainer.total_steps
    if resume_from is not None:
        return f"resumed from {resume_from.path} (step {resume_from.step}); steps {resume_from.step + 1}-{total} to go"
    warmup = recipe.sft_warmup
    if warmup.steps == 0:
        return f"fresh run, {total} steps"
    stops_early = warmup.stop_loss is not None or warmup.stop_accuracy is not None
    limit = f"at most {warmup.steps}" if stops_early else str(warmup.steps)
    return f"fresh run, {total} steps after an SFT warm-up of {limit} steps"


def start_banner(recipe: Recipe, run_dir: Path, resume_from: StepCheckpoint | None) -> list[str]:
    """The banner's lines: the run and how it starts, the run directory, metrics and logs, the layout."""
    logging = recipe.trainer.logging
    warms_up = recipe.sft_warmup.steps > 0 and resume_from is None
    metrics = [name for name, on in (("metrics.jsonl", logging.jsonl), ("sft_metrics.jsonl (the warm-up)",
                                     logging.jsonl and warms_up), ("tensorboard/", logging.tensorboard)) if on]
    layout = layout_summary(recipe)
    return [
        f"megarl train {recipe.name}: {_start(recipe, resume_from)}",
        f"  run dir  {run_dir}",
        f"  metrics  {', '.join(metrics) or 'none (trainer.logging)'}",
        f"  logs     {run_dir / 'logs'}: controller.log, one file per engine rank and rollout server",
        f"  layout   {layout[0]}",
        *(f"           {line}" for line in layout[1:]),
    ]
