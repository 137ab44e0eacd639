"""`megarl submit`: check a recipe against the allocation asked for, freeze it, render its job script, sbatch it;
status, cancel.

Submitting writes into `<run dir>/slurm/`: the resolved recipe and a copy of the
megarl sources (`megarl.submit.freeze`), `megarl.sbatch` (the exact script Slurm
runs) and `job.json` (the job id), which `--status RUN_DIR` and `--cancel
RUN_DIR` read; the job adds `job-<id>.jsonl`, one line per start. Only the
standard library is imported at module level, so building the CLI parser stays
cheap.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SCRIPT_NAME = Path("slurm") / "megarl.sbatch"
RECORD_NAME = Path("slurm") / "job.json"
HEADLINE_METRICS = ("critic/score/mean", "val/score/mean", "actor/pg_loss", "response_length/mean",
                    "timing_s/step", "perf/throughput")
# The submitting interpreter's module search path: without it a job would import another megarl.
RECORDED_ENV = ("PYTHONPATH",)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {text})")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megarl.plan.command import add_device_arguments

    parser.add_argument("recipe", type=Path, nargs="?", help="YAML recipe file (omit with --status / --cancel)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one recipe value; the job runs the recipe resolved with these (repeatable)")
    parser.add_argument("--nodes", type=_positive, help="nodes to allocate (required to submit)")
    parser.add_argument("--gpus-per-node", type=_positive, help="GPUs per node (default: placement.gpus_per_node)")
    parser.add_argument("--partition", help="Slurm partition")
    parser.add_argument("--time", help="time limit, e.g. 2-00:00:00")
    parser.add_argument("--account", help="Slurm account to charge")
    parser.add_argument("--requeue", action="store_true",
                        help="after a preemption or a stop with a checkpoint (status 75) the job requeues itself and "
                        "resumes from that checkpoint; without it the job is never requeued")
    container = parser.add_mutually_exclusive_group()
    container.add_argument("--container-image", metavar="IMAGE",
                           help="run every step in this pyxis/enroot image (srun --container-image)")
    container.add_argument("--apptainer-image", metavar="IMAGE", help="run every step in this Apptainer image (.sif)")
    parser.add_argument("--sbatch-arg", dest="sbatch_args", action="append", default=[], metavar="OPTION",
                        help="one more sbatch option, e.g. --sbatch-arg=--qos=high (repeatable)")
    parser.add_argument("--env", dest="env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for every node, over the recipe's cluster.env (repeatable)")
    parser.add_argument("--python", help="interpreter the job runs megarl and Ray with (default: this one, "
                        f"{sys.executable}; python3 inside a container)")
    add_device_arguments(parser)
    parser.add_argument("--force", action="store_true",
                        help="submit even when `megarl plan` says the recipe does not fit the GPUs")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the job script (and the plan, on stderr); submit nothing")
    parser.add_argument("--status", type=Path, metavar="RUN_DIR", help="show the job state and last metrics of a run")
    parser.add_argument("--cancel", type=Path, metavar="RUN_DIR",
                        help="stop the job of a run: SIGTERM to its driver (which checkpoints), teardown, no requeue")


def run(args: argparse.Namespace) -> int:
    from megarl.errors import InputError

    modes = [flag for flag, given in (("RECIPE", args.recipe), ("--status", args.status), ("--cancel", args.cancel))
             if given is not None]
    if len(modes) != 1:
        raise InputError(f"megarl submit: give exactly one of RECIPE, --status RUN_DIR, --cancel RUN_DIR (got {modes})")
    if args.status is not None:
        print(status(args.status))
    elif args.cancel is not None:
        print(cancel(args.cancel))
    else:
        if args.nodes is None:
            raise InputError("--nodes: required to submit a recipe (got none)")
        submit(args)
    return 0


def _container(args: argparse.Namespace, recipe, *, run_dir: Path, workdir: Path):
    from megarl.submit.freeze import input_paths
    from megarl.submit.render import Container

    kind, image = ("pyxis", args.container_image) if args.container_image else ("apptainer", args.apptainer_image)
    if image is None:
        return None
    # The run dir (frozen code and recipe, logs, checkpoints), the working dir, every input directory (models,
    # tokenizers) and the directory of every input file (data).
    inputs = [path.parent if key.split("[")[0].endswith("_files") else path for key, path in input_paths(recipe)]
    mounts = [run_dir, workdir, *inputs]
    unique = []
    for path in (Path(os.path.abspath(path)) for path in mounts):
        if not any(path == kept or path.is_relative_to(kept) for kept in unique):
            unique = [kept for kept in unique if not kept.is_relative_to(path)] + [path]
    return Container(kind=kind, image=image, mounts=tuple(str(path) for path in unique))


def _recipe_and_spec(args: argparse.Namespace):
    from megarl.config import load_recipe
    from megarl.submit.fit import check_fit
    from megarl.submit.render import JobSpec, StopBudget, parse_env

    recipe = load_recipe(args.recipe, args.overrides)
    gpus_per_node = args.gpus_per_node or recipe.placement.gpus_per_node
    check_fit(recipe, nodes=args.nodes, gpus_per_node=gpus_per_node)
    workdir = Path.cwd()
    run_dir = (workdir / recipe.trainer.output_dir / recipe.name).resolve()
    container = _container(args, recipe, run_dir=run_dir, workdir=workdir)
    python = args.python or ("python3" if container is not None else sys.executable)
    spec = JobSpec(
        job_name=f"megarl-{recipe.name}",
        recipe=run_dir / "slurm" / "recipe.yaml",
        code_dir=run_dir / "slurm" / "code",
        run_dir=run_dir,
        workdir=workdir,
        nodes=args.nodes,
        gpus_per_node=gpus_per_node,
        device=recipe.placement.device,
        python=python,
        budget=StopBudget.for_timeout(recipe.trainer.checkpoint.preempt_timeout_s),
        requeue=args.requeue,
        container=container,
        partition=args.partition,
        time=args.time,
        account=args.account,
        sbatch_args=tuple(args.sbatch_args),
        env={**recipe.cluster.env, **parse_env(args.env)},
    )
    return recipe, spec


def check_visible_inputs(recipe) -> list[str]:
    """Check the inputs this node sees as the job will (InputError on a problem); lines naming the ones it
    does not see, which the job checks on its nodes when it starts."""
    from megarl.controller.preflight import check_inputs
    from megarl.errors import InputError
    from megarl.submit.freeze import input_paths

    unseen = [(key, path) for key, path in input_paths(recipe) if not path.exists()]
    unseen_keys = {key.split("[")[0] for key, _ in unseen}
    problems = [problem for problem in check_inputs(recipe)
                if problem.split(":")[0] not in unseen_keys]
    if problems:
        raise InputError(problems)
    return [f"{key}: {path} is not visible from this node; the job checks it on its nodes when it starts"
            for key, path in unseen]


def submit(args: argparse.Namespace) -> None:
    from megarl.submit import slurm
    from megarl.submit.freeze import freeze
    from megarl.submit.render import render_script

    recipe, spec = _recipe_and_spec(args)
    _check_plan(args, recipe)
    recorded = {name: os.environ[name] for name in RECORDED_ENV if os.environ.get(name)}
    script = render_script(spec, recorded_env=recorded)
    if args.dry_run:
        sys.stdout.write(script)
        return
    notes = check_visible_inputs(recipe)
    _refuse_active_job(spec.run_dir)
    freeze(recipe, spec.run_dir)
    script_path = spec.run_dir / SCRIPT_NAME
    spec.log_dir.mkdir(parents=True, exist_ok=True)  # Slurm opens the job log there before the script runs
    script_path.write_text(script)
    job_id = slurm.sbatch(script_path)
    record = {"job_id": job_id, "script": str(script_path), "log": str(spec.log_dir / f"slurm-{job_id}.out"),
              "recipe": str(args.recipe.resolve()), "overrides": list(args.overrides), "nodes": spec.nodes,
              "requeue": spec.requeue, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (spec.run_dir / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")
    for note in notes:
        print(f"note: {note}")
    print(f"submitted job {job_id} ({spec.nodes} node(s)): run dir {spec.run_dir}")
    print(f"  job log:   {record['log']}")
    print(f"  node logs: {spec.log_dir}/ray-*")
    print(f"  status:    megarl submit --status {spec.run_dir}")
    print(f"  cancel:    megarl submit --cancel {spec.run_dir}")
    print(f"  stopping:  the driver checkpoints within {spec.budget.driver_s} s of a SIGTERM; Slurm's time-limit "
          f"signal comes {spec.budget.signal_lead_s} s before the limit; a preemption needs the partition's "
          f"GraceTime >= {spec.budget.kill_driver_s + spec.budget.teardown_s} s to keep the checkpoint")


def _check_plan(args: argparse.Namespace, recipe) -> None:
    """`megarl plan` on the job's GPUs (--gpu, default h100-80gb): a dry run prints it on stderr; a recipe that
    does not fit is refused with the plan's reasons unless --force."""
    from megarl.errors import InputError
    from megarl.plan.command import device_from_args, preflight_plan

    plan, markdown = preflight_plan(recipe, gpu=device_from_args(args))
    if plan is None:
        return
    if args.dry_run:
        sys.stderr.write(markdown)
    if not plan.fits and not args.force:
        raise InputError([f"plan: {problem} (--force submits anyway)" for problem in plan.problems])


