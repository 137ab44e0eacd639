"""What a submitted job runs, frozen into the run directory at submit, and the inputs it will read.

A job may wait in the queue for days, and a requeued one starts again later
still; meanwhile the recipe file and the checkout change. So `megarl submit`
writes into `<run dir>/slurm/`:
- `recipe.yaml`: the recipe resolved with its base and every `--set` (every
  default filled in), which the job trains from;
- `code/megarl/`: a copy of the megarl sources that submitted it (the package
  this interpreter imports, uncommitted edits included), first on the job's
  PYTHONPATH; `code/SOURCE.json` says where it came from: the git commit, whether
  the checkout had uncommitted changes, and the digest preflight compares.

`input_paths` lists the files and directories a recipe reads (models,
tokenizers, data), for the checks at submit and the container's mounts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from megarl.atomic import write_text
from megarl.config import Recipe, dump_recipe
from megarl.submit.preflight import megarl_source_digest

RECIPE_NAME = Path("slurm") / "recipe.yaml"
CODE_DIR = Path("slurm") / "code"
# Recipe keys that name something the run reads from disk (at any depth of the recipe).
PATH_KEYS = ("path", "model_path", "init_path", "tokenizer", "train_files", "val_files")
NOT_PATHS = ("builtin",)


def input_paths(recipe: Recipe) -> list[tuple[str, Path]]:
    """(dotted key, path) of every file or directory the recipe reads, `~` expanded, in recipe order."""
    found: list[tuple[str, Path]] = []

    def walk(node, key: str) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                dotted = f"{key}.{name}" if key else name
                if name in PATH_KEYS and isinstance(value, str) and value not in NOT_PATHS:
                    found.append((dotted, Path(value).expanduser()))
                elif name in PATH_KEYS and isinstance(value, list):
                    found.extend((f"{dotted}[{index}]", Path(item).expanduser()) for index, item in enumerate(value)
                                 if isinstance(item, str))
                else:
                    walk(value, dotted)

    walk(recipe.model_dump(mode="json"), "")
    return found


def _git(package: Path, *args: str) -> str | None:
    try:
        result = subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def source_record(package: Path) -> dict:
    """Where the sources in `package` came from: git commit, uncommitted changes, digest."""
    commit = _git(package, "rev-parse", "HEAD")
    changes = _git(package, "status", "--porcelain", "--", ".") if commit else None
    return {"from": str(package), "commit": commit, "uncommitted_changes": bool(changes) if commit else None,
            "digest": megarl_source_digest()}


def freeze(recipe: Recipe, run_dir: Path) -> tuple[Path, Path]:
    """Write the resolved recipe and a copy of the megarl sources into `run_dir`; (recipe file, code dir)."""
    import megarl

    package = Path(megarl.__file__).resolve().parent
    recipe_path, code_dir = run_dir / RECIPE_NAME, run_dir / CODE_DIR
    recipe_path.parent.mkdir(parents=True, exist_ok=True)
    write_text(recipe_path, dump_recipe(recipe))
    # Copied beside the old copy, then swapped in: a job of this run that still runs keeps a complete tree.
    staging = code_dir.with_name(code_dir.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(package, staging / "megarl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    write_text(staging / "SOURCE.json", json.dumps(source_record(package), indent=2) + "\n")
    shutil.rmtree(code_dir, ignore_errors=True)
    staging.rename(code_dir)
    return recipe_path, code_dir
