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

import shutil
import tempfile
from pathlib import Path

from megarl.config import Recipe
from megarl.config.settings import multi_turn_settings
from megarl.data import guessing, random_digits, synthetic
from megarl.data.dataset import read_prompt_rows
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import InputError
from megarl.rewards.registry import build_scorers, check_data_sources

# A run writes initial weights, data, logs and checkpoints: below this much free space it will not get far.
MIN_FREE_BYTES = 256 << 20
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
SYNTHETIC_SOURCES = {"addition": synthetic.DATA_SOURCE, "random_digits": random_digits.DATA_SOURCE,
                     "guessing": guessing.DATA_SOURCE}


def _checkpoint_problems(key: str, path: str | None) -> list[str]:
    """A model dir must hold config.json and safetensors weights."""
    if path is None:
        return []
    where = Path(path).expanduser()
    if not where.is_dir():
        return [f"{key}: no such directory (got {path!r})"]
    problems = []
    if not (where / "config.json").is_file():
        problems.append(f"{key}: {where / 'config.json'} not found (got {path!r})")
    if not any((where / name).is_file() for name in WEIGHT_FILES):
        problems.append(f"{key}: {where} holds neither {' nor '.join(WEIGHT_FILES)} (got {path!r})")
    return problems


def check_checkpoints(recipe: Recipe) -> list[str]:
    """The model, critic, reward-model and judge checkpoints `megarl train` will read."""
    problems = _checkpoint_problems("model.path", recipe.model.path)
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
        load_tokenizer(recipe.model.tokenizer)
    except InputError as error:
        problems += [f"model.tokenizer: {problem}" for problem in error.problems]
    try:
        _check_data(recipe)
    except InputError as error:
        problems += error.problems
    return InputError(problems).problems  # one line each, whatever the paths hold


def _check_data(recipe: Recipe) -> None:
    data, reward = recipe.data, recipe.reward
    sources: set[str] = {SYNTHETIC_SOURCES[data.synthetic.task]} if data.synthetic is not None else set()
    problems = []
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files)):
        try:
            rows = read_prompt_rows([Path(file).expanduser() for file in files], data.prompt_key) if files else []
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

