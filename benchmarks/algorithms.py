"""Benchmark: controller overhead of the algorithm core, against a memcpy and against per-sample Python loops.

On a batch of `--samples` responses of `--tokens` tokens (default 16384 x 4096,
float32, on `--threads` 2 threads), it times:

1. The advantage estimators GAE (compiled numba scan, and its pure-torch
   fallback) and GRPO next to a memcpy of the same bytes measured in the same
   run: every input tensor the estimator reads, cloned into fresh memory (the
   estimator's outputs are fresh memory too). The ratio estimator / memcpy is
   the figure with a target: GAE within 3x, GRPO within 2x. The float32 results
   are checked against float64 runs of the same batch (within 1e-5) first.
2. GAE, GRPO and the `megarl.protocol.Batch` operations of one RL step
   (repeat, union, index, chunk, concat, balanced_permutation), each next to a
   plain per-sample loop doing the same job.

    python benchmarks/algorithms.py --out results/          # 16384 x 4096 (3.8 GB peak RSS, ~2 min)
    python benchmarks/algorithms.py --samples 1024 --tokens 512

The loops over tokens (GAE, GRPO) would walk 67M tokens in Python at full
size, so they run on `--loop-samples` rows and are extrapolated linearly; the
table says so. Before timing, each loop's output is checked against the
vectorised function on those rows, so both sides provably do the same job.
The report (printed, and with `--out DIR` written as DIR/algorithms.json and
.md) has the date, machine, versions and settings.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from unittest import mock

import numpy as np
import torch

from megarl.algorithms import _scan
from megarl.algorithms.advantages import gae, grpo
from megarl.bench import Column, Report
from megarl.protocol import Batch, balanced_permutation

GAMMA, LAM, EPSILON = 1.0, 0.95, 1e-6
TOLERANCE = 1e-5  # max abs difference of the float32 results to float64 runs of the same batch
TARGETS = {"gae": 3.0, "grpo": 2.0}  # estimator seconds / memcpy seconds of the same bytes


@dataclass
class Result:
    name: str
    fast_s: float
    loop_s: float
    note: str = ""


def seconds_once(fn: Callable[[], object]) -> float:
    """Wall time of one `fn()`; its result is dropped at once to cap memory."""
    gc.collect()
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    del result
    return elapsed


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `fn()` after one untimed warm-up."""
    fn()
    return statistics.median(seconds_once(fn) for _ in range(repeats))


