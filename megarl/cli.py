"""The `megarl` command: one entry point, one sub-command per verb.

Every verb imports its implementation lazily so `megarl schema` does not pay
for torch or ray. Bad input (`megarl.errors.InputError`) prints one line per
problem on stderr and exits with status 2, never a traceback. `megarl train`
stopped by SIGTERM/SIGINT after writing its checkpoint exits with status 75
(`megarl.controller.preemption.EXIT_PREEMPTED`), as does a stopped `megarl bench`;
stopped at once by a second signal, with 128 + that signal, always. A role's
worker killed for memory (`megarl.oom.RoleOutOfMemory`, anywhere in the failure's
chain) is one line on stderr naming the role, the memory and the settings to
change, and status 1, the status of any failed run (`--verbose` adds the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from megarl.errors import InputError, storage_problem
from megarl.oom import find_role_oom
from megarl.quiet import VERBOSE_ENV, quiet_third_parties

# A run's complete step directory holds this file (`controller.checkpointing.MARKER`; not imported: it needs Ray).
STEP_MARKER = "COMPLETE.json"

EXIT_FAILED = 1  # the run failed (a role killed for memory): Python's own status for an uncaught error
EXIT_BAD_INPUT = 2


def _add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=Path, help="YAML recipe file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one recipe value, e.g. --set actor.optim.lr=1e-5 (repeatable)",
    )


def _cmd_validate(args: argparse.Namespace) -> int:
    from megarl.config import dump_recipe, load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    if not args.offline:
        from megarl.controller.preflight import check_inputs

        problems = check_inputs(recipe)
        if problems:
            raise InputError(problems)
    sys.stdout.write(dump_recipe(recipe))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from megarl.config import load_recipe

    overrides = args.overrides + (["trainer.checkpoint.resume=never"] if args.no_resume else [])
    recipe = load_recipe(args.recipe, overrides)
    from megarl.controller.preemption import EXIT_PREEMPTED, Preempted
    from megarl.controller.run import train

    try:
        run_dir = train(recipe, ray_address=args.ray_address)
    except Preempted as stopped:
        print(f"megarl: {stopped}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    print(f"run finished: {run_dir}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.compare:
        if args.recipe is not None:
            raise InputError(f"bench: give a recipe to run or --compare REPORT..., not both (got {args.recipe})")
        from megarl.bench.compare import write_comparison

        markdown, path = write_comparison(args.compare, args.out)
        print(markdown, end="")
        print(f"wrote {path}")
        return 0
    if args.recipe is None:
        raise InputError("bench: give a recipe to run, or --compare REPORT.json REPORT.json ...")
    from megarl.bench.run import run_bench
    from megarl.controller.preemption import EXIT_PREEMPTED, Preempted

    try:
        report = run_bench(args.recipe, args.overrides, steps=args.steps, warmup=args.warmup,
                           synthetic=args.synthetic, out=args.out, peak_tflops=args.peak_tflops,
                           ray_address=args.ray_address)
    except Preempted:
        print("megarl: bench stopped by a signal; no report written", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    print(report.to_markdown(with_settings=False), end="")
    for suffix in ("json", "md"):
        print(f"wrote {args.out / f'{report.name}.{suffix}'}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from megarl.tracking.plots import plot_runs

    out = plot_runs([args.run_dir, *args.compare], out=args.out)
    print(f"plot written: {out}")
    return 0


def _cmd_train_rm(args: argparse.Namespace) -> int:
    from megarl.config import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    from megarl.commands.rm_training import train_reward_model

    result = train_reward_model(recipe, ray_address=args.ray_address)
    print(f"reward model written: {result.path} (validation accuracy {result.val_accuracy:.3f} after {result.steps} "
          "steps)")
    return 0


def _cmd_warmup(args: argparse.Namespace) -> int:
    from megarl.config import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    from megarl.commands.warmup import warm_up

    out = warm_up(recipe, args.hf, ray_address=args.ray_address)
    print(f"warmed-up policy written: {out} (start runs from it with --set model.path={out} "
          "--set sft_warmup.steps=0)")
    return 0


def _role_checkpoint(path: Path, role: str) -> Path:
    """The checkpoint to export: `path` itself, or its `role/` when `path` is a run's step directory
    (`checkpoints/step_<N>`, one checkpoint per role inside)."""
    if not (path / STEP_MARKER).is_file():
        return path
    if not (path / role).is_dir():
        roles = sorted(child.name for child in path.iterdir() if child.is_dir())
        raise InputError(f"--role: {path} holds no checkpoint of role {role!r}; it holds {', '.join(roles) or 'none'}")
    return path / role


def _cmd_export(args: argparse.Namespace) -> int:
    args.checkpoint = _role_checkpoint(args.checkpoint.expanduser(), args.role)
    if args.lora is not None:
        from megarl.engines.lora_export import export_peft

        print(f"PEFT adapter written: {export_peft(args.checkpoint, args.lora)}")
    elif args.merge is not None:
        from megarl.engines.lora_export import export_merged

        print(f"HF checkpoint with the LoRA adapters merged written: {export_merged(args.checkpoint, args.merge)}")
    else:
        from megarl.engines.export import export_checkpoint

        print(f"HF checkpoint written: {export_checkpoint(args.checkpoint, args.hf)}")
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    if args.markdown:
        from megarl.config.reference import recipe_reference

        sys.stdout.write(recipe_reference())
        return 0
    from megarl.config import recipe_json_schema

    print(json.dumps(recipe_json_schema(), indent=2))
    return 0


def _cmd_preprocess(args: argparse.Namespace) -> int:
    from megarl.data.preprocess import preprocess

    counts = preprocess(args.dataset, input_path=args.input, output_dir=args.output, seed=args.seed)
    for split, rows in counts.items():
        print(f"{args.output / (split + '.parquet')}: {rows} rows")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from megarl.plan.command import run

    return run(args)


def _cmd_submit(args: argparse.Namespace) -> int:
    from megarl.submit.command import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="also show the third-party warnings and progress "
                        "bars megarl hides by default (megarl.quiet)")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    validate = verbs.add_parser("validate", help="resolve and check a recipe and the files it names, print it")
    _add_recipe_args(validate)
    validate.add_argument("--offline", action="store_true",
                          help="check the recipe alone, not the files it names (a cluster recipe on a laptop)")
    validate.set_defaults(run=_cmd_validate)

    train = verbs.add_parser("train", help="run a recipe: RL post-training end to end")
    _add_recipe_args(train)
    train.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one in-process")
    train.add_argument("--no-resume", action="store_true",
                       help="start over even if the run dir holds a checkpoint (the old run dir is moved aside)")
    train.set_defaults(run=_cmd_train)

    bench = verbs.add_parser("bench", help="throughput benchmark: W warm-up + K measured steps of a recipe, a "
                                           "JSON + Markdown report; or --compare reports side by side")
    bench.add_argument("recipe", type=Path, nargs="?", default=None, help="YAML recipe file")
    bench.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one recipe value (repeatable), as for train")
    bench.add_argument("--steps", type=int, default=5, metavar="K", help="measured steps (default 5)")
    bench.add_argument("--warmup", type=int, default=2, metavar="W", help="warm-up steps before them (default 2)")
    bench.add_argument("--synthetic", action="store_true",
                       help="comparable runs: random prompts filling data.max_prompt_length, every response "
                            "max_response_length tokens (ignore_eos)")
    bench.add_argument("--out", type=Path, default=Path("bench"),
                       help="directory for the report (bench-<name>.json/.md, or compare.md) and the run "
                            "(default: bench)")
    bench.add_argument("--peak-tflops", type=float, default=None,
                       help="device peak for MFU, e.g. a datasheet's (default: measured with a matmul in the run)")
    bench.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one in-process")
    bench.add_argument("--compare", type=Path, nargs="+", default=None, metavar="REPORT",
                       help="compare bench reports (JSON) side by side, as ratios to the first")
    bench.set_defaults(run=_cmd_bench)

    plot = verbs.add_parser("plot", help="draw a run's metrics (score, KL, entropy, lengths, validation, timings) "
                                         "as one PNG")
    plot.add_argument("run_dir", type=Path, help="a run directory (runs/<name>), finished or still running")
    plot.add_argument("--out", type=Path, default=None, help="PNG to write (default: <run_dir>/plots/metrics.png)")
    plot.add_argument("--compare", type=Path, nargs="+", default=[], metavar="RUN_DIR",
                      help="other run directories drawn in the same panels")
    plot.set_defaults(run=_cmd_plot)

    train_rm = verbs.add_parser(
        "train-rm", help="fit the recipe's reward model to preference pairs (Bradley-Terry), write it as HF"
    )
    _add_recipe_args(train_rm)
    train_rm.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    train_rm.set_defaults(run=_cmd_train_rm)

    warmup = verbs.add_parser(
        "warmup", help="run only the recipe's supervised warm-up and write the warmed policy as HF (runs then "
        "start from it: model.path, sft_warmup.steps=0)"
    )
    _add_recipe_args(warmup)
    warmup.add_argument("--hf", type=Path, required=True, help="output directory for the HF checkpoint (new)")
    warmup.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    warmup.set_defaults(run=_cmd_warmup)

    export = verbs.add_parser("export", help="write an HF checkpoint (safetensors + config + tokenizer) from a megarl "
                              "checkpoint, or a LoRA checkpoint's PEFT adapter")
    export.add_argument("checkpoint", type=Path, help="a checkpoint dir saved by megarl (any TP/PP/EP layout), or "
                        "a run's step dir (checkpoints/step_<N>): then its --role")
    export.add_argument("--role", default="actor", help="the role to export from a step dir (default: actor; a "
                        "reward model's own checkpoint is its reward_model.path)")
    output = export.add_mutually_exclusive_group(required=True)
    output.add_argument("--hf", type=Path, help="output directory for the HF checkpoint")
    output.add_argument("--lora", type=Path, help="a LoRA checkpoint's adapters as a PEFT adapter dir "
                        "(adapter_config.json + adapter_model.safetensors)")
    output.add_argument("--merge", type=Path, help="a LoRA checkpoint's adapters merged into its base: an HF "
                        "checkpoint dir")
    export.set_defaults(run=_cmd_export)

    schema = verbs.add_parser("schema", help="print the recipe JSON Schema")
    schema.add_argument("--markdown", action="store_true",
                        help="print it as the Markdown recipe reference instead (docs/recipe.md)")
    schema.set_defaults(run=_cmd_schema)

    preprocess = verbs.add_parser("preprocess", help="turn local GSM8K/MATH files into train/test parquet")
    preprocess.add_argument("dataset", choices=["gsm8k", "math", "arithmetic"])
    preprocess.add_argument(
        "--input", type=Path, default=None, help="local jsonl/parquet file or directory (not used by arithmetic)"
    )
    preprocess.add_argument("--output", type=Path, required=True, help="directory for train.parquet/test.parquet")
    preprocess.add_argument("--seed", type=int, default=0, help="seed for generated (arithmetic) data")
    preprocess.set_defaults(run=_cmd_preprocess)

    from megarl.plan.command import add_arguments as add_plan_arguments

    plan = verbs.add_parser("plan", help="will a recipe fit, and how fast will it run: memory per GPU of every role, "
                            "the KV cache, phase peaks, step times and a verdict, from the model's config.json alone "
                            "(exit 1 when it does not fit)")
    add_plan_arguments(plan)
    plan.set_defaults(run=_cmd_plan)

    from megarl.submit.command import add_arguments as add_submit_arguments

    submit = verbs.add_parser("submit", help="run a recipe as a Slurm job (Ray across the nodes)")
    add_submit_arguments(submit)
    submit.set_defaults(run=_cmd_submit)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"
    quiet_third_parties()
    try:
        return args.run(args)
    except BaseException as error:
        from megarl.controller.preemption import stop_status

        # A second signal stops with 128 + the signal, also when tearing down raised something else on the way.
        status = stop_status(error)
        if status is not None:
            if not isinstance(error, SystemExit):
                print(f"megarl: stopped at once ({type(error).__name__} while stopping: {error})", file=sys.stderr)
            return status
        out_of_memory = find_role_oom(error)
        if out_of_memory is not None:
            if args.verbose:
                traceback.print_exception(error)
            print(f"error: {out_of_memory}", file=sys.stderr)
            return EXIT_FAILED
        if isinstance(error, InputError):
            problems = error.problems
        elif isinstance(error, OSError) and storage_problem(error) is not None:
            # A full or read-only disk is the machine's state, not a bug: say which file, no traceback.
            problems = [storage_problem(error)]
        else:
            raise
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    raise SystemExit(main())
