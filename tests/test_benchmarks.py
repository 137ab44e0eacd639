"""The micro-benchmarks in benchmarks/ run at a tiny size and write their report with `--out`.

Each script runs as a user runs it (a subprocess from the repository root) and
the test reads its JSON back through `Report.read`: the fields every report
carries, the tables the script promises, and figures consistent with each
other. Sizes are tiny, so the figures themselves say nothing about speed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.bench import Report

REPO = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, out: Path, *args: str, timeout_s: float = 600) -> Report:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, f"benchmarks/{script}.py", *args, "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    json_path, md_path = out / f"{script}.json", out / f"{script}.md"
    assert f"wrote {json_path}" in result.stdout and md_path.exists()
    report = Report.read(json_path)
    assert report.name == script
    assert report.machine["cores"] >= 1 and report.machine["memory_gib"] > 0
    assert {"python", "torch", "megatron-core", "sglang", "ray", "megarl"} <= set(report.versions)
    markdown = md_path.read_text()
    for table in report.tables:
        assert f"## {table.name}" in markdown and table.name in result.stdout  # printed as well as written
    return report


def test_algorithms_benchmark_writes_report(tmp_path):
    report = run_benchmark(
        "algorithms", tmp_path, "--samples", "64", "--tokens", "32", "--loop-samples", "8", "--repeats", "1",
        "--group-size", "4", "--world-size", "2",
    )
    assert report.settings["samples"] == 64 and report.settings["compiled_scan"] is True
    assert report.versions["numba"] != "not installed"
    overhead = report.table("estimators vs memcpy of the same bytes")
    assert [row[0] for row in overhead.rows] == ["gae (compiled scan)", "gae (pure-torch fallback)", "grpo"]
    for row in overhead.rows:
        seconds, memcpy_s, ratio = row[1], row[2], row[3]
        assert seconds > 0 and memcpy_s > 0 and ratio == pytest.approx(seconds / memcpy_s)
    assert overhead.column("target") == [3.0, None, 2.0]
    accuracy = report.table("accuracy against float64")
    assert len(accuracy.rows) == 5 and all(accuracy.column("within 1e-5"))
    loops = report.table("vectorised vs per-sample loop")
    assert {"gae", "grpo (Python loop)", "Batch.union", "balanced_permutation"} <= set(loops.column("operation"))


@pytest.mark.dist
def test_engine_step_benchmark_writes_report(tmp_path):
    report = run_benchmark(
        "engine_step", tmp_path, "--layouts", "tp2", "--rows", "4", "--steps", "1", "--hidden", "64",
        "--layers", "2", "--vocab", "256", "--max-tokens", "512",
    )
    assert report.settings["model"]["hidden_size"] == 64
    table = report.table("actor step per layout")
    assert table.column("layout, mode") == ["tp2, fixed", "tp2, packed"]
    assert all(x > 0 for x in table.column("step") + table.column("fwd+bwd") + table.column("peak RSS rank 1"))
    fixed, packed = table.column("padding")
    assert 0 < fixed < 1 and packed < fixed  # packing drops padding slots


@pytest.mark.dist
@pytest.mark.slow
def test_weight_sync_benchmark_writes_report(tmp_path):
    report = run_benchmark(
        "weight_sync", tmp_path, "--hidden", "64", "--layers", "2", "--heads", "2", "--ffn", "128", "--vocab", "256",
        "--syncs", "2", "--bucket-mb", "1", "--layouts", "tp1",
    )
    assert report.settings["parameters"] > 0 and report.settings["bf16_bytes"] == 2 * report.settings["parameters"]
    table = report.table("transports and bounds")
    assert table.column("path") == [
        "memcpy (one copy, 1 thread)", "two copies at once (2 processes)", "raw gloo broadcast (1 -> 1)",
        "tensor transport, TP1 x PP1",
    ]
    assert all(seconds > 0 for seconds in table.column("time"))
    tensor = table.rows[-1]
    assert tensor[3] == "memcpy" and tensor[4] == pytest.approx(tensor[1] / table.rows[0][1])
