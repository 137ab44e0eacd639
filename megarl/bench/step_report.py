"""The `megarl bench` report: the measured steps' metrics turned into tables of the one report format.

Input: the `metrics.jsonl` records of the measured steps (and of the step before
the first, for the time between steps), the resolved recipe, the device peak and
the weight-sync bound measured in the same run. Every figure states its unit; the
definitions (tokens/s/device, MFU, bounds, overhead) go into the report's notes.
Pure bookkeeping: nothing here runs a step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from megarl.algorithms.metrics import OVERLAPPED_TIMINGS, TIMING_PHASES
from megarl.bench.flops import FORMULA, flops_per_token
from megarl.bench.report import Column, Report
from megarl.config import Recipe
from megarl.config.layout import role_pool
from megarl.config.schema import read_hf_config
from megarl.models.spec import arch_from_hf
from megarl.registry import WEIGHT_SYNC_TRANSPORTS

# The phases that partition a step; overlapped work (reward scoring during gen) is noted, not added.
PHASES = tuple(phase for phase in TIMING_PHASES if phase not in ("step", *OVERLAPPED_TIMINGS))
# phase -> (role whose devices run it, forward and backward?)
TRAINING_PHASES = {"old_log_prob": ("actor", False), "ref": ("reference", False), "values": ("critic", False),
                   "update_critic": ("critic", True), "update_actor": ("actor", True)}
CATEGORIES = {"generation": ("gen",), "training": tuple(TRAINING_PHASES), "weight sync": ("update_weights",),
              "memory sleep/wake": ("onload", "offload"), "reward and advantages": ("reward", "adv")}
OUTSIDE = "outside the phases"
OVERHEAD_BUDGET_PCT = {OUTSIDE: 5.0, "Batch operations": 1.0}
MEMORY_PREFIX = "perf/max_memory_gb/"


@dataclass
class Peak:
    """The device peak MFU is measured against: TFLOP/s per device and where the number comes from."""

    tflops: float
    source: str


@dataclass
class Bound:
    """The transport's bound measured in the run: its name and seconds for the synced bytes."""

    name: str
    seconds: float


@dataclass
class StepFigures:
    """Per measured step: seconds of each phase, outside them, in Batch operations and between steps."""

    step: int
    seconds: float
    phases: dict[str, float]
    batch_ops: float
    between: float | None
    total_tokens: float
    response_tokens: float

    @property
    def outside(self) -> float:
        return self.seconds - sum(self.phases.values())


def step_figures(records: list[dict], *, rows: int, previous: dict | None) -> list[StepFigures]:
    """The figures of each measured step record; `previous` is the record before the first (or None)."""
    figures = []
    for record in records:
        seconds = record["timing_s/step"]
        between = record["time"] - previous["time"] - seconds if previous is not None else None
        figures.append(StepFigures(
            step=record["step"], seconds=seconds, batch_ops=record["perf/batch_ops_s"], between=between,
            phases={phase: record[f"timing_s/{phase}"] for phase in PHASES if f"timing_s/{phase}" in record},
            total_tokens=record["perf/total_num_tokens"], response_tokens=record["response_length/mean"] * rows,
        ))
        previous = record
    return figures


