"""`megarl bench RECIPE`: W warm-up steps and K measured steps of the real pipeline, then a report.

The run is `megarl.controller.run.train` itself on the recipe with a few keys set
(`bench_overrides`): exactly W + K steps, no validation, no checkpoints, no SFT
warm-up, no console bar (the bench draws its own progress line), a critic that
updates from the first step, and a run directory under `--out`. With `synthetic`
the data become random-digit prompts that fill `data.max_prompt_length`
(`megarl/random_digits`) and every response runs to `max_response_length`
(`rollout.ignore_eos`), so two runs of one recipe process the same tokens. The
user's `--set` comes after these keys, the step count last.

Around the steps, in the same process: the device's matmul peak (before and after
the steps, the better of the two, unless given) and the bound of the weight-sync
transport on the bytes the run synced (after the steps). The figures come from the
run's own `metrics.jsonl`; `megarl.bench.step_report` turns them into the report.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import TextIO

import torch

from megarl.bench.bounds import matmul_peak_tflops
from megarl.bench.progress import BenchProgress
from megarl.bench.report import Report
from megarl.bench.step_report import Bound, Peak, build_report
from megarl.cluster.placement import plan_pools, total_devices
from megarl.config import Recipe, load_recipe
from megarl.controller.run import train
from megarl.errors import InputError
from megarl.registry import WEIGHT_SYNC_TRANSPORTS


def bench_overrides(base: Recipe, *, steps: int, warmup: int, synthetic: bool,
                    out: Path) -> tuple[list[str], list[str]]:
    """(`--set` texts applied before the user's, those applied after) that make `base` a bench run."""
    before = [f"trainer.output_dir={json.dumps(str(out / 'runs'))}", "trainer.val_every=0",
              "trainer.val_before_train=false", "trainer.checkpoint.enabled=false", "trainer.checkpoint.resume=never",
              "trainer.logging.console=false", "trainer.logging.tensorboard=false",
              "trainer.logging.wandb.enabled=false", "trainer.samples.train_rows=0", "sft_warmup.steps=0"]
    if base.critic is not None:
        before.append("critic.warmup_steps=0")  # measured steps update the actor too
    if synthetic:
        before += ["data.train_files=[]", "data.val_files=[]", "data.synthetic.task=random_digits",
                   f"data.synthetic.num_train={base.data.train_batch_size * (warmup + steps)}",
                   "data.synthetic.num_val=0", "rollout.ignore_eos=true"]
    return before, [f"trainer.total_steps={warmup + steps}"]


def _peak(recipe: Recipe) -> float:
    device = "cuda" if recipe.placement.device == "cuda" else "cpu"
    return matmul_peak_tflops(device=device, dtype=getattr(torch, recipe.model.dtype))


def _bound(recipe: Recipe, records: list[dict], run_dir: Path) -> Bound | None:
    """The bound of the recipe's transport (its registry entry's `bound`) on the median bytes synced per step
    (None when no step synced)."""
    sizes = [r["weight_sync/bytes"] for r in records if "weight_sync/bytes" in r]
    if not sizes:
        return None
    bound = WEIGHT_SYNC_TRANSPORTS.get(recipe.weight_sync.transport).bound
    seconds = bound.seconds(int(statistics.median(sizes)), bucket_bytes=int(recipe.weight_sync.bucket_mb * (1 << 20)),
                            scratch_dir=run_dir / "weight_sync",
                            device="cuda" if recipe.placement.device == "cuda" else "cpu")
    return Bound(bound.name, seconds)


def _step_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return sorted((r for r in map(json.loads, lines) if "timing_s/step" in r), key=lambda r: r["step"])


def run_bench(recipe_path: Path, overrides: list[str], *, steps: int, warmup: int, synthetic: bool, out: Path,
              peak_tflops: float | None = None, ray_address: str | None = None,
              stream: TextIO | None = None) -> Report:
    """Run the bench, write `<out>/bench-<name>.json` and `.md`, and return the report."""
    if steps < 1 or warmup < 0:
        raise InputError(f"--steps must be >= 1 and --warmup >= 0 (got --steps {steps}, --warmup {warmup})")
    base = load_recipe(recipe_path, overrides)
    before, after = bench_overrides(base, steps=steps, warmup=warmup, synthetic=synthetic, out=out)
    recipe = load_recipe(recipe_path, before + list(overrides) + after)
    devices = total_devices(plan_pools(recipe))
    progress = BenchProgress(warmup=warmup, steps=steps, stream=stream)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    progress.show(f"bench: {recipe.name}: measuring the device peak, then starting Ray, the engines and the fleet")
    peaks = [peak_tflops] if peak_tflops is not None else [_peak(recipe)]
    run_dir = train(recipe, ray_address=ray_address, on_phase=progress)
    progress.finish(f"bench: {warmup + steps} steps done; measuring the bounds")
    records = _step_records(run_dir)
    measured = [r for r in records if r["step"] > warmup]
    previous = next((r for r in records if r["step"] == warmup), None)
    bound = _bound(recipe, measured, run_dir)
    if peak_tflops is None:
        peaks.append(_peak(recipe))
    device = "GPU" if recipe.placement.device == "cuda" else "CPU thread (one process slot)"
    source = "given with --peak-tflops" if peak_tflops is not None else (
        f"measured: the best {recipe.model.dtype} matmul of one {device}, before and after the steps")
    settings = {
        "bench": {"recipe_file": str(recipe_path), "set": list(overrides), "warmup": warmup, "steps": steps,
                  "synthetic": synthetic, "devices": devices, "run_dir": str(run_dir),
                  "load_average_at_start": load_at_start},
        "recipe": recipe.model_dump(mode="json"),
    }
    report = build_report(recipe, measured, previous=previous, settings=settings, devices=devices,
                          peak=Peak(max(peaks), source), bound=bound)
    report.write(out)
    return report

