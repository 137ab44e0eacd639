"""Benchmark: one actor PPO step (forward + backward + optimizer) and one log-prob pass of
the Megatron PolicyEngine on CPU, per parallel layout, with and without packing.

Two gloo ranks (OMP_NUM_THREADS=1 each) run TP1 (so DP2), TP2 and PP2 in turn, each in
fresh processes so the peak RSS per rank belongs to that layout. The batch is
GSM8K-like: prompts of 40-90 tokens, responses lognormal around 150 tokens clipped to
50-400, left-padded prompts + right-padded responses as the controller builds them.
Fixed micro-batching computes every padded row; dynamic micro-batching packs the real
tokens into rows of at most `--max-tokens`. The table gives real tokens/s, the share
of computed token slots that were padding, the step time saved by packing, and peak
RSS per rank; the report (printed, and with `--out DIR` written as
DIR/engine_step.json and .md) has the date, machine, versions and settings.

    python benchmarks/engine_step.py --out results/       # ~2-4 min on 2 cores
    python benchmarks/engine_step.py --rows 32 --steps 3 --hidden 256 --layers 8
    python benchmarks/engine_step.py --layouts tp2 --rows 4 --steps 1 --hidden 64 --layers 2   # seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from megarl.bench import Column, Report
from megarl.ports import free_port

LAYOUTS = {"tp1 (dp2)": dict(tp=1, pp=1), "tp2": dict(tp=2, pp=1), "pp2": dict(tp=1, pp=2)}
WORLD_SIZE = 2


def gsm8k_like_batch(rows: int, *, seed: int, vocab: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts (40-90 tokens) + right-padded lognormal responses (50-400 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(40, 91, (rows,), generator=gen)
    responses = torch.exp(math.log(150) + 0.6 * torch.randn(rows, generator=gen)).clamp(50, 400).long()
    prompt_width, response_width = int(prompts.max()), int(responses.max())
    columns = torch.arange(prompt_width + response_width)
    start = prompt_width - prompts
    mask = ((columns >= start[:, None]) & (columns < prompt_width + responses[:, None])).long()
    response_mask = mask[:, prompt_width:]
    return {
        "input_ids": torch.randint(0, vocab, mask.shape, generator=gen) * mask,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "old_log_probs": torch.full(response_mask.shape, -math.log(vocab)),
        "advantages": torch.randn(response_mask.shape, generator=gen),
    }


def hf_config(args: argparse.Namespace) -> dict:
    return {
        "model_type": "qwen2",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 11 // 4,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 32,
        "num_key_value_heads": max(2, args.hidden // 64),  # at least one KV group per rank of the tp2 layout
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
    }


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(rank: int, port: int, layout: dict, args: argparse.Namespace, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from megarl.config.settings import Batching, OptimizerSettings, PolicyLossSettings, PolicyUpdateSettings
    from megarl.engines.actor import PolicyEngine
    from megarl.engines.distributed import destroy_distributed, init_distributed
    from megarl.engines.schedule import make_micro_batches

    init_distributed(rank=rank, world_size=WORLD_SIZE, master_addr="127.0.0.1", master_port=port, **layout)
    optimizer = OptimizerSettings(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, clip_grad=1.0,
                                  warmup_steps=0, schedule="constant", min_lr=0.0, total_steps=args.steps)
    engine = PolicyEngine(hf_config=hf_config(args), weights=None, seed=0, params_dtype=None,
                          transformer_impl=args.transformer_impl, optimizer=optimizer)
    loss = PolicyLossSettings(policy_loss="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                              loss_agg_mode="token-mean", entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0,
                              kl_loss_type="low_var_kl")
    batch = gsm8k_like_batch(args.rows, seed=1, vocab=args.vocab)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    shard = {key: value.chunk(dp_size)[dp_rank] for key, value in batch.items()}
    inputs = {k: shard[k] for k in ("input_ids", "attention_mask", "position_ids")}
    result = {}
    for mode, max_tokens in (("fixed", None), ("packed", args.max_tokens)):
        micro = make_micro_batches(
            inputs, micro_batch_size=args.micro_batch_size, max_tokens_per_microbatch=max_tokens, num_chunks=1
        )
        real, computed = micro.token_counts()
        batching = Batching(args.micro_batch_size, max_tokens)
        update = PolicyUpdateSettings(epochs=1, mini_batch_size=len(shard["input_ids"]), batching=batching,
                                      shuffle=False, seed=0, temperature=1.0, loss=loss)
        rows = {**shard, "responses": shard["input_ids"][:, -shard["response_mask"].shape[1] :]}
        step = _median_seconds(lambda: engine.update(shard, update), args.steps)
        forward = _median_seconds(
            lambda: engine.compute_log_prob(rows, temperature=1.0, with_entropy=True, batching=batching), args.steps
        )
        result[mode] = {
            "real": real,
            "computed": computed,
            "micro_batches": len(micro),
            "step_s": step,
            "fwd_s": forward,
        }
    result["dp_rank"], result["is_output"] = dp_rank, parallel_state.get_tensor_model_parallel_rank() == 0 and (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    )
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    destroy_distributed()


def run_layout(layout: dict, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="megarl-bench-") as out_dir:
        mp.start_processes(
            _rank, args=(free_port(), layout, args, out_dir), nprocs=WORLD_SIZE, join=True, start_method="spawn"
        )
        return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def summarise(ranks: list[dict], mode: str) -> dict:
    """Totals over DP replicas (one output rank each); times are the slowest rank's."""
    replicas = [r[mode] for r in ranks if r["is_output"]]
    real = sum(r["real"] for r in replicas)
    computed = sum(r["computed"] for r in replicas)
    step = max(r[mode]["step_s"] for r in ranks)
    forward = max(r[mode]["fwd_s"] for r in ranks)
    return {
        "tokens_per_s": real / step,
        "fwd_tokens_per_s": real / forward,
        "padding": 1 - real / computed,
        "step_s": step,
        "micro_batches": max(r["micro_batches"] for r in replicas),
    }


