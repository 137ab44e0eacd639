"""Start-up of a run directory: resume from its newest complete checkpoint, or start over.

With `trainer.checkpoint.resume: auto` (the default) `megarl train` continues from the
newest checkpoint that carries its marker and whose files match their digests (a
corrupt one is moved aside to `checkpoints/corrupt-step_<N>` and the next older one is
tried). The recipe may change how the run is executed and logged, not what it computes:
a key under `RESUME_BREAKING` that differs from the checkpoint's `recipe.yaml` (unless it
is under `RESUME_ALLOWED`) is refused with one line per key; a key the checkpoint's recipe
lacks (written before the key existed) is compatible at its schema default. With
`resume: never` (`megarl train --no-resume`), or when nothing can be resumed, an existing
run directory has its contents moved to `<name>.replaced-<time>` (never deleted) and the
run starts afresh. The launcher's entries (`LAUNCHER_ENTRIES`: `megarl submit`'s job files and the
logs its running job is writing) stay where they are: the job that starts over is the one
writing them. So do `megarl train-rm`'s outputs for the run of the same name (`train-rm/`, and
the reward model when `reward_model.path` lies in the run directory): the run reads them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from megarl.config import Recipe, dump_recipe
from megarl.config.dump import default_of
from megarl.controller.checkpointing import (
    StepCheckpoint,
    checkpoint_root,
    complete_steps,
    remove_incomplete,
    verify,
)
from megarl.errors import InputError

# What a run computes: its model and tokenizer, data and order, algorithm and losses, sampling, rewards.
RESUME_BREAKING = ("seed", "model", "data", "algorithm", "actor", "critic", "rollout.n", "rollout.temperature",
                   "rollout.top_p", "rollout.top_k", "rollout.ignore_eos", "reward")
# How it is executed: layouts (distributed checkpoints load at any layout), micro-batching, the optimizer's
# settings (the restored schedule takes the recipe's), the validation set.
RESUME_ALLOWED = ("actor.parallel", "critic.parallel", "actor.optim", "critic.optim", "actor.ppo_micro_batch_size",
                  "actor.logprob_micro_batch_size", "actor.max_tokens_per_microbatch", "critic.ppo_micro_batch_size",
                  "critic.max_tokens_per_microbatch", "data.val_files", "data.val_batch_size", "reward.num_workers")
# Written by the launcher around the run, not by the run: `megarl submit`'s sbatch script and job record, and
# the logs (the batch log, Ray's, the controller's) that the current job appends to.
LAUNCHER_ENTRIES = ("slurm", "logs")
# Written before the run by `megarl train-rm` for the run of the same name: its logs and metrics.
TRAIN_RM_ENTRIES = ("train-rm",)

_UNSET = object()  # a key one of the two recipes does not have


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        return {key: value for name, child in tree.items()
                for key, value in _leaves(child, f"{prefix}.{name}" if prefix else str(name)).items()}
    return {prefix: tree}


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for prefix in prefixes)


def _new_key_at_default(key: str, saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """A key the checkpoint's recipe lacks (written before the key existed) set to its schema default now: the
    run computes what it computed then."""
    if key in saved or key not in current:
        return False
    known, default = default_of(key)
    return known and current[key] == default


def incompatible_keys(saved_recipe: str, recipe: Recipe) -> list[tuple[str, Any, Any]]:
    """(key, value in the checkpoint's recipe, value now) for every resume-breaking difference."""
    saved, current = _leaves(yaml.safe_load(saved_recipe)), _leaves(yaml.safe_load(dump_recipe(recipe)))
    return [
        (key, saved.get(key, _UNSET), current.get(key, _UNSET))
        for key in sorted(saved.keys() | current.keys())
        if _under(key, RESUME_BREAKING) and not _under(key, RESUME_ALLOWED)
        and saved.get(key, _UNSET) != current.get(key, _UNSET) and not _new_key_at_default(key, saved, current)
    ]


def check_compatible(checkpoint: StepCheckpoint, recipe: Recipe) -> None:
    """InputError with one line per recipe key that would make resuming `checkpoint` compute another run."""
    def shown(value: Any) -> str:
        return "<unset>" if value is _UNSET else repr(value)

    problems = [
        f"{key}: cannot resume {checkpoint.path} with a changed value (it was written with {shown(before)}); "
        f"keep it, or start over with --no-resume (got {shown(now)})"
        for key, before, now in incompatible_keys(checkpoint.recipe_text(), recipe)
    ]
    if problems:
        raise InputError(problems)


def newest_intact(run_dir: Path, say: Callable[[str], None]) -> StepCheckpoint | None:
    """The newest complete checkpoint whose files match their digests; corrupt ones are moved aside."""
    for checkpoint in reversed(complete_steps(run_dir)):
        problems = verify(checkpoint)
        if not problems:
            return checkpoint
        aside = checkpoint_root(run_dir) / f"corrupt-{checkpoint.path.name}"
        checkpoint.path.rename(aside)
        say(f"checkpoint {checkpoint.path} is corrupt ({problems[0]}; {len(problems)} file(s)); moved to {aside}")
    return None


def _inputs_inside(run_dir: Path, recipe: Recipe) -> set[str]:
    """The entries of `run_dir` holding a checkpoint the recipe reads (e.g. the reward model `megarl train-rm`
    wrote to `reward_model.path` inside it)."""
    rm = recipe.reward_model
    paths = [recipe.model.path, rm.path if rm else None, rm.train.init_path if rm and rm.train else None]
    root, entries = run_dir.resolve(), set()
    for path in filter(None, paths):
        resolved = Path(path).expanduser().resolve()
        if resolved.is_relative_to(root) and resolved != root:
            entries.add(resolved.relative_to(root).parts[0])
    return entries


def _move_aside(run_dir: Path, recipe: Recipe, say: Callable[[str], None]) -> None:
    """The previous run's outputs into `<name>.replaced-<time>`: all but the launcher's entries, `megarl
    train-rm`'s and what the recipe reads."""
    kept = {*LAUNCHER_ENTRIES, *TRAIN_RM_ENTRIES, *_inputs_inside(run_dir, recipe)}
    outputs = [entry for entry in run_dir.iterdir() if entry.name not in kept]
    if not outputs:
        return
    aside = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    aside.mkdir()
    for entry in outputs:
        entry.rename(aside / entry.name)
    say(f"starting over: the previous outputs of {run_dir} are now in {aside}")


def resume_or_start(run_dir: Path, recipe: Recipe, *, say: Callable[[str], None]) -> StepCheckpoint | None:
    """The checkpoint of `run_dir` that `recipe` continues, or None for a fresh run (the outputs of an earlier
    run in `run_dir` are then moved aside).

    Raises InputError, leaving the directory as it was (bar leftovers of interrupted
    saves), when the recipe cannot continue the checkpoint.
    """
    for path in remove_incomplete(run_dir):
        say(f"removed incomplete checkpoint {path}")
    resume_from = newest_intact(run_dir, say) if recipe.trainer.checkpoint.resume == "auto" else None
    if resume_from is not None:
        check_compatible(resume_from, recipe)
        say(f"resuming from {resume_from.path} (step {resume_from.step})")
    elif run_dir.is_dir():
        _move_aside(run_dir, recipe, say)
    run_dir.mkdir(parents=True, exist_ok=True)
    return resume_from