def paired_median_seconds(
    first: Callable[[], object], second: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Median wall times of two functions timed alternately (after a warm-up of each), so that a change
    in the load of a shared machine hits both alike and their ratio stays meaningful."""
    first(), second()
    times = [(seconds_once(first), seconds_once(second)) for _ in range(repeats)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


# ---------------------------------------------------------------- inputs


def make_rollout(samples: int, tokens: int, group_size: int, seed: int = 0) -> dict[str, object]:
    """Left-aligned responses of random length, an outcome reward on the last token, critic values."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, tokens + 1, (samples,), generator=gen)
    mask = torch.arange(tokens)[None] < lengths[:, None]  # bool: 1/4 the memory of float32
    rewards = torch.zeros(samples, tokens)
    rewards[torch.arange(samples), lengths - 1] = torch.randint(0, 2, (samples,), generator=gen).float()
    values = torch.randn(samples, tokens, generator=gen)
    uids = np.array([f"uid-{i // group_size}" for i in range(samples)], dtype=object)
    return {"rewards": rewards, "values": values, "mask": mask, "uid": uids, "lengths": lengths}


# ---------------------------------------------------------------- naive baselines


def gae_loop(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE one sample and one token at a time in Python floats, then a Python whitening pass."""
    raw, returns = [], []
    for r_row, v_row, m_row in zip(rewards.tolist(), values.tolist(), mask.tolist()):
        next_value, running = 0.0, 0.0
        adv_row = [0.0] * len(r_row)
        for t in range(len(r_row) - 1, -1, -1):
            if m_row[t]:
                running = r_row[t] + GAMMA * next_value - v_row[t] + GAMMA * LAM * running
                next_value = v_row[t]
            adv_row[t] = running
        raw.append(adv_row)
        returns.append([a + v for a, v in zip(adv_row, v_row)])
    mask_rows = mask.tolist()
    valid = [a for a_row, m_row in zip(raw, mask_rows) for a, m in zip(a_row, m_row) if m]
    mean = sum(valid) / len(valid)
    scale = (sum((a - mean) ** 2 for a in valid) / (len(valid) - 1) + 1e-8) ** -0.5
    whitened = [
        [(a - mean) * scale if m else 0.0 for a, m in zip(a_row, m_row)] for a_row, m_row in zip(raw, mask_rows)
    ]
    return torch.tensor(whitened), torch.tensor(returns)


def group_stats(scores: list, uids: np.ndarray) -> dict[object, tuple[float, float]]:
    """uid -> (mean, unbiased std) from a dict of lists; a group of one gets (0, 1)."""
    groups: dict[object, list] = defaultdict(list)
    for score, uid in zip(scores, uids):
        groups[uid].append(score)
    return {
        uid: (0.0, 1.0) if len(members) == 1 else (statistics.fmean(members), statistics.stdev(members))
        for uid, members in groups.items()
    }


def grpo_python_loop(rewards: torch.Tensor, mask: torch.Tensor, uids: np.ndarray) -> torch.Tensor:
    """GRPO in plain Python, like `gae_loop`: per-sample scores, dict-of-lists stats, per-token broadcast."""
    scores = [sum(row) for row in rewards.tolist()]
    stats = group_stats(scores, uids)
    advantages = []
    for score, uid, m_row in zip(scores, uids, mask.tolist()):
        mean, std = stats[uid]
        value = (score - mean) / (std + EPSILON)
        advantages.append([value if m else 0.0 for m in m_row])
    return torch.tensor(advantages)


def grpo_row_loop(rewards: torch.Tensor, mask: torch.Tensor, uids: np.ndarray) -> torch.Tensor:
    """GRPO one sample at a time with torch row ops: a row sum per sample, a row broadcast per sample."""
    scores = [rewards[i].sum().item() for i in range(len(uids))]
    stats = group_stats(scores, uids)
    advantages = torch.empty(rewards.shape)
    for i, uid in enumerate(uids):
        mean, std = stats[uid]
        advantages[i] = mask[i] * ((scores[i] - mean) / (std + EPSILON))
    return advantages


def stack_rows(rows: dict[str, list]) -> dict[str, object]:
    """Per-key lists of rows -> columns (tensors stacked, everything else an object array)."""
    columns = {}
    for key, items in rows.items():
        if isinstance(items[0], torch.Tensor):
            columns[key] = torch.stack(items)
        else:
            columns[key] = np.empty(len(items), dtype=object)
            columns[key][:] = items
    return columns


def rows_loop(columns: dict[str, object], order) -> dict[str, object]:
    """Gather rows `order` one sample at a time (the loop behind repeat/index/chunk/concat)."""
    rows: dict[str, list] = defaultdict(list)
    for i in order:
        for key, column in columns.items():
            rows[key].append(column[i])
    return stack_rows(rows)


def union_loop(left: dict[str, object], right: dict[str, object]) -> dict[str, object]:
    """Merge two sample lists record by record, checking shared keys agree per sample."""
    rows: dict[str, list] = defaultdict(list)
    for i in range(len(next(iter(left.values())))):
        record = {key: column[i] for key, column in left.items()}
        for key, column in right.items():
            if key in record and record[key] != column[i]:
                raise ValueError(f"union: {key!r} differs at row {i}")
            record[key] = column[i]
        for key, value in record.items():
            rows[key].append(value)
    return stack_rows(rows)


def balance_loop(counts: list[int], world_size: int) -> np.ndarray:
    """Greedy: heaviest sample first, onto the lightest rank that still has room."""
    per_rank = len(counts) // world_size
    loads, members = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(counts)), key=lambda j: -counts[j]):
        rank = min((r for r in range(world_size) if len(members[r]) < per_rank), key=lambda r: loads[r])
        loads[rank] += counts[i]
        members[rank].append(i)
    return np.array([i for rank in members for i in sorted(rank)])


def spread(counts: np.ndarray, perm: np.ndarray, world_size: int) -> float:
    """(max - min) / mean of the per-rank token sums after cutting counts[perm] into chunks."""
    sums = counts[perm].reshape(world_size, -1).sum(-1)
    return float((sums.max() - sums.min()) / sums.mean())


# ---------------------------------------------------------------- runs


@contextlib.contextmanager
def pure_torch() -> Iterator[None]:
    """Run the estimators on their pure-torch fallback, as on a machine without numba."""
    with mock.patch.object(_scan, "available", lambda *tensors: False):
        yield


def max_abs_error(result: torch.Tensor, reference: torch.Tensor, where: torch.Tensor | None = None) -> float:
    difference = (result.double() - reference).abs()
    return float((difference if where is None else difference[where]).max())


def check_accuracy(data: dict) -> list[tuple[str, float]]:
    """(check, max abs error) of the float32 estimators against float64 runs of the whole batch.

    The float64 reference is the compiled scan in float64, which the tests hold
    to a per-sample Python loop within 1e-10. Returns are compared on response
    tokens only (elsewhere they carry values by convention).
    """
    rewards, values, mask, uids = data["rewards"], data["values"], data["mask"], data["uid"]
    adv64, ret64 = gae(rewards.double(), values.double(), mask, gamma=GAMMA, lam=LAM)
    checks = []
    for label, context in (("compiled scan", contextlib.nullcontext()), ("pure-torch fallback", pure_torch())):
        with context:
            advantages, returns = gae(rewards, values, mask, gamma=GAMMA, lam=LAM)
        checks.append((f"gae advantages ({label})", max_abs_error(advantages, adv64)))
        checks.append((f"gae returns ({label})", max_abs_error(returns, ret64, mask)))
        del advantages, returns
    del adv64, ret64
    reference = grpo(rewards.double(), mask, uids, epsilon=EPSILON)[0]
    checks.append(("grpo advantages", max_abs_error(grpo(rewards, mask, uids, epsilon=EPSILON)[0], reference)))
    return checks


def bench_overhead(data: dict, args: argparse.Namespace) -> list[tuple[str, str, float, float, float]]:
    """(row, estimator, seconds, memcpy seconds, warm-copy seconds) for GAE (compiled, fallback) and GRPO.

    memcpy: every input the estimator reads cloned into fresh memory, timed in
    turn with the estimator; warm copy: the same bytes copied into memory
    already touched, i.e. without the page faults that fresh outputs cost.
    """
    rewards, values, mask, uids = data["rewards"], data["values"], data["mask"], data["uid"]

    def measure(row: str, estimator: str, run: Callable[[], object], inputs: tuple[torch.Tensor, ...]) -> tuple:
        seconds, memcpy_s = paired_median_seconds(run, lambda: [t.clone() for t in inputs], args.repeats)
        targets = [torch.empty_like(t) for t in inputs]
        warm_s = median_seconds(lambda: [dst.copy_(src) for dst, src in zip(targets, inputs)], args.repeats)
        return row, estimator, seconds, memcpy_s, warm_s

    def run_gae() -> tuple[torch.Tensor, torch.Tensor]:
        return gae(rewards, values, mask, gamma=GAMMA, lam=LAM)

    rows = [measure("gae (compiled scan)", "gae", run_gae, (rewards, values, mask))]
    with pure_torch():
        rows.append(measure("gae (pure-torch fallback)", "gae", run_gae, (rewards, values, mask)))
    rows.append(measure("grpo", "grpo", lambda: grpo(rewards, mask, uids, epsilon=EPSILON), (rewards, mask)))
    return rows


def bench_advantages(data: dict, args: argparse.Namespace, gae_s: float, grpo_s: float) -> list[Result]:
    """GAE and GRPO loops against the vectorised times already measured (`gae_s`, `grpo_s`)."""
    rewards, values, mask, uids = data["rewards"], data["values"], data["mask"], data["uid"]
    rows = min(args.loop_samples, args.samples)
    scale = args.samples / rows
    note = f"loop timed on {rows} samples, x{scale:g} (linear)" if rows < args.samples else ""

    sub = slice(0, rows)
    torch.testing.assert_close(
        gae_loop(rewards[sub], values[sub], mask[sub]),
        gae(rewards[sub], values[sub], mask[sub], gamma=GAMMA, lam=LAM),
        rtol=TOLERANCE,
        atol=TOLERANCE,
    )
    grpo_reference = grpo(rewards[sub], mask[sub], uids[sub], epsilon=EPSILON)[0]
    torch.testing.assert_close(grpo_python_loop(rewards[sub], mask[sub], uids[sub]), grpo_reference)
    torch.testing.assert_close(grpo_row_loop(rewards[sub], mask[sub], uids[sub]), grpo_reference)

    loop = median_seconds(lambda: gae_loop(rewards[sub], values[sub], mask[sub]), args.repeats)
    results = [Result("gae", gae_s, loop * scale, f"Python loop over tokens; {note}")]
    loop = median_seconds(lambda: grpo_python_loop(rewards[sub], mask[sub], uids[sub]), args.repeats)
    results.append(Result("grpo (Python loop)", grpo_s, loop * scale, f"Python loop over tokens; {note}"))
    loop = median_seconds(lambda: grpo_row_loop(rewards, mask, uids), args.repeats)
    results.append(Result("grpo (torch row loop)", grpo_s, loop, "loop of torch row ops (output write bound)"))
    return results


def bench_batch(data: dict, args: argparse.Namespace) -> list[Result]:
    samples, n, world = args.samples, args.group_size, args.world_size
    gen = torch.Generator().manual_seed(1)
    generated = Batch.from_dict(
        {
            "uid": data["uid"],
            "responses": torch.randint(0, 150_000, (samples, args.tokens), generator=gen),
            "response_mask": data["mask"],
            "old_log_probs": data["values"],
        }
    )
    main = Batch.from_dict({"uid": data["uid"], "data_source": np.array(["openai/gsm8k"] * samples, dtype=object)})
    prompts = generated[np.arange(0, samples, n)]
    chunks = generated.chunk(world)
    order = np.random.default_rng(0).permutation(samples)
    bounds = np.linspace(0, samples, world + 1).astype(int)

    def cols(batch: Batch) -> dict[str, object]:
        return {key: batch[key] for key in batch.keys()}

    main_cols, gen_cols, prompt_cols = cols(main), cols(generated), cols(prompts)
    chunk_cols = [cols(chunk) for chunk in chunks]
    cases = [
        (
            "Batch.repeat",
            lambda: prompts.repeat(n, interleave=True),
            lambda: rows_loop(prompt_cols, (i for i in range(len(prompts)) for _ in range(n))),
            f"{len(prompts)} prompts x {n}, interleaved",
        ),
        ("Batch.union", lambda: main.union(generated), lambda: union_loop(main_cols, gen_cols), "shared uid checked"),
        ("Batch[idx]", lambda: generated[order], lambda: rows_loop(gen_cols, order), "random permutation"),
        (
            "Batch.chunk",
            lambda: generated.chunk(world),
            lambda: [rows_loop(gen_cols, range(lo, hi)) for lo, hi in zip(bounds[:-1], bounds[1:])],
            f"{world} chunks (views vs copies)",
        ),
        (
            "Batch.concat",
            lambda: Batch.concat(chunks),
            lambda: stack_rows({key: [row for c in chunk_cols for row in c[key]] for key in gen_cols}),
            f"{world} chunks",
        ),
    ]
    counts = data["lengths"].numpy().astype(np.int64)
    fast_spread = spread(counts, balanced_permutation(counts, world), world)
    greedy_spread = spread(counts, balance_loop(counts.tolist(), world), world)
    cases.append(
        (
            "balanced_permutation",
            lambda: balanced_permutation(counts, world),
            lambda: balance_loop(counts.tolist(), world),
            f"rank token spread {fast_spread:.1e} vs greedy loop {greedy_spread:.1e}",
        )
    )
    return [
        Result(name, median_seconds(fast, args.repeats), median_seconds(loop, args.repeats), note)
        for name, fast, loop, note in cases
    ]


def build_report(args: argparse.Namespace, accuracy: list, overhead: list, loops: list[Result]) -> Report:
    report = Report.create(
        "algorithms",
        {**{k: v for k, v in vars(args).items() if k != "out"}, "dtype": "float32",
         "compiled_scan": _scan.available(torch.zeros(1))},
        extra_packages=("numba", "numpy"),
    )
    table = report.add_table(
        "estimators vs memcpy of the same bytes",
        [Column("estimator"), Column("time", "s", ".3f"), Column("memcpy", "s", ".3f"), Column("ratio", "x", ".2f"),
         Column("target", "x", ".0f"), Column("warm copy", "s", ".3f"), Column("ratio to warm copy", "x", ".2f")],
    )
    for row, estimator, seconds, memcpy_s, warm_s in overhead:
        target = TARGETS[estimator] if "fallback" not in row else None
        table.add_row(row, seconds, memcpy_s, seconds / memcpy_s, target, warm_s, seconds / warm_s)
    table = report.add_table(
        "accuracy against float64", [Column("result"), Column("max abs error", "", ".1e"), Column("within 1e-5")]
    )
    for check, error in accuracy:
        table.add_row(check, error, error <= TOLERANCE)
    table = report.add_table(
        "vectorised vs per-sample loop",
        [Column("operation"), Column("vectorised", "s", ".3f"), Column("per-sample loop", "s", ".3f"),
         Column("speed-up", "x", ".1f"), Column("note")],
    )
    for r in loops:
        table.add_row(r.name, r.fast_s, r.loop_s, r.loop_s / r.fast_s, r.note)
    report.notes += [
        "memcpy: every input tensor the estimator reads (GAE: rewards, values, mask; GRPO: rewards, mask) cloned "
        "into fresh memory, median of the same number of runs as the estimator, in the same process. The "
        "estimators write fresh output tensors too, so both pay the page faults of new memory; 'warm copy' is the "
        "same copy into memory already touched, for scale.",
        "The vectorised times are bound by memory traffic: every [samples, tokens] float32 output is freshly "
        "allocated memory that must be page-faulted in, which costs more than the arithmetic. A loop of torch row "
        "ops pays that same output cost plus Python dispatch per sample, so its gap to the vectorised code is "
        "smaller than the gap of a loop over tokens.",
    ]
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=16384, help="responses in the batch")
    parser.add_argument("--tokens", type=int, default=4096, help="response window length")
    parser.add_argument("--threads", type=int, default=2, help="torch (and compiled scan) threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--group-size", type=int, default=16, help="responses per prompt (rollout.n)")
    parser.add_argument("--world-size", type=int, default=8, help="data-parallel ranks for chunk/balance")
    parser.add_argument("--loop-samples", type=int, default=128, help="rows the GAE Python loop is timed on")
    parser.add_argument("--out", default=None, help="also write the report as OUT/algorithms.json and .md")
    args = parser.parse_args(argv)
    if args.samples % args.group_size or args.samples % args.world_size:
        parser.error("--samples must be divisible by --group-size and --world-size")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = make_rollout(args.samples, args.tokens, args.group_size)
    accuracy = check_accuracy(data)
    overhead = bench_overhead(data, args)
    seconds = {row: row_seconds for row, _, row_seconds, _, _ in overhead}
    loops = bench_advantages(data, args, seconds["gae (compiled scan)"], seconds["grpo"]) + bench_batch(data, args)
    report = build_report(args, accuracy, overhead, loops)
    print(report.to_markdown())
    if args.out:
        for path in report.write(args.out):
            print(f"wrote {path}")
    failed = [check for check, error in accuracy if error > TOLERANCE]
    if failed:
        print(f"accuracy: over {TOLERANCE:g} against float64: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
