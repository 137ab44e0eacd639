"""Periodic checkpoints of a run: `runs/<name>/checkpoints/step_<N>/{actor,critic}`.

Each role's engines write a megatron distributed checkpoint (weights, optimizer,
LR schedule; loadable at any layout, exportable with `megarl export`). Only the
newest `keep_last` step directories are kept. Resuming from them is not wired
into the step loop yet, so a run refuses to start over an existing checkpoint
directory with `resume: auto` instead of silently starting from scratch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from megarl.errors import InputError

STEP_PREFIX = "step_"


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def refuse_silent_restart(run_dir: Path, *, resume: str) -> None:
    """With `resume: auto`, existing checkpoints mean the user expects a resume megarl cannot do yet."""
    existing = sorted(checkpoint_root(run_dir).glob(f"{STEP_PREFIX}*"))
    if resume == "auto" and existing:
        raise InputError(
            f"trainer.checkpoint.resume: {run_dir} already holds {existing[-1].name}, and resuming a run is not "
            "supported yet; use a new name, remove the checkpoints, or set resume: never (got 'auto')"
        )


def save_step(roles, run_dir: Path, *, step: int, keep_last: int) -> Path:
    """Save every trainable role at `step`, then prune to the newest `keep_last` steps."""
    step_dir = checkpoint_root(run_dir) / f"{STEP_PREFIX}{step}"
    roles.actor.group.run("save_checkpoint", str(step_dir / "actor"))
    if roles.critic is not None:
        roles.critic.group.run("save_checkpoint", str(step_dir / "critic"))
    if keep_last:
        steps = sorted(checkpoint_root(run_dir).glob(f"{STEP_PREFIX}*"), key=lambda p: int(p.name[len(STEP_PREFIX):]))
        for old in steps[:-keep_last]:
            shutil.rmtree(old)
    return step_dir
