"""`megarl submit`: check a recipe against the allocation asked for, render its job script, sbatch it; status, cancel.

Submitting writes `<run dir>/slurm/megarl.sbatch` (the exact script Slurm runs)
and `<run dir>/slurm/job.json` (the job id), which `--status RUN_DIR` and
`--cancel RUN_DIR` read. Only the standard library is imported at module level,
so building the CLI parser stays cheap.
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
    parser.add_argument("recipe", type=Path, nargs="?", help="YAML recipe file (omit with --status / --cancel)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one recipe value, passed on to `megarl train` in the job (repeatable)")
    parser.add_argument("--nodes", type=_positive, help="nodes to allocate (required to submit)")
    parser.add_argument("--gpus-per-node", type=_positive, help="GPUs per node (default: placement.gpus_per_node)")
    parser.add_argument("--partition", help="Slurm partition")
    parser.add_argument("--time", help="time limit, e.g. 2-00:00:00")
    parser.add_argument("--account", help="Slurm account to charge")
    parser.add_argument("--sbatch-arg", dest="sbatch_args", action="append", default=[], metavar="OPTION",
                        help="one more sbatch option, e.g. --sbatch-arg=--qos=high (repeatable)")
    parser.add_argument("--env", dest="env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for every node, over the recipe's cluster.env (repeatable)")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter the job runs megarl and Ray with (default: this one, %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the job script; submit nothing")
    parser.add_argument("--status", type=Path, metavar="RUN_DIR", help="show the job state and last metrics of a run")
    parser.add_argument("--cancel", type=Path, metavar="RUN_DIR",
                        help="stop the job of a run: SIGTERM to its driver, then teardown")


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


def _job_spec(args: argparse.Namespace):
    from megarl.config import load_recipe
    from megarl.submit.fit import check_fit
    from megarl.submit.render import JobSpec, parse_env

    recipe = load_recipe(args.recipe, args.overrides)
    gpus_per_node = args.gpus_per_node or recipe.placement.gpus_per_node
    check_fit(recipe, nodes=args.nodes, gpus_per_node=gpus_per_node)
    workdir = Path.cwd()
    return JobSpec(
        job_name=f"megarl-{recipe.name}",
        recipe=args.recipe.resolve(),
        overrides=tuple(args.overrides),
        run_dir=(workdir / recipe.trainer.output_dir / recipe.name).resolve(),
        workdir=workdir,
        nodes=args.nodes,
        gpus_per_node=gpus_per_node,
        device=recipe.placement.device,
        python=args.python,
        partition=args.partition,
        time=args.time,
        account=args.account,
        sbatch_args=tuple(args.sbatch_args),
        env={**recipe.cluster.env, **parse_env(args.env)},
    )


def submit(args: argparse.Namespace) -> None:
    from megarl.submit import slurm
    from megarl.submit.render import render_script

    spec = _job_spec(args)
    recorded = {name: os.environ[name] for name in RECORDED_ENV if os.environ.get(name)}
    script = render_script(spec, recorded_env=recorded)
    if args.dry_run:
        sys.stdout.write(script)
        return
    _refuse_active_job(spec.run_dir)
    script_path = spec.run_dir / SCRIPT_NAME
    script_path.parent.mkdir(parents=True, exist_ok=True)
    spec.log_dir.mkdir(parents=True, exist_ok=True)  # Slurm opens the job log there before the script runs
    script_path.write_text(script)
    job_id = slurm.sbatch(script_path)
    record = {"job_id": job_id, "script": str(script_path), "log": str(spec.log_dir / f"slurm-{job_id}.out"),
              "nodes": spec.nodes, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (spec.run_dir / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")
    print(f"submitted job {job_id} ({spec.nodes} node(s)): run dir {spec.run_dir}")
    print(f"  job log:   {record['log']}")
    print(f"  node logs: {spec.log_dir}/ray-*")
    print(f"  status:    megarl submit --status {spec.run_dir}")
    print(f"  cancel:    megarl submit --cancel {spec.run_dir}")


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


def status(run_dir: Path) -> str:
    from megarl.submit import slurm

    record = _read_record(run_dir)
    job_id = record["job_id"]
    state = slurm.job_state(job_id)
    described = state.describe() if state is not None else "finished (no longer known to Slurm)"
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
    return slurm.cancel(job_id, state)
