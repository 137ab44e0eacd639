"""Atomic step checkpoints of a run: `runs/<name>/checkpoints/step_<N>/`.

A step is written under `checkpoints/.tmp-step_<N>`: one megatron distributed checkpoint
per engine role (`actor/`, `critic/` and the frozen `reference/`, each loadable at any
layout), the controller's state (`controller_state.json`) and the resolved recipe
(`recipe.yaml`). Every file is then fsynced and digested (sha256), the marker
`COMPLETE.json` records the step, what the directory holds and each file's digest, and
the directory is renamed to `step_<N>`. Only then are older steps pruned to `keep_last`.
A directory without the marker is never loaded; `remove_incomplete` deletes the
leftovers of an interrupted save at the next start.

The reference never changes after the warm-up: a step hard-links the previous step's
reference files instead of writing them again (each step directory stays self-contained).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from megarl import atomic
from megarl.cluster.engine_worker import MegatronWorker
from megarl.controller.disk_full import disk_full_error

STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-step_"
MARKER = "COMPLETE.json"
CONTROLLER_STATE = "controller_state.json"
RECIPE_FILE = "recipe.yaml"
FORMAT_VERSION = 1
_CHUNK = 16 << 20


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


@dataclass(frozen=True)
class StepCheckpoint:
    """A complete step directory and its marker."""

    path: Path
    marker: dict

    @property
    def step(self) -> int:
        return int(self.marker["step"])

    @property
    def roles(self) -> list[str]:
        return list(self.marker["roles"])

    @property
    def weights_only(self) -> bool:
        return bool(self.marker["weights_only"])

    def controller_state(self) -> dict:
        return json.loads((self.path / CONTROLLER_STATE).read_text())

    def recipe_text(self) -> str:
        return (self.path / RECIPE_FILE).read_text()


def _step_of(path: Path, prefix: str) -> int | None:
    suffix = path.name[len(prefix):]
    return int(suffix) if path.name.startswith(prefix) and suffix.isdigit() else None


def _read_marker(step_dir: Path) -> dict | None:
    try:
        marker = json.loads((step_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if marker.get("format_version") != FORMAT_VERSION or marker.get("step") != _step_of(step_dir, STEP_PREFIX):
        return None
    return marker


def complete_steps(run_dir: Path) -> list[StepCheckpoint]:
    """The step directories that carry a valid marker, oldest first."""
    root = checkpoint_root(run_dir)
    found = []
    for path in root.glob(f"{STEP_PREFIX}*") if root.is_dir() else ():
        marker = _read_marker(path) if _step_of(path, STEP_PREFIX) is not None else None
        if marker is not None:
            found.append(StepCheckpoint(path, marker))
    return sorted(found, key=lambda checkpoint: checkpoint.step)


def remove_incomplete(run_dir: Path) -> list[Path]:
    """Delete interrupted saves (`.tmp-step_*`, and `step_*` without a valid marker); returns what went."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    complete = {checkpoint.path for checkpoint in complete_steps(run_dir)}
    removed = [path for path in sorted(root.iterdir()) if path.is_dir() and path not in complete
               and (_step_of(path, TMP_PREFIX) is not None or _step_of(path, STEP_PREFIX) is not None)]
    for path in removed:
        shutil.rmtree(path)
    return removed


