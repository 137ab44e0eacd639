"""Benchmark: `megarl plan`'s phase times against what `megarl bench` measured, on the bench's own machine figures.

For each bench report given (a JSON report of `megarl bench`, e.g.
`results/bench-quickstart-grpo-cpu.json`) the recipe it ran (its resolved recipe,
from the report's settings) is planned on a custom device made of the figures the
same run measured: the matmul peak behind its MFU table (one CPU thread), the
memcpy rate behind its weight-sync bound, and the machine's memory. The plan's
phase estimates are printed beside the measured medians, with their ratio.

    python benchmarks/plan_vs_bench.py results/bench-quickstart-grpo-cpu.json results/bench-quickstart-ppo-cpu.json
    python benchmarks/plan_vs_bench.py results/bench-quickstart-grpo-cpu.json --mfu 0.2
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import yaml

from megarl.bench import Column, Report
from megarl.config import load_recipe
from megarl.plan.gpus import gpu_spec
from megarl.plan.plan import Options, plan_recipe


def _measured(report: Report) -> tuple[dict[str, float], float, float]:
    """(median seconds per phase, the run's matmul peak TFLOP/s, its memcpy GB/s)."""
    phases = dict(zip(report.table("phases").column("phase"), report.table("phases").column("median")))
    mfu = report.table("model FLOPs utilisation")
    row = mfu.rows[mfu.column("phase").index("training phases")]
    achieved, percent = row[[c.name for c in mfu.columns].index("achieved")], row[-1]
    peak = achieved / (percent / 100)
    sync = report.table("weight sync")
    memcpy = sync.column("bound rate")[0]
    return phases, peak, memcpy


def compare(path: Path, *, mfu: float) -> Report:
    bench = Report.read(path)
    phases, peak, memcpy = _measured(bench)
    with tempfile.TemporaryDirectory() as scratch:
        recipe_file = Path(scratch) / "recipe.yaml"
        recipe_file.write_text(yaml.safe_dump(bench.settings["recipe"]))
        recipe = load_recipe(recipe_file)
    device = gpu_spec(None, memory_gb=bench.machine["memory_gib"], tflops=peak, bandwidth_gbs=memcpy)
    plan = plan_recipe(recipe, Options(gpu=device, mfu=mfu))
    report = Report.create(f"plan-vs-{bench.name}", {"bench_report": str(path), "mfu": mfu, "peak_tflops": peak,
                                                     "bandwidth_gbs": memcpy})
    table = report.add_table("phases", [Column("phase"), Column("plan", "s", ".3g"), Column("bench median", "s", ".3g"),
                                        Column("bench / plan", "", ".2f"), Column("plan's basis")])
    for phase in plan.times:
        measured = phases.get(phase.phase)
        table.add_row(phase.phase, phase.seconds, measured, measured / phase.seconds if measured else None,
                      phase.basis)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, nargs="+", help="megarl bench JSON reports")
    parser.add_argument("--mfu", type=float, default=0.35, help="the plan's MFU assumption (default: the plan's)")
    args = parser.parse_args()
    for path in args.reports:
        print(compare(path, mfu=args.mfu).to_markdown(with_settings=True))


if __name__ == "__main__":
    main()
