"""`megarl bench` end to end: the quickstart recipe, a few small synthetic steps, on the session's Ray cluster.

The report must have every field filled and every figure consistent with the run's own
`metrics.jsonl`: per-step phases plus the stated overhead add up to the step time
(exactly: the overhead is what the phases leave), times are non-negative, and the token
counts are the batch's (with `--synthetic` every prompt fills max_prompt_length and
every response runs to max_response_length). Speed itself is not asserted here
(benchmarks/README.md keeps the figures).
"""

from __future__ import annotations

import io
import json
import statistics
from pathlib import Path

import pytest

from megarl.algorithms.metrics import OVERLAPPED_TIMINGS
from megarl.bench.compare import compare_reports
from megarl.bench.report import Report
from megarl.bench.run import run_bench

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml"
BATCH, N, PROMPT, RESPONSE = 4, 4, 40, 12
TABLES = ["phases", "generation vs training", "throughput", "model FLOPs utilisation", "weight sync", "peak memory",
          "controller overhead", "steps"]


def _rows(table) -> dict:
    return {row[0]: dict(zip([c.name for c in table.columns], row)) for row in table.rows}


@pytest.mark.e2e
@pytest.mark.dist
def test_bench_on_the_quickstart_reports_every_field(ray_session, tmp_path):
    progress = io.StringIO()
    overrides = [f"data.train_batch_size={BATCH}", f"rollout.n={N}", f"actor.ppo_mini_batch_size={BATCH * N}",
                 f"actor.ppo_micro_batch_size={BATCH * N // 2}", f"data.max_prompt_length={PROMPT}",
                 f"data.max_response_length={RESPONSE}"]
    report = run_bench(QUICKSTART, overrides, steps=2, warmup=1, synthetic=True, out=tmp_path, stream=progress)

    assert [t.name for t in report.tables] == TABLES
    written = Report.read(tmp_path / "bench-quickstart-grpo-cpu.json")
    assert written.to_dict() == report.to_dict()
    markdown = (tmp_path / "bench-quickstart-grpo-cpu.md").read_text()
    assert all(f"## {name}" in markdown for name in TABLES) and "NeMo-RL" in markdown
    assert {"python", "torch", "megatron-core", "sglang", "ray", "megarl"} <= set(report.versions)
    assert report.machine["cores"] >= 1 and len(report.machine["load_average"]) == 3

    # The run the report describes: 1 + 2 steps, no validation, no checkpoint, random prompts, fixed lengths.
    bench, recipe = report.settings["bench"], report.settings["recipe"]
    assert (bench["warmup"], bench["steps"], bench["synthetic"], bench["devices"]) == (1, 2, True, 1)
    assert recipe["trainer"]["total_steps"] == 3 and recipe["trainer"]["val_every"] == 0
    assert recipe["trainer"]["checkpoint"]["enabled"] is False and recipe["rollout"]["ignore_eos"] is True
    assert recipe["data"]["synthetic"]["task"] == "random_digits" and recipe["sft_warmup"]["steps"] == 0
    run_dir = Path(bench["run_dir"])
    assert not (run_dir / "checkpoints").exists()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # no validation record at step 0

    rows = BATCH * N
    steps = _rows(report.table("steps"))
    assert sorted(steps) == [2, 3]
    for record in records[1:]:
        step = steps[record["step"]]
        # Overlapped work (reward scoring's busy time during gen) is not a slice of the step.
        phases = {k: v for k, v in record.items() if k.startswith("timing_s/")
                  and k.removeprefix("timing_s/") not in ("step", *OVERLAPPED_TIMINGS)}
        assert all(seconds >= 0 for seconds in phases.values()) and step["step time"] > 0
        assert step["step time"] == record["timing_s/step"]
        # The stated overhead is what the phases leave of the step: together they are the step.
        assert step["outside the phases"] >= 0
        assert sum(phases.values()) + step["outside the phases"] == pytest.approx(record["timing_s/step"], abs=1e-9)
        assert 0 <= step["Batch operations"] == record["perf/batch_ops_s"] < step["step time"]
        assert step["generated"] == rows * RESPONSE and step["trained"] == rows * (PROMPT + RESPONSE)
        assert record["response_length/min"] == RESPONSE and record["prompt_length/min"] == PROMPT
        assert record["prompt_length/max"] == PROMPT

    phases = _rows(report.table("phases"))
    assert {"gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights", "step"} <= set(phases)
    assert all(0 <= p["min"] <= p["median"] <= p["max"] for p in phases.values())
    assert sum(p["share of step"] for name, p in phases.items() if name != "step") == pytest.approx(100.0)
    split = _rows(report.table("generation vs training"))
    assert sum(p["share of step"] for p in split.values()) == pytest.approx(100.0)

    throughput = _rows(report.table("throughput"))
    generated, trained = throughput["generated (response tokens)"], throughput["trained (prompt + response tokens)"]
    assert generated["per step"] == rows * RESPONSE and trained["per step"] == rows * (PROMPT + RESPONSE)
    # NeMo-RL's definition is perf/throughput: total tokens over the step time and the devices.
    assert trained["over the step"] == pytest.approx(statistics.median(r["perf/throughput"] for r in records[1:]))
    assert generated["over its phase"] > generated["over the step"] > 0

    mfu = _rows(report.table("model FLOPs utilisation"))
    assert {"old_log_prob", "update_actor", "training phases"} <= set(mfu)
    assert all(0 < row["MFU"] <= 100 and row["achieved"] > 0 for row in mfu.values())
    assert "measured" in " ".join(report.notes) and "6N + 12*L*q*S" in " ".join(report.notes)

    sync = _rows(report.table("weight sync"))
    for row in sync.values():
        assert row["median"] > 0 and row["rate"] > 0 and row["bound"] == "memcpy (1 thread)"
        assert row["ratio to bound"] == pytest.approx(row["bound rate"] / row["rate"])  # seconds / bound seconds
    memory = _rows(report.table("peak memory"))
    assert set(memory) == {"actor", "rollout"} and all(row["peak"] > 0 for row in memory.values())
    overhead = _rows(report.table("controller overhead"))
    assert set(overhead) == {"outside the phases", "Batch operations", "between steps"}
    assert overhead["outside the phases"]["budget"] == 5.0 and overhead["Batch operations"]["budget"] == 1.0
    assert all(row["median"] >= 0 and isinstance(row["within budget"], (bool, type(None)))
               for row in overhead.values())

    lines = progress.getvalue().splitlines()
    assert any(line.startswith("bench: step 1/3 (warm-up 1/1) gen") for line in lines)
    assert any("(measured 2/2) update_actor" in line and "left ~" in line for line in lines)

    # A report compared with itself: every ratio is 1.
    _, tables = compare_reports([tmp_path / "bench-quickstart-grpo-cpu.json"] * 2)
    ratios = [row[-1] for table in tables[2:] for row in table.rows if row[-1] is not None]
    assert ratios and all(ratio == 1.0 for ratio in ratios)

