"""What a run needs from the filesystem, checked before anything heavy starts (Ray, engines, servers).

`check_inputs` finds every problem with the files a recipe names: the model and
critic checkpoints, the tokenizer, the data files (readable parquet, every row
usable) and the scorer of every data source. `megarl validate` runs it (unless
`--offline`, for a cluster recipe checked on a laptop); `megarl train` gets the
data checks from `bootstrap.prepare_data` and the checkpoint checks from here,
both before Ray starts. `prepare_run_dir` makes sure the run directory can be
created and written, with room to spare, and stays inside `trainer.output_dir`.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from megarl.config import Recipe
from megarl.config.settings import multi_turn_settings
from megarl.controller.bootstrap import (build_datasets, dataset_size_problems, demonstration_problems,
                                        vocabulary_problems)
from megarl.data.dataset import read_prompt_rows
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import InputError
from megarl.userfiles import directory_problem, file_problem, special_entries
from megarl.rewards.registry import build_scorers, check_data_sources, ground_truth_checks

# A run writes initial weights, data, logs and checkpoints: below this much free space it will not get far.
MIN_FREE_BYTES = 256 << 20
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
_FIELD = re.compile(r"for field '(\w+)'")


def _checkpoint_problems(key: str, path: str | None) -> list[str]:
    """A model dir must be a directory holding a regular config.json and safetensors weights (no FIFO or device:
    reading one would block or never end)."""
    if path is None:
        return []
    where = Path(path).expanduser()
    problem = directory_problem(where)
    if problem is not None:
        return [f"{key}: {problem} (got {path!r})"]
    problems = [f"{key}: {problem} (got {path!r})" for problem in special_entries(where)]
    if file_problem(where / "config.json") == "no such file":
        problems.append(f"{key}: {where / 'config.json'} not found (got {path!r})")
    if not any((where / name).is_file() for name in WEIGHT_FILES):
        problems.append(f"{key}: {where} holds neither {' nor '.join(WEIGHT_FILES)} (got {path!r})")
    return problems


def _transformers_problems(key: str, config: dict) -> list[str]:
    """transformers' own reading of an HF config (it types every field strictly: `rms_norm_eps: 1` is refused
    for not being a float); one line naming the field when it refuses."""
    from transformers import AutoConfig

    try:
        AutoConfig.for_model(**config)
    except Exception as error:  # noqa: BLE001 - transformers raises TypeError, ValueError and its own errors
        lines = str(error).strip().splitlines()
        field = _FIELD.search(lines[0]) if lines else None
        where = f"{key}.{field.group(1)}" if field and key == "model.config" else key
        got = config.get(field.group(1)) if field else config.get("model_type")
        detail = lines[-1].strip() if lines else type(error).__name__
        return [f"{where}: transformers cannot build this config: {detail} (got {got!r})"]
    return []


def check_checkpoints(recipe: Recipe) -> list[str]:
    """The model, critic, reward-model and judge checkpoints `megarl train` will read, and the policy's HF config
    as transformers reads it (the rollout servers and the initial weights go through it)."""
    problems = _checkpoint_problems("model.path", recipe.model.path)
    if not problems:
        problems += _transformers_problems("model.config" if recipe.model.path is None else "model.path",
                                           recipe.model.hf_config())
    if recipe.critic is not None:
        problems += _checkpoint_problems("critic.model_path", recipe.critic.model_path)
    if recipe.reward_model is not None:
        reward_model = _checkpoint_problems("reward_model.path", recipe.reward_model.path)
        if reward_model and recipe.reward_model.train is not None:
            reward_model = [f"{line}; `megarl train-rm` writes it" for line in reward_model]
        problems += reward_model
    if recipe.reward.judge is not None:
        problems += _checkpoint_problems("reward.judge.model_path", recipe.reward.judge.model_path)
    return problems


def check_reward_model_training(recipe: Recipe) -> list[str]:
    """What `megarl train-rm` needs: a reward_model.train section, a free output path, its starting checkpoint."""
    rm = recipe.reward_model
    if rm is None or rm.train is None:
        return ["reward_model.train: `megarl train-rm` needs a reward_model section with a train section (got None)"]
    problems = []
    if Path(rm.path).expanduser().exists():
        problems.append(f"reward_model.path: {rm.path} already exists; train-rm never overwrites a reward model "
                        f"(remove it or choose another path) (got {rm.path!r})")
    problems += _checkpoint_problems("reward_model.train.init_path", rm.train.init_path)
    return problems + _checkpoint_problems("model.path", recipe.model.path)


def check_inputs(recipe: Recipe) -> list[str]:
    """Every problem with the files `recipe` names (one line each); empty when a run can start."""
    problems = check_checkpoints(recipe)
    try:
        tokenizer = load_tokenizer(recipe.model.tokenizer)
    except InputError as error:
        problems += [f"model.tokenizer: {problem}" for problem in error.problems]
        tokenizer = None
    if tokenizer is not None and not problems:
        problems += vocabulary_problems(recipe, tokenizer)
    try:
        _check_data(recipe, tokenizer)
    except InputError as error:
        problems += error.problems
    return InputError(problems).problems  # one line each, whatever the paths hold


def _check_data(recipe: Recipe, tokenizer) -> None:
    """The data sets as a run builds them (or, without a tokenizer, the rows of the data files)."""
    data, reward = recipe.data, recipe.reward
    if tokenizer is not None:
        train, val, _ = build_datasets(recipe, tokenizer)
        problems = dataset_size_problems(recipe, train, val) + demonstration_problems(recipe, train, val, tokenizer)
        sources = set(train.data_sources) | (set(val.data_sources) if val is not None else set())
    else:
        problems, sources = [], set()
        checks = ground_truth_checks(reward.scorers)
        for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
            try:
                rows = read_prompt_rows([Path(file).expanduser() for file in files], data.prompt_key, checks)
            except InputError as error:
                problems += [f"{key}: {problem}" for problem in error.problems]
                continue
            sources |= {row["data_source"] for row in rows}
    if problems:
        raise InputError(problems)
    if multi_turn_settings(recipe) is not None:
        return  # the environment rewards the episodes: no data source needs a scorer
    scorers = build_scorers(reward.scorers, gsm8k_method=reward.gsm8k_method, format_score=reward.format_score,
                            score=reward.score)
    check_data_sources(sorted(sources), scorers)


def prepare_run_dir(recipe: Recipe) -> Path:
    """`<output_dir>/<name>`, created and proven writable with MIN_FREE_BYTES free; InputError naming the key."""
    output_dir = Path(recipe.trainer.output_dir).expanduser()
    run_dir = output_dir / recipe.name
    # `name` is a plain file name (the schema's pattern); resolve() guards against a symlinked escape too.
    if not run_dir.resolve().is_relative_to(output_dir.resolve()):
        raise InputError(f"name: the run directory must stay inside trainer.output_dir (got {recipe.name!r})")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-probe-"):
            pass
    except OSError as error:
        raise InputError(f"trainer.output_dir: cannot create or write {run_dir}: {error.strerror} "
                         f"(got {recipe.trainer.output_dir!r})") from None
    free = shutil.disk_usage(run_dir).free
    if free < MIN_FREE_BYTES:
        raise InputError(f"trainer.output_dir: only {free >> 20} MiB free on the disk of {run_dir}, a run needs at "
                         f"least {MIN_FREE_BYTES >> 20} MiB (got {recipe.trainer.output_dir!r})")
    return run_dir

