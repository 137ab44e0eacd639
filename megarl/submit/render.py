"""Render the sbatch script of a megarl job from the templates in `slurm/`.

The rendered script is self-contained: the `#SBATCH` directives, the recorded
interpreter and environment, and the Ray bring-up library are written into it,
so the job runs exactly what was submitted even if the checkout changes while
it waits in the queue, and the copy in the run directory is the full record.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from megarl.errors import InputError

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "slurm"
JOB_TEMPLATE = "megarl.sbatch"
RAY_LIBRARY = "ray-cluster.sh"
# Slurm sends SIGTERM to the batch shell this long before the time limit; the driver gets
# MEGARL_TERM_GRACE_S of it to checkpoint, the rest is for stopping Ray.
SIGNAL_LEAD_S = 300
TERM_GRACE_S = 240
REGISTER_TIMEOUT_S = 300
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
_UNSAFE_PATH = re.compile(r"[\s%]")


@dataclass(frozen=True)
class JobSpec:
    """Everything a job script states: resources, the run, the interpreter and the environment."""

    job_name: str
    recipe: Path
    overrides: tuple[str, ...]
    run_dir: Path
    workdir: Path
    nodes: int
    gpus_per_node: int
    device: str
    python: str
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    sbatch_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"


def parse_env(pairs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`KEY=VALUE` texts (from `--env`) as a dict; InputError naming each malformed one."""
    env, problems = {}, []
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            problems.append(f"--env: expected KEY=VALUE with a shell variable name as KEY (got {pair!r})")
        else:
            env[key] = value
    if problems:
        raise InputError(problems)
    return env


def export_lines(env: dict[str, str]) -> list[str]:
    return [f"export {key}={shlex.quote(value)}" for key, value in env.items()]


def _directives(spec: JobSpec) -> list[str]:
    lines = [
        f"--job-name={spec.job_name}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",
        "--exclusive",
        "--mem=0",
        f"--output={spec.log_dir}/slurm-%j.out",
        f"--chdir={spec.workdir}",
        f"--signal=B:TERM@{SIGNAL_LEAD_S}",
    ]
    if spec.device == "cuda":
        lines.append(f"--gpus-per-node={spec.gpus_per_node}")
    for flag, value in (("partition", spec.partition), ("time", spec.time), ("account", spec.account)):
        if value is not None:
            lines.append(f"--{flag}={value}")
    lines += spec.sbatch_args  # last, so a user's directive overrides a default above
    return [f"#SBATCH {line}" for line in lines]


def _environment(spec: JobSpec, recorded: dict[str, str]) -> list[str]:
    run = {
        "MEGARL_PYTHON": spec.python,
        "MEGARL_RECIPE": str(spec.recipe),
        "MEGARL_RUN_DIR": str(spec.run_dir),
        "MEGARL_DEVICE": spec.device,
        "MEGARL_NODES": str(spec.nodes),
        "MEGARL_GPUS_PER_NODE": str(spec.gpus_per_node),
        "MEGARL_TERM_GRACE_S": str(TERM_GRACE_S),
        "MEGARL_REGISTER_TIMEOUT_S": str(REGISTER_TIMEOUT_S),
    }
    train_args = " ".join(f"--set {shlex.quote(override)}" for override in spec.overrides)
    lines = ["# interpreter and environment of the submitting shell", *export_lines(recorded)]
    lines += ["# the run", *export_lines(run), f"MEGARL_TRAIN_ARGS=({train_args})"]
    if spec.env:
        lines += ["# cluster.env of the recipe and --env of megarl submit", *export_lines(spec.env)]
    return lines


def _check_paths(spec: JobSpec) -> None:
    # #SBATCH lines are not shell-parsed: a space ends the value and % starts a Slurm filename pattern.
    paths = (("the run directory (trainer.output_dir/name)", spec.run_dir), ("the working directory", spec.workdir))
    for what, path in paths:
        if _UNSAFE_PATH.search(str(path)):
            raise InputError(f"{what}: a path with whitespace or '%' cannot go into #SBATCH lines (got {str(path)!r})")


def _check_sbatch_args(args: tuple[str, ...]) -> None:
    bad = [arg for arg in args if not arg.startswith("-") or "\n" in arg]
    if bad:
        raise InputError(f"--sbatch-arg: each value must be one sbatch option such as --qos=high (got {bad!r})")


def _read_template(name: str) -> str:
    path = TEMPLATE_DIR / name
    if not path.is_file():
        raise InputError(
            f"{path}: megarl submit renders its job script from the repository's slurm/ directory, "
            "which this installation lacks; install megarl from a source checkout (pip install -e .)"
        )
    return path.read_text()


def render_script(spec: JobSpec, *, recorded_env: dict[str, str]) -> str:
    """The job script for `spec`; `recorded_env` is the submitting environment to reproduce (e.g. PYTHONPATH)."""
    _check_paths(spec)
    _check_sbatch_args(spec.sbatch_args)
    values = {
        "SBATCH_DIRECTIVES": "\n".join(_directives(spec)),
        "JOB_ENVIRONMENT": "\n".join(_environment(spec, recorded_env)),
        "RAY_CLUSTER_SH": _read_template(RAY_LIBRARY).rstrip("\n"),
    }
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], _read_template(JOB_TEMPLATE))