def _digest_and_sync(path: Path) -> str:
    """sha256 of the file, after forcing it to stable storage (the marker must not outlive the data)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
        os.fsync(handle.fileno())
    return digest.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file())


def _digests(directory: Path, names: list[str]) -> dict[str, str]:
    # hashlib releases the GIL on large buffers: threads digest files of a big checkpoint in parallel.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(lambda name: _digest_and_sync(directory / name), names)))



def verify(checkpoint: StepCheckpoint) -> list[str]:
    """One line per file of the marker that is missing or whose digest differs; empty when intact."""
    names = list(checkpoint.marker["files"])
    missing = [name for name in names if not (checkpoint.path / name).is_file()]
    present = [name for name in names if name not in missing]
    actual = _digests(checkpoint.path, present)
    problems = [f"{checkpoint.path / name}: missing" for name in missing]
    problems += [f"{checkpoint.path / name}: sha256 differs from {MARKER}" for name in present
                 if actual[name] != checkpoint.marker["files"][name]]
    return problems


def _link_tree(source: Path, target: Path) -> None:
    for name in _files(source):
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        os.link(source / name, target / name)


def save_step(roles, run_dir: Path, *, step: int, controller_state: dict, recipe_text: str, keep_last: int,
              weights_only: bool) -> StepCheckpoint:
    """Write step `step` atomically (see the module docstring), then prune to the newest `keep_last` steps.

    A save that fails leaves no partial directory behind; one that failed because the disk is full raises
    OSError(ENOSPC) naming the step directory, the space left and the previous checkpoint (intact)."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{TMP_PREFIX}{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    previous = complete_steps(run_dir)
    try:
        return _save_into(tmp, roles, run_dir, step=step, previous=previous, controller_state=controller_state,
                          recipe_text=recipe_text, keep_last=keep_last, weights_only=weights_only)
    except Exception as error:
        # Measured before the partial directory goes: the space the save found, not what removing it frees.
        intact = f"{previous[-1].path} is intact" if previous else "no earlier checkpoint"
        full = disk_full_error(error, root / f"{STEP_PREFIX}{step}", note=intact,
                               needed_bytes=int(previous[-1].marker.get("bytes", 0)) if previous else 0)
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None and full is not error:
            raise full from error
        raise


def _save_into(tmp: Path, roles, run_dir: Path, *, step: int, previous: list[StepCheckpoint], controller_state: dict,
               recipe_text: str, keep_last: int, weights_only: bool) -> StepCheckpoint:
    root = tmp.parent
    roles.actor.group.run(MegatronWorker.save_checkpoint, str(tmp / "actor"), weights_only=weights_only)
    saved_roles = ["actor"]
    if roles.critic is not None:
        roles.critic.group.run(MegatronWorker.save_checkpoint, str(tmp / "critic"), weights_only=weights_only)
        saved_roles.append("critic")
    reused: dict[str, str] = {}
    if roles.reference_engine is not None:  # a LoRA actor's reference is its base: nothing of its own to save
        source = next((c for c in reversed(previous) if "reference" in c.roles), None)
        if source is None:
            roles.reference_engine.save_checkpoint(str(tmp / "reference"))
        else:
            _link_tree(source.path / "reference", tmp / "reference")
            reused = {name: digest for name, digest in source.marker["files"].items()
                      if name.startswith("reference/")}
        saved_roles.append("reference")
    (tmp / CONTROLLER_STATE).write_text(json.dumps(controller_state, indent=1, sort_keys=True))
    (tmp / RECIPE_FILE).write_text(recipe_text)
    names = _files(tmp)
    digests = {**_digests(tmp, [name for name in names if name not in reused]), **reused}
    marker = {"format_version": FORMAT_VERSION, "step": step, "roles": saved_roles, "weights_only": weights_only,
              "bytes": sum((tmp / name).stat().st_size for name in names), "files": digests}
    with open(tmp / MARKER, "w") as handle:
        handle.write(json.dumps(marker, indent=1, sort_keys=True))
        handle.flush()
        os.fsync(handle.fileno())
    for directory in sorted({(tmp / name).parent for name in names} | {tmp}):
        atomic.fsync_dir(directory)
    final = root / f"{STEP_PREFIX}{step}"
    os.rename(tmp, final)
    atomic.fsync_dir(root)
    if keep_last:
        for old in complete_steps(run_dir)[:-keep_last]:
            shutil.rmtree(old.path)
    return StepCheckpoint(final, marker)


def load_step(roles, checkpoint: StepCheckpoint) -> None:
    """Load every role's engines from `checkpoint` (optimizers too unless it was saved weights-only)."""
    with_optimizer = not checkpoint.weights_only
    roles.actor.group.run(MegatronWorker.load_checkpoint, str(checkpoint.path / "actor"), load_optimizer=with_optimizer)
    if roles.critic is not None:
        roles.critic.group.run(MegatronWorker.load_checkpoint, str(checkpoint.path / "critic"), load_optimizer=with_optimizer)
    if roles.reference_engine is not None:
        roles.reference_engine.load_checkpoint(str(checkpoint.path / "reference"), load_optimizer=False)