def _read_record(run_dir: Path) -> dict:
    from megarl.errors import InputError

    path = run_dir / RECORD_NAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{run_dir}: no job submitted by megarl submit ({path} not found)") from None
    except ValueError as error:
        raise InputError(f"{path}: not a job record: {error}") from None


def _refuse_active_job(run_dir: Path) -> None:
    from megarl.errors import InputError
    from megarl.submit import slurm

    if not (run_dir / RECORD_NAME).exists():
        return
    job_id = _read_record(run_dir)["job_id"]
    state = slurm.job_state(job_id)
    if state is not None and state.active:
        raise InputError(
            f"{run_dir}: job {job_id} of this run is still {state.state}; wait for it, "
            f"`megarl submit --cancel {run_dir}`, or set another name (got job {job_id})"
        )


def last_metrics_line(run_dir: Path) -> str | None:
    """The newest step of `metrics.jsonl` as one line of headline metrics; None before the first step."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    if not lines:
        return None
    record = json.loads(lines[-1])
    shown = [f"{key} {record[key]:.4g}" for key in HEADLINE_METRICS if isinstance(record.get(key), (int, float))]
    return f"step {record.get('step', '?')}: " + ("  ".join(shown) or "(no headline metrics)")


def job_starts(run_dir: Path, job_id: str) -> list[dict]:
    """The job's own record of its starts (`slurm/job-<id>.jsonl`, written by the job script), oldest first."""
    path = run_dir / "slurm" / f"job-{job_id}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    starts = []
    for line in lines:
        try:
            starts.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a node that died mid-write
    return starts


