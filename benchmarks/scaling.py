"""Benchmark: how step time and tokens/s change when one thing doubles, four `megarl bench` runs per series.

Every run is `megarl bench recipes/quickstart-grpo-cpu.yaml --synthetic` (random prompts
filling the 48-token window, every response max_response_length tokens) with
`data.train_batch_size=32` (256 samples a step) unless its series changes it:

- batch:    data.train_batch_size 32, 64, 128, 256
- response: data.max_response_length 12, 24, 48, 96
- servers:  rollout.num_servers 1, 2, 4, 8
- tp:       actor.parallel.tp 1, 2, 4, 8 (the Megatron engine; megarl's CPU rollout engine has no TP)

The last two series run disaggregated (the actor on TP devices of its own, each server
on one of its own, weights by the distributed transport), so only what the series
doubles grows; their model has num_key_value_heads 8, so that TP 8 divides it.

All runs share one in-process Ray (16 logical CPUs, so 9 process slots fit on this
2-core machine: a slot is a process, not a core). Each run's report goes to
OUT/<series>-<value>/; the summary table, with the load average at the start and
end of every run, to OUT/scaling.json and .md. A run whose report is already in OUT
is read back instead of run again (an interrupted series continues where it
stopped; delete a report to measure that run anew).

    python benchmarks/scaling.py --out results/scaling            # ~30 min here
    python benchmarks/scaling.py --series batch --steps 2 --out /tmp/s
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from megarl.bench import Column, Report
from megarl.bench.run import run_bench
from megarl.cluster.ray_cluster import start_local_ray

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml"
BASE = ["data.train_batch_size=32"]


def _disaggregated(*, servers: int = 1, tp: int = 1) -> list[str]:
    """The actor on `tp` devices of its own, `servers` rollout servers on theirs; weights by broadcast."""
    return ["placement.colocate=false", "placement.offload=false", f"placement.gpus_per_node={tp + servers}",
            f"placement.pools={{train: {{gpus_per_node: {tp}}}, rollout: {{gpus_per_node: {servers}}}}}",
            "placement.roles={actor: train, rollout: rollout}", "weight_sync.transport=distributed",
            f"rollout.num_servers={servers}", f"actor.parallel.tp={tp}", "model.config.num_key_value_heads=8"]


SERIES = {
    "batch": ("data.train_batch_size", [32, 64, 128, 256], lambda v: [f"data.train_batch_size={v}"]),
    "response": ("data.max_response_length", [12, 24, 48, 96], lambda v: [f"data.max_response_length={v}"]),
    "servers": ("rollout.num_servers", [1, 2, 4, 8], lambda v: _disaggregated(servers=v)),
    "tp": ("actor.parallel.tp", [1, 2, 4, 8], lambda v: _disaggregated(tp=v)),
}


def _row(report: Report, key: str) -> dict:
    table = report.table("phases" if key in ("step", "gen") else "throughput")
    names = [c.name for c in table.columns]
    return next(dict(zip(names, row)) for row in table.rows if row[0] == key)


def _training_seconds(report: Report) -> float:
    split = report.table("generation vs training")
    return next(row[2] for row in split.rows if row[0] == "training")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--series", default=",".join(SERIES), help="comma-separated subset of: " + ", ".join(SERIES))
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per run")
    parser.add_argument("--out", type=Path, required=True, help="directory for every run's report and the summary")
    args = parser.parse_args(argv)
    chosen = args.series.split(",")
    ray_dir = tempfile.mkdtemp(prefix="megarl-ray-")
    start_local_ray(temp_dir=ray_dir, num_cpus=16)
    runs = []
    try:
        for series in chosen:
            key, values, overrides = SERIES[series]
            for value in values:
                out = args.out / f"{series}-{value}"
                done = out / "bench-quickstart-grpo-cpu.json"
                report = Report.read(done) if done.exists() else run_bench(
                    RECIPE, BASE + overrides(value), steps=args.steps, warmup=args.warmup, synthetic=True, out=out)
                runs.append((series, key, value, report))
    finally:
        import ray

        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
    summary = Report.create("scaling", {"recipe": str(RECIPE.name), "base": BASE, "synthetic": True,
                                        "warmup": args.warmup, "steps": args.steps,
                                        "series": {s: SERIES[s][0] for s in chosen}})
    table = summary.add_table("doubling one setting", [
        Column("run"), Column("devices", "", "d"), Column("step", "s", ".2f"), Column("step vs previous", "x", ".2f"),
        Column("gen", "s", ".2f"), Column("training phases", "s", ".2f"), Column("trained", "tokens/s", ".0f"),
        Column("tokens/s vs previous", "x", ".2f"), Column("trained", "tokens/s/device", ".0f"),
        Column("generated", "tokens/s", ".0f"), Column("load at start"), Column("load at end"),
    ])
    previous: dict[str, tuple[float, float]] = {}
    for series, key, value, report in runs:
        step = _row(report, "step")["median"]
        devices = report.settings["bench"]["devices"]
        per_device = _row(report, "trained (prompt + response tokens)")["over the step"]
        generated = _row(report, "generated (response tokens)")["over the step"] * devices
        tokens = per_device * devices
        before = previous.get(series)
        table.add_row(f"{key}={value}", devices, step, step / before[0] if before else None,
                      _row(report, "gen")["median"], _training_seconds(report), tokens,
                      tokens / before[1] if before else None, per_device, generated,
                      "/".join(f"{x:.1f}" for x in report.settings["bench"]["load_average_at_start"]),
                      "/".join(f"{x:.1f}" for x in report.machine["load_average"]))
        previous[series] = (step, tokens)
    summary.notes.append("step, gen and training phases: medians over the measured steps (training = old_log_prob + "
                         "update_actor mean per step); tokens/s: prompt + response tokens over the step time, all "
                         "devices together (x devices of NeMo-RL's per-device figure); generated: response tokens "
                         "over the step time; 'vs previous': the ratio to the run before it in its series.")
    print(summary.to_markdown())
    for path in summary.write(args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
