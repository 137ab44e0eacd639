"""Render the sbatch script of a megarl job from the templates in `slurm/`.

The rendered script is self-contained: the `#SBATCH` directives, the recorded
interpreter and environment, the container, the stop budget and the Ray
bring-up library are written into it, and it runs the recipe and the megarl
sources frozen into the run directory at submit (`megarl.submit.freeze`), so
the job runs exactly what was submitted even if the checkout or the recipe
changes while it waits in the queue.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from megarl.errors import InputError

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "slurm"
JOB_TEMPLATE = "megarl.sbatch"
RAY_LIBRARY = "ray-cluster.sh"
REGISTER_TIMEOUT_S = 300
CONTAINER_KINDS = ("pyxis", "apptainer")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
_UNSAFE_PATH = re.compile(r"[\s%]")
_UNSAFE_MOUNT = re.compile(r"[\s,:%]")


@dataclass(frozen=True)
class StopBudget:
    """Every deadline of a stop, from the one recipe setting `trainer.checkpoint.preempt_timeout_s`.

    The driver checkpoints and exits within `driver_s`; past it, it stops without a
    checkpoint within the controller's hard-exit bound, so the batch script SIGKILLs it
    only after both (`kill_driver_s`). Stopping the Ray nodes takes at most
    `teardown_s`. Slurm's time-limit warning comes `signal_lead_s` before the limit,
    enough for all of it; a partition's preemption GraceTime should be as long.
    """

    driver_s: int
    hard_exit_s: int
    teardown_s: int = 60
    margin_s: int = 15

    @classmethod
    def for_timeout(cls, preempt_timeout_s: float) -> StopBudget:
        from megarl.controller.preemption import HARD_EXIT_S

        return cls(driver_s=math.ceil(preempt_timeout_s), hard_exit_s=math.ceil(HARD_EXIT_S))

    @property
    def kill_driver_s(self) -> int:
        return self.driver_s + self.hard_exit_s + self.margin_s

    @property
    def signal_lead_s(self) -> int:
        return self.kill_driver_s + self.teardown_s + self.margin_s


@dataclass(frozen=True)
class Container:
    """The image every step of the job runs in: pyxis/enroot (`srun --container-image`) or Apptainer."""

    kind: str
    image: str
    mounts: tuple[str, ...]  # host paths, mounted at the same path inside

    def srun_options(self, job_name: str) -> list[str]:
        if self.kind != "pyxis":
            return []
        # A named container is imported once per node and reused by every later step of the job.
        return [f"--container-image={self.image}", f"--container-name={job_name}",
                f"--container-mounts={','.join(f'{path}:{path}' for path in self.mounts)}", "--no-container-mount-home"]

    def exec_prefix(self) -> str:
        if self.kind != "apptainer":
            return ""
        return f"apptainer exec --nv --bind {','.join(self.mounts)} {self.image}"


@dataclass(frozen=True)
class JobSpec:
    """Everything a job script states: resources, the run, the interpreter, the container and the environment."""

    job_name: str
    recipe: Path  # the resolved recipe frozen into the run dir
    code_dir: Path  # the megarl sources frozen into the run dir (put first on PYTHONPATH)
    run_dir: Path
    workdir: Path
    nodes: int
    gpus_per_node: int
    device: str
    python: str
    budget: StopBudget
    requeue: bool = False
    container: Container | None = None
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
        "--open-mode=append",  # a requeued job keeps its id: every start appends to the same log
        f"--chdir={spec.workdir}",
        f"--signal=B:TERM@{spec.budget.signal_lead_s}",
        "--requeue" if spec.requeue else "--no-requeue",
    ]
    if spec.device == "cuda":
        lines.append(f"--gpus-per-node={spec.gpus_per_node}")
    for flag, value in (("partition", spec.partition), ("time", spec.time), ("account", spec.account)):
        if value is not None:
            lines.append(f"--{flag}={value}")
    lines += spec.sbatch_args  # last, so a user's directive overrides a default above
    return [f"#SBATCH {line}" for line in lines]


def _environment(spec: JobSpec, recorded: dict[str, str]) -> list[str]:
    recorded = dict(recorded)
    # The frozen sources come first: the job imports the megarl that was submitted, not the checkout's.
    recorded["PYTHONPATH"] = ":".join(filter(None, (str(spec.code_dir), recorded.get("PYTHONPATH"))))
    container = spec.container
    run = {
        "MEGARL_PYTHON": spec.python,
        "MEGARL_RECIPE": str(spec.recipe),
        "MEGARL_RUN_DIR": str(spec.run_dir),
        "MEGARL_DEVICE": spec.device,
        "MEGARL_NODES": str(spec.nodes),
        "MEGARL_GPUS_PER_NODE": str(spec.gpus_per_node),
        "MEGARL_TERM_GRACE_S": str(spec.budget.kill_driver_s),
        "MEGARL_TEARDOWN_S": str(spec.budget.teardown_s),
        "MEGARL_REGISTER_TIMEOUT_S": str(REGISTER_TIMEOUT_S),
        "MEGARL_REQUEUE": "1" if spec.requeue else "0",
        "MEGARL_CONTAINER": container.kind if container else "none",
        "MEGARL_CONTAINER_EXEC": container.exec_prefix() if container else "",
    }
    srun_container = " ".join(shlex.quote(option) for option in container.srun_options(spec.job_name)) \
        if container else ""
    lines = ["# interpreter and environment of the submitting shell", *export_lines(recorded)]
    lines += ["# the run", *export_lines(run), f"MEGARL_SRUN_CONTAINER=({srun_container})"]
    if spec.env:
        lines += ["# cluster.env of the recipe and --env of megarl submit", *export_lines(spec.env)]
    return lines


def _check_paths(spec: JobSpec) -> None:
    # #SBATCH lines are not shell-parsed: a space ends the value and % starts a Slurm filename pattern.
    paths = (("the run directory (trainer.output_dir/name)", spec.run_dir), ("the working directory", spec.workdir))
    for what, path in paths:
        if _UNSAFE_PATH.search(str(path)):
            raise InputError(f"{what}: a path with whitespace or '%' cannot go into #SBATCH lines (got {str(path)!r})")
    if spec.container is not None:
        bad = [path for path in spec.container.mounts if _UNSAFE_MOUNT.search(path)]
        if bad:
            raise InputError(f"--container-image: a path mounted into the container may not hold whitespace, ',', "
                             f"':' or '%' (got {bad!r})")


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
