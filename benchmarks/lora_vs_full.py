"""LoRA against full fine-tuning, from the metrics of two finished runs: the README's demonstration table.

    python benchmarks/lora_vs_full.py runs/quickstart-lora-cpu runs/quickstart-grpo-full

Prints, per run: the greedy validation score at every validation step and its gain over step 0,
the bytes one weight sync moves (`weight_sync/bytes`, median over steps), the actor's peak
memory (`perf/max_memory_gb/actor`, the largest over steps) and training state
(`perf/train_state_gb/actor`: weights, gradients, optimizer state), whether a reference engine ran, in
processes of its own (`perf/max_memory_gb/reference`) or in the actor's (`perf/train_state_gb/reference`
alone), and the median step time; then the gain difference at each
common validation step and the sync-bytes ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summary(run_dir: Path) -> dict:
    records = _records(run_dir)
    steps = [r for r in records if "timing_s/step" in r]
    validation = {r["step"]: r["val/score/mean"] for r in records if "val/score/mean" in r}
    reference = [r["perf/max_memory_gb/reference"] for r in steps if "perf/max_memory_gb/reference" in r]
    fused = [r["perf/train_state_gb/reference"] for r in steps if "perf/train_state_gb/reference" in r]
    return {
        "run": run_dir.name,
        "validation": validation,
        "gain": {step: score - validation[0] for step, score in validation.items()},
        "sync_bytes": statistics.median(r["weight_sync/bytes"] for r in steps),
        "actor_peak_gb": max(r["perf/max_memory_gb/actor"] for r in steps),
        "actor_state_gb": max((r["perf/train_state_gb/actor"] for r in steps if "perf/train_state_gb/actor" in r),
                              default=None),
        "reference_peak_gb": max(reference) if reference else None,
        "fused_reference_gb": max(fused) if fused and not reference else None,
        "step_s": statistics.median(r["timing_s/step"] for r in steps),
        "steps": len(steps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lora", type=Path, help="the LoRA run's directory")
    parser.add_argument("full", type=Path, help="the full fine-tuning run's directory")
    args = parser.parse_args(argv)
    lora, full = summary(args.lora), summary(args.full)
    for run in (lora, full):
        scores = "  ".join(f"{step}: {score:.3f}" for step, score in sorted(run["validation"].items()))
        reference = "none"
        if run["reference_peak_gb"] is not None:
            reference = f"in processes of its own, {run['reference_peak_gb']:.2f} GB"
        elif run["fused_reference_gb"] is not None:
            reference = f"in the actor's processes, {run['fused_reference_gb'] * 2**10:.2f} MiB of weights"
        state = "n/a" if run["actor_state_gb"] is None else f"{run['actor_state_gb'] * 2**10:.2f} MiB"
        print(f"{run['run']}: {run['steps']} steps; validation {scores}")
        print(f"  sync {run['sync_bytes']:,.0f} B; actor peak {run['actor_peak_gb']:.3f} GB, training state {state}; "
              f"reference engine {reference}; step {run['step_s']:.1f} s (median)")
    common = sorted(set(lora["gain"]) & set(full["gain"]) - {0})
    for step in common:
        print(f"step {step}: gain LoRA {lora['gain'][step]:+.3f}, full {full['gain'][step]:+.3f}, "
              f"difference {lora['gain'][step] - full['gain'][step]:+.3f}")
    print(f"full sync / LoRA sync bytes: {full['sync_bytes'] / lora['sync_bytes']:.0f}x; actor peak memory "
          f"LoRA / full: {lora['actor_peak_gb'] / full['actor_peak_gb']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