def _error_line(log: Path) -> str | None:
    """The last line of the job log that reads like the reason it failed (an error, a preflight problem)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    wanted = [line.strip() for line in lines if "error" in line.lower() or line.startswith("preflight: node")]
    return wanted[-1][:300] if wanted else None


def outcome(run_dir: Path, record: dict, state) -> str:
    """What became of an ended job: finished, preempted and resumable from step N, or failed and why."""
    from megarl.controller.checkpointing import complete_steps
    from megarl.controller.preemption import EXIT_PREEMPTED

    starts = job_starts(run_dir, record["job_id"])
    last = starts[-1] if starts else None
    if state is None:
        slurm_state = "unknown to Slurm"
    else:
        slurm_state = f"Slurm state {state.state}" + (f", exit code {state.exit_code}" if state.exit_code else "")
    if last is not None and last.get("status") == 0:
        return f"finished ({slurm_state})"
    checkpoints = complete_steps(run_dir)
    resumable = f"resumable from step {checkpoints[-1].step}" if checkpoints else "no checkpoint yet"
    preempted = state is not None and state.state in ("PREEMPTED", "REQUEUED", "TIMEOUT")
    if (last is not None and last.get("status") == EXIT_PREEMPTED) or preempted:
        return f"preempted, {resumable} ({slurm_state}); resume: megarl submit {run_dir / 'slurm' / 'recipe.yaml'} " \
               f"--nodes {record.get('nodes', '?')}"
    if last is not None:
        reason = _error_line(Path(record["log"]))
        return f"failed: status {last.get('status')}" + (f": {reason}" if reason else "") + f" ({slurm_state}, {resumable})"
    return f"failed: {slurm_state} before the job script recorded an outcome ({resumable})"


def status(run_dir: Path) -> str:
    from megarl.submit import slurm

    record = _read_record(run_dir)
    job_id = record["job_id"]
    state = slurm.job_state(job_id)
    starts = job_starts(run_dir, job_id)
    if state is not None and state.active:
        described = state.describe() + (f", {len(starts)} earlier start(s)" if starts else "")
    else:
        described = outcome(run_dir, record, state)
    lines = [f"job {job_id}: {described}", f"log: {record['log']}"]
    metrics = last_metrics_line(run_dir)
    lines.append(f"last metrics: {metrics}" if metrics else "last metrics: none yet")
    return "\n".join(lines)


def cancel(run_dir: Path) -> str:
    from megarl.submit import slurm

    job_id = _read_record(run_dir)["job_id"]
    state = slurm.job_state(job_id)
    if state is None or not state.active:
        return f"job {job_id} is not queued or running ({state.describe() if state else 'unknown to Slurm'})"
    # The job script reads this before it would requeue itself: a cancelled job stays stopped.
    (run_dir / "slurm" / f"cancel-{job_id}").write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
    return slurm.cancel(job_id, state)