def build_report(args: argparse.Namespace, measured: dict[str, list[dict]]) -> Report:
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    report = Report.create(
        "engine_step",
        {**settings, "model": hf_config(args), "world_size": WORLD_SIZE, "omp_num_threads": 1},
        extra_packages=("transformers",),
    )
    table = report.add_table(
        "actor step per layout",
        [Column("layout, mode"), Column("micro-batches"), Column("step", "s", ".2f"),
         Column("fwd+bwd", "tokens/s", ".0f"), Column("fwd", "tokens/s", ".0f"), Column("padding", "", ".1%"),
         Column("time saved by packing", "", ".0%")]
        + [Column(f"peak RSS rank {rank}", "MiB", ".0f") for rank in range(WORLD_SIZE)],
    )
    for name, ranks in measured.items():
        fixed = summarise(ranks, "fixed")
        for mode in ("fixed", "packed"):
            row = summarise(ranks, mode)
            saved = 1 - row["step_s"] / fixed["step_s"] if mode == "packed" else None
            table.add_row(f"{name}, {mode}", row["micro_batches"], row["step_s"], row["tokens_per_s"],
                          row["fwd_tokens_per_s"], row["padding"], saved, *(r["peak_rss_mib"] for r in ranks))
    report.notes.append(
        f"{WORLD_SIZE} gloo ranks, OMP_NUM_THREADS=1 each; {args.rows} GSM8K-like rows per step; median of "
        f"{args.steps} after a warm-up. Tokens/s count real tokens over the slowest rank's time; padding is the "
        "share of computed token slots that were padding."
    )
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="sequences per step (all DP ranks)")
    parser.add_argument("--steps", type=int, default=2, help="timed repetitions (median) after one warm-up")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--transformer-impl", default="auto", choices=("auto", "transformer_engine", "local"),
                        help="layer spec (as model.transformer_impl in a recipe)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="rows per fixed micro-batch")
    parser.add_argument("--max-tokens", type=int, default=2048, help="token budget of a packed micro-batch")
    short_names = {name.split()[0]: name for name in LAYOUTS}  # "tp1" -> "tp1 (dp2)"
    parser.add_argument("--layouts", default=",".join(short_names), help="comma-separated subset of the default")
    parser.add_argument("--out", default=None, help="also write the report as OUT/engine_step.json and .md")
    args = parser.parse_args(argv)
    unknown = [word for word in args.layouts.split(",") if word not in short_names]
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)}; known: {', '.join(short_names)}")
    layouts = [short_names[word] for word in args.layouts.split(",")]

    measured = {}
    for name in layouts:
        start = time.perf_counter()
        measured[name] = run_layout(LAYOUTS[name], args)
        print(f"{name}: measured in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    report = build_report(args, measured)
    print(report.to_markdown())
    if args.out:
        for path in report.write(args.out):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
