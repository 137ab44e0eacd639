"""A plan as a benchmark-format report (`megarl.bench.report`): `--json` prints its dict, the console its Markdown.

Tables: `memory per GPU` (one row per training role: weights, gradients,
optimizer state, activations, total, GiB), `rollout KV cache` (one server GPU's
pool and the step's need), `phase peaks` (each phase's GPU, against the device),
`step time` (seconds per phase, with the basis of each estimate) and `verdict`.
The settings hold the device, the assumptions and the recipe's name.
"""

from __future__ import annotations

import dataclasses
import math

from megarl.bench.report import Column, Report
from megarl.plan.gpus import GIB
from megarl.plan.plan import Plan
from megarl.plan.timing import BANDWIDTH_EFFICIENCY


NOTES = (
    "memory: Megatron's sharding of this model (exact parameter counts per rank); gradients in megatron's float32 "
    "DDP buffer; Adam's moments (+ float32 master weights for bf16/fp16); activations after Korthikanti et al. 2022 "
    "for RMSNorm/SwiGLU/GQA layers, which leaves out the allocator's fragmentation and temporary buffers (expect "
    "5-15% more in practice)",
    "KV cache: SGLang's rule, mem_fraction_static x what the device has free when the server starts - its "
    "weights; free is the device less what is already there (CUDA contexts, 0.5 GiB per process assumed; "
    "engines not offloaded; for a judge on the rollout's GPUs, the rollout servers)",
    "times: upper bounds with every response at max_response_length; decoding memory-bound at "
    f"{BANDWIDTH_EFFICIENCY:.0%} of the data-sheet bandwidth, training at the stated MFU of the data-sheet peak",
)


def _gib(value: float) -> float:
    return round(value / GIB, 3)


def plan_report(plan: Plan) -> Report:
    options = plan.options
    settings = {"recipe": plan.recipe, "gpu": dataclasses.asdict(options.gpu), "mfu": options.mfu,
                "recompute": options.recompute, "distributed_optimizer": options.distributed_optimizer,
                "dtype": plan.dtype}
    report = Report.create(f"plan-{plan.recipe}", settings)
    memory = report.add_table("memory per GPU", [
        Column("role"), Column("layout"), Column("micro-batch", "samples"), Column("sequence", "tokens"),
        Column("weights", "GiB", ".2f"), Column("gradients", "GiB", ".2f"), Column("optimizer", "GiB", ".2f"),
        Column("activations", "GiB", ".2f"), Column("total", "GiB", ".2f")])
    for role in plan.roles:
        m = role.memory
        memory.add_row(role.role, role.describe_layout(), role.micro_batch, role.seq_len, _gib(m.weights),
                       _gib(m.gradients), _gib(m.optimizer), _gib(m.activations), _gib(m.total))
    pool = plan.pool
    kv = report.add_table("rollout KV cache", [
        Column("server GPU"), Column("weights", "GiB", ".2f"), Column("KV pool", "GiB", ".2f"), Column("tokens held"),
        Column("token", "KiB", ".1f"), Column("sequences per server"), Column("tokens needed"),
        Column("sequences at once"), Column("waves")])
    kv.add_row(f"tp{plan.fleet_tp}", _gib(pool.weight_bytes), _gib(pool.bytes), pool.tokens, pool.token_bytes / 1024,
               pool.sequences, pool.needed_tokens, pool.concurrent, pool.waves)
    if plan.judge_pool is not None:
        judge = plan.judge_pool
        kv.add_row(f"judge tp{plan.judge_tp}", _gib(judge.weight_bytes), _gib(judge.bytes), judge.tokens,
                   judge.token_bytes / 1024, judge.sequences, judge.needed_tokens, judge.concurrent, judge.waves)
    peaks = report.add_table("phase peaks", [
        Column("phase"), Column("pool"), Column("per GPU", "GiB", ".2f"), Column("device", "GiB", ".2f"),
        Column("headroom", "GiB", ".2f"), Column("fits"), Column("made of")])
    capacity = options.gpu.memory_bytes
    for peak in plan.peaks:
        peaks.add_row(peak.phase, peak.pool, _gib(peak.bytes), _gib(capacity), _gib(capacity - peak.bytes),
                      peak.bytes <= capacity, peak.parts)
    times = report.add_table("step time", [Column("phase"), Column("estimate", "s", ".3g"), Column("basis")])
    for phase in plan.times:
        times.add_row(phase.phase, phase.seconds if math.isfinite(phase.seconds) else None, phase.basis)
    total = sum(phase.seconds for phase in plan.times)
    times.add_row("step", total if math.isfinite(total) else None, "the phases one after another")
    verdict = report.add_table("verdict", [Column("question"), Column("answer")])
    verdict.add_row("fits", plan.fits)
    for index, problem in enumerate(plan.problems):
        verdict.add_row(f"problem {index + 1}", problem)
    for role, micro in plan.largest_micro_batch.items():
        verdict.add_row(f"largest {role} micro-batch that fits", micro)
    verdict.add_row("smallest TP that fits", plan.smallest_tp)
    report.notes.extend(NOTES)
    return report


def verdict_line(plan: Plan) -> str:
    """One line: fits, or the first reason it does not."""
    if plan.fits:
        return f"plan: fits on {plan.options.gpu.name} (peak {max(p.bytes for p in plan.peaks) / GIB:.1f} GiB of " \
               f"{plan.options.gpu.memory_gib:g} GiB per GPU)"
    return f"plan: does not fit on {plan.options.gpu.name}: {plan.problems[0]}"
