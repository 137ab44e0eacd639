"""The `megarl plan` command line, and `preflight_plan`, the check `megarl submit` runs before it submits.

Only the standard library is imported at module level, so building the CLI parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_DOES_NOT_FIT = 1


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {text})")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (got {text})")
    return value


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """--gpu and the custom-device triple (shared with `megarl submit`)."""
    parser.add_argument("--gpu", default=None, help="device by name: h100-80gb (default), h100-pcie, h200, "
                        "a100-80gb, a100-40gb, b200, l40s")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, help="custom device: memory (GiB)")
    parser.add_argument("--gpu-tflops", type=float, default=None, help="custom device: dense 16-bit peak (TFLOP/s)")
    parser.add_argument("--gpu-bw-gbs", type=float, default=None, help="custom device: memory bandwidth (GB/s)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="YAML recipe file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one recipe value (repeatable), as for train")
    add_device_arguments(parser)
    parser.add_argument("--nodes", type=_positive_int, default=None,
                        help="plan for this many nodes (sets placement.nodes of a colocated recipe)")
    parser.add_argument("--gpus-per-node", type=_positive_int, default=None,
                        help="plan for this many GPUs per node (sets placement.gpus_per_node of a colocated recipe)")
    parser.add_argument("--mfu", type=_fraction, default=0.35, help="model FLOPs utilisation assumed for the "
                        "forward and backward passes (default 0.35)")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                        help="activation recomputation to assume (megarl's engines run none)")
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="what if the optimizer state were split over the DP ranks (megarl's engines do not)")
    parser.add_argument("--json", action="store_true", help="print the plan as a benchmark-format JSON report")


def device_from_args(args: argparse.Namespace):
    from megarl.plan.gpus import gpu_spec

    return gpu_spec(args.gpu, memory_gb=args.gpu_memory_gb, tflops=args.gpu_tflops, bandwidth_gbs=args.gpu_bw_gbs)


def placement_overrides(nodes: int | None, gpus_per_node: int | None) -> list[str]:
    return ([f"placement.nodes={nodes}"] if nodes else []) + \
        ([f"placement.gpus_per_node={gpus_per_node}"] if gpus_per_node else [])


def run(args: argparse.Namespace) -> int:
    from megarl.config import load_recipe
    from megarl.plan.plan import Options, plan_recipe
    from megarl.plan.report import plan_report, verdict_line

    options = Options(gpu=device_from_args(args), mfu=args.mfu, recompute=args.recompute,
                      distributed_optimizer=args.distributed_optimizer)
    recipe = load_recipe(args.recipe, args.overrides + placement_overrides(args.nodes, args.gpus_per_node))
    plan = plan_recipe(recipe, options)
    report = plan_report(plan)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        sys.stdout.write(report.to_markdown(with_settings=False))
        print(verdict_line(plan))
    return 0 if plan.fits else EXIT_DOES_NOT_FIT


def preflight_plan(recipe, *, gpu) -> tuple[object, str]:
    """`megarl submit`'s check: (the plan, its Markdown). Only GPU recipes are planned (None, "") otherwise."""
    if recipe.placement.device != "cuda":
        return None, ""
    from megarl.plan.plan import Options, plan_recipe
    from megarl.plan.report import plan_report

    plan = plan_recipe(recipe, Options(gpu=gpu))
    return plan, plan_report(plan).to_markdown(with_settings=False)
