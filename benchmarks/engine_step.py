"""Benchmark: one actor PPO step (forward + backward + optimizer) and one log-prob pass of
the Megatron PolicyEngine on CPU, per parallel layout, with and without packing.

Two gloo ranks (OMP_NUM_THREADS=1 each) run TP1 (so DP2), TP2 and PP2 in turn, each in
fresh processes so the peak RSS per rank belongs to that layout. The batch is
GSM8K-like: prompts of 40-90 tokens, responses lognormal around 150 tokens clipped to
50-400, left-padded prompts + right-padded responses as the controller builds them.
Fixed micro-batching computes every padded row; dynamic micro-batching packs the real
tokens into rows of at most `--max-tokens`. The table gives real tokens/s, the share
of computed token slots that were padding, the step time saved by packing, and peak
RSS per rank, dated and with versions.

    python benchmarks/engine_step.py                      # ~2-4 min on 2 cores
    python benchmarks/engine_step.py --rows 32 --steps 3 --hidden 256 --layers 8
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

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
        "num_key_value_heads": max(1, args.hidden // 64),
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
    loss = PolicyLossSettings(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean",
                              entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl")
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


def main() -> None:
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
    args = parser.parse_args()

    import megatron.core
    import transformers

    print(f"# megarl engine step benchmark, {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(
        f"# python {platform.python_version()}, torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
        f"transformers {transformers.__version__}, {platform.machine()} x{os.cpu_count()} cores, "
        f"{WORLD_SIZE} gloo ranks, OMP_NUM_THREADS=1"
    )
    print(f"# model {json.dumps(hf_config(args))}")
    print(
        f"# batch: {args.rows} GSM8K-like rows, micro_batch_size={args.micro_batch_size}, "
        f"max_tokens_per_microbatch={args.max_tokens}, median of {args.steps} after a warm-up"
    )
    header = (
        f"{'layout':<10} {'mode':<7} {'mbs':>4} {'step s':>7} {'tok/s fwd+bwd':>14} {'tok/s fwd':>10} "
        f"{'padding':>8} {'time saved':>11} {'peak RSS/rank MiB':>18}"
    )
    print(header)
    print("-" * len(header))
    for name, layout in LAYOUTS.items():
        ranks = run_layout(layout, args)
        fixed = summarise(ranks, "fixed")
        rss = "/".join(f"{r['peak_rss_mib']:.0f}" for r in ranks)
        for mode in ("fixed", "packed"):
            row = summarise(ranks, mode)
            saved = f"{1 - row['step_s'] / fixed['step_s']:>10.0%}" if mode == "packed" else f"{'':>10}"
            print(
                f"{name:<10} {mode:<7} {row['micro_batches']:>4} {row['step_s']:>7.2f} {row['tokens_per_s']:>14.0f} "
                f"{row['fwd_tokens_per_s']:>10.0f} {row['padding']:>8.1%} {saved:>11} {rss:>18}"
            )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