def _median_min_max(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def build_report(recipe: Recipe, records: list[dict], *, previous: dict | None, settings: dict, devices: int,
                 peak: Peak, bound: Bound | None) -> Report:
    """The report of the measured `records` (one per step, in order)."""
    rows = recipe.data.train_batch_size * recipe.rollout.n
    steps = step_figures(records, rows=rows, previous=previous)
    report = Report.create(f"bench-{recipe.name}", settings)
    total_step = sum(s.seconds for s in steps)
    _phase_table(report, steps, total_step)
    _split_table(report, steps, total_step)
    _throughput_table(report, recipe, steps, devices)
    _mfu_table(report, recipe, steps, peak)
    if bound is not None:
        _weight_sync_table(report, records, bound)
    _memory_table(report, recipe, records)
    _overhead_table(report, steps)
    _steps_table(report, steps)
    report.notes += _notes(recipe, devices, peak)
    return report


def _phase_table(report: Report, steps: list[StepFigures], total_step: float) -> None:
    table = report.add_table("phases", [
        Column("phase"), Column("median", "s", ".3f"), Column("min", "s", ".3f"), Column("max", "s", ".3f"),
        Column("share of step", "%", ".1f"), Column("steps", "", "d"),
    ])
    for phase in PHASES:
        values = [s.phases[phase] for s in steps if phase in s.phases]
        if values:
            table.add_row(phase, *_median_min_max(values), 100 * sum(values) / total_step, len(values))
    outside = [s.outside for s in steps]
    table.add_row(OUTSIDE, *_median_min_max(outside), 100 * sum(outside) / total_step, len(steps))
    table.add_row("step", *_median_min_max([s.seconds for s in steps]), 100.0, len(steps))


def _split_table(report: Report, steps: list[StepFigures], total_step: float) -> None:
    table = report.add_table("generation vs training", [
        Column("part of the step"), Column("phases"), Column("mean per step", "s", ".3f"),
        Column("share of step", "%", ".1f"),
    ])
    for name, phases in CATEGORIES.items():
        seconds = sum(s.phases.get(phase, 0.0) for s in steps for phase in phases)
        present = [phase for phase in phases if any(phase in s.phases for s in steps)]
        if present:
            table.add_row(name, ", ".join(present), seconds / len(steps), 100 * seconds / total_step)
    outside = sum(s.outside for s in steps)
    table.add_row(OUTSIDE, "", outside / len(steps), 100 * outside / total_step)


def _role_devices(recipe: Recipe, role: str) -> int:
    return role_pool(recipe.placement, role).size


def _throughput_table(report: Report, recipe: Recipe, steps: list[StepFigures], devices: int) -> None:
    table = report.add_table("throughput", [
        Column("tokens"), Column("per step", "tokens", ".0f"), Column("over the step", "tokens/s/device", ".1f"),
        Column("over its phase", "tokens/s/device", ".1f"), Column("phase"), Column("phase devices", "", "d"),
    ])
    gen = [s for s in steps if "gen" in s.phases]
    rollout_devices = _role_devices(recipe, "rollout")
    table.add_row(
        "generated (response tokens)", statistics.mean(s.response_tokens for s in steps),
        statistics.median(s.response_tokens / s.seconds / devices for s in steps),
        statistics.median(s.response_tokens / s.phases["gen"] / rollout_devices for s in gen) if gen else None,
        "gen", rollout_devices,
    )
    update = [s for s in steps if "update_actor" in s.phases]
    actor_devices, epochs = _role_devices(recipe, "actor"), recipe.actor.ppo_epochs
    table.add_row(
        "trained (prompt + response tokens)", statistics.mean(s.total_tokens for s in steps),
        statistics.median(s.total_tokens / s.seconds / devices for s in steps),
        statistics.median(s.total_tokens * epochs / s.phases["update_actor"] / actor_devices for s in update)
        if update else None,
        f"update_actor (x {epochs} epochs)", actor_devices,
    )


def _critic_arch(recipe: Recipe):
    path = recipe.critic.model_path if recipe.critic is not None else None
    return arch_from_hf(read_hf_config(path, key="critic.model_path") if path else recipe.model.hf_config())


def _mfu_table(report: Report, recipe: Recipe, steps: list[StepFigures], peak: Peak) -> None:
    table = report.add_table("model FLOPs utilisation", [
        Column("phase"), Column("passes"), Column("model FLOPs per step", "TFLOP", ".4g"),
        Column("median", "s", ".3f"), Column("devices", "", "d"), Column("achieved", "TFLOP/s/device", ".4g"),
        Column("MFU", "%", ".2f"),
    ])
    actor_arch = arch_from_hf(recipe.model.hf_config())
    rows = recipe.data.train_batch_size * recipe.rollout.n
    all_flops = all_device_seconds = 0.0
    for phase, (role, backward) in TRAINING_PHASES.items():
        timed = [s for s in steps if phase in s.phases]
        if not timed:
            continue
        critic = role == "critic"
        arch = _critic_arch(recipe) if critic else actor_arch
        epochs = (recipe.critic.ppo_epochs if critic else recipe.actor.ppo_epochs) if backward else 1
        flops = [epochs * s.total_tokens * flops_per_token(arch, seq_len=s.total_tokens / rows, backward=backward,
                                                           value_head=critic) for s in timed]
        devices = _role_devices(recipe, role)
        seconds = sum(s.phases[phase] for s in timed)
        all_flops += sum(flops)
        all_device_seconds += seconds * devices
        achieved = sum(flops) / (seconds * devices) / 1e12
        passes = f"{epochs} x fwd+bwd" if backward else "fwd"
        table.add_row(phase, passes, statistics.mean(flops) / 1e12, statistics.median(s.phases[phase] for s in timed),
                      devices, achieved, 100 * achieved / peak.tflops)
    if all_device_seconds:
        achieved = all_flops / all_device_seconds / 1e12
        table.add_row("training phases", "", all_flops / len(steps) / 1e12, None, None, achieved,
                      100 * achieved / peak.tflops)


def _weight_sync_table(report: Report, records: list[dict], bound: Bound) -> None:
    synced = [r for r in records if "weight_sync/seconds" in r]
    if not synced:
        return
    gb = statistics.median(r["weight_sync/bytes"] for r in synced) / 1e9
    bound_gbps = gb / bound.seconds
    table = report.add_table("weight sync", [
        Column("measured"), Column("median", "s", ".4f"), Column("min", "s", ".4f"), Column("max", "s", ".4f"),
        Column("rate", "GB/s", ".3f"), Column("bound"), Column("bound rate", "GB/s", ".3f"),
        Column("ratio to bound", "x", ".1f"),
    ])
    for label, key in (("update_weights phase (controller)", "timing_s/update_weights"),
                       ("transport session (trainer rank 0)", "weight_sync/seconds")):
        values = [r[key] for r in synced if key in r]
        if values:
            median = statistics.median(values)
            table.add_row(label, median, min(values), max(values), gb / median, bound.name, bound_gbps,
                          median / bound.seconds)


def _memory_table(report: Report, recipe: Recipe, records: list[dict]) -> None:
    roles = sorted({key[len(MEMORY_PREFIX):] for r in records for key in r if key.startswith(MEMORY_PREFIX)})
    if not roles:
        return
    what = "device memory" if recipe.placement.device == "cuda" else "resident memory of the process"
    table = report.add_table("peak memory", [Column("role"), Column("peak", "GB", ".3f"), Column("measures")])
    for role in roles:
        table.add_row(role, max(r[MEMORY_PREFIX + role] for r in records if MEMORY_PREFIX + role in r), what)


def _overhead_table(report: Report, steps: list[StepFigures]) -> None:
    table = report.add_table("controller overhead", [
        Column("overhead"), Column("median", "s", ".4f"), Column("max", "s", ".4f"),
        Column("median share of step", "%", ".2f"), Column("max share of step", "%", ".2f"),
        Column("budget", "%", ".0f"), Column("within budget"),
    ])
    figures = {OUTSIDE: [s.outside for s in steps], "Batch operations": [s.batch_ops for s in steps]}
    for name, values in figures.items():
        shares = [100 * value / s.seconds for value, s in zip(values, steps)]
        budget = OVERHEAD_BUDGET_PCT[name]
        table.add_row(name, statistics.median(values), max(values), statistics.median(shares), max(shares), budget,
                      statistics.median(shares) < budget)
    between = [s.between for s in steps if s.between is not None]
    if between:
        shares = [100 * s.between / s.seconds for s in steps if s.between is not None]
        table.add_row("between steps", statistics.median(between), max(between), statistics.median(shares),
                      max(shares), None, None)


def _steps_table(report: Report, steps: list[StepFigures]) -> None:
    table = report.add_table("steps", [
        Column("step", "", "d"), Column("step time", "s", ".3f"), Column("gen", "s", ".3f"),
        Column("training phases", "s", ".3f"), Column(OUTSIDE, "s", ".4f"), Column("Batch operations", "s", ".4f"),
        Column("generated", "tokens", ".0f"), Column("trained", "tokens", ".0f"),
    ])
    for s in steps:
        training = sum(s.phases.get(phase, 0.0) for phase in TRAINING_PHASES)
        table.add_row(s.step, s.seconds, s.phases.get("gen"), training, s.outside, s.batch_ops, s.response_tokens,
                      s.total_tokens)


def _notes(recipe: Recipe, devices: int, peak: Peak) -> list[str]:
    transport = recipe.weight_sync.transport
    return [
        f"tokens/s/device 'over the step' is NeMo-RL's definition: the tokens of one step divided by the step time "
        f"(timing_s/step) and by every device of the run ({devices}); 'trained' counts prompt + response tokens "
        "(perf/total_num_tokens, what perf/throughput reports), 'generated' response tokens only. 'Over its phase' "
        "divides by that phase's time and its role's devices instead (trained: x ppo_epochs over update_actor).",
        f"MFU = model FLOPs / (phase seconds x devices x peak); {FORMULA}; peak {peak.tflops:.4g} TFLOP/s per "
        f"device ({peak.source}).",
        f"weight-sync bound for the {transport!r} transport: {WEIGHT_SYNC_TRANSPORTS.get(transport).bound.name} of "
        "the synced bytes (the bound its registry entry carries), measured "
        "after the steps in the same run; the rate is bytes / median seconds.",
        f"controller overhead: '{OUTSIDE}' = timing_s/step minus the sum of the phases above (budget "
        f"{OVERHEAD_BUDGET_PCT[OUTSIDE]:g}% of the step); 'Batch operations' = the controller's time in Batch methods "
        f"during Trainer.step, inside phases or not (perf/batch_ops_s; budget "
        f"{OVERHEAD_BUDGET_PCT['Batch operations']:g}%); 'between steps' = the wall time from one step's metrics "
        "record to the next one's, less the step (loading the batch, logging), outside timing_s/step.",
        f"not among the phases: {', '.join(OVERLAPPED_TIMINGS)}, the busy time of work overlapped with another "
        "phase (reward scoring runs while generation goes on); its wait after generation is 'reward'.",
    ]
