"""Benchmark: what a colocated trainer leaves on the device when the rollout fleet starts, old order against new.

SGLang sizes its KV cache once, at start-up, from the memory free on the device when it
starts (F): `pool = mem_fraction x F - its weights` (0.5.23,
`mem_cache/kv_cache_configurator.py`; `megarl.plan.kv_cache.pool_bytes`). megarl used to start the fleet while the engines
still held their weights, gradient buffers, fp32 main weights and Adam moments; now
every engine is offloaded first (`MemoryCycle.sleep_all`), so the fleet sees the whole
device.

Measured here, on one rank (TP1, gloo, CPU): a bf16 policy engine with its optimizer
(default hidden 1024, 12 layers, ffn 2816, vocab 32000: 0.2B parameters) after one SFT
step (so Adam's moments exist). Per kind of memory, the bytes of the engine's tensors
that sit on its device until offloaded (on a GPU all of it leaves with `offload`); and
the process's resident memory before and after `offload(weights=True)` (on CPU the
host is the device, so only the gradient buffers, which offload frees, leave: that is
what CPU RSS can show of it). Then, with the bytes per parameter measured, the KV cache
SGLang's rule gives a server of a recipe (default: the GRPO Qwen3-8B recipe, TP4 x PP2
actor, a frozen reference, TP2 servers at mem_fraction 0.6) on a device of
`--device-gib`, in the old order and the new one.

    python benchmarks/fleet_start_memory.py
    python benchmarks/fleet_start_memory.py --hidden 512 --layers 4 --ffn 1408   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync import add_model_args, hf_config, run_processes  # noqa: E402

from megarl.config import load_recipe  # noqa: E402
from megarl.config.layout import resolve_layout  # noqa: E402
from megarl.models import arch_from_hf, hf_param_shapes  # noqa: E402
from megarl.ports import free_port  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml"


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def engine_rank(rank: int, port: int, config: dict, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from megarl.engines.distributed import destroy_distributed, init_distributed

    init_distributed(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, tp=1, pp=1)
    from megarl.config.settings import Batching, OptimizerSettings
    from megarl.engines.actor import PolicyEngine

    optimizer = OptimizerSettings(lr=1e-5, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, clip_grad=1.0,
                                  warmup_steps=0, schedule="constant", min_lr=0.0, total_steps=10)
    engine = PolicyEngine(hf_config=config, weights=None, seed=0, params_dtype="bfloat16", transformer_impl="local",
                          optimizer=optimizer)
    ids = torch.randint(0, config["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(ids)
    engine.sft_step({"input_ids": ids, "attention_mask": ones, "position_ids": ones.cumsum(-1) - 1,
                     "loss_mask": ones}, batching=Batching(1, None), lr=1e-5)
    params = [p for chunk in engine.model.chunks for p in chunk.parameters()]
    model_ids = {id(p) for p in params}
    optimizers = engine.train.torch_optimizers()
    kinds = {
        "weights (bf16)": _nbytes(params),
        "gradient buffers (fp32)": _nbytes(buffer.grad_data for ddp in engine.train.ddp_chunks
                                           for buffer in ddp.buffers),
        "fp32 main weights": _nbytes(p for opt in optimizers for group in opt.param_groups for p in group["params"]
                                     if id(p) not in model_ids),
        "Adam moments (fp32)": _nbytes(v for opt in optimizers for state in opt.state.values()
                                       for v in state.values() if torch.is_tensor(v) and v.dim() > 0),
    }
    before = _rss_mib()
    engine.offload(weights=True)
    result = {"parameters": sum(p.numel() for p in params), "kinds": kinds, "rss_before_mib": before,
              "rss_after_mib": _rss_mib()}
    Path(out).write_text(json.dumps(result))
    destroy_distributed()


def kv_cache_gib(*, device_gib: float, mem_fraction: float, server_weights_gib: float, trainer_gib: float) -> float:
    """SGLang's rule: `mem_fraction` of what the trainer leaves free, less the server's weights."""
    return mem_fraction * (device_gib - trainer_gib) - server_weights_gib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=1024, layers=12, ffn=2816)
    parser.add_argument("--recipe", default=str(RECIPE), help="the recipe whose servers' KV cache is computed")
    parser.add_argument("--device-gib", type=float, default=140.0, help="device memory (an H200: about 140 GiB)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    workdir = Path(tempfile.mkdtemp(prefix="megarl-bench-fleet-start-"))
    try:
        run_processes(engine_rank, [(0, free_port(), hf_config(args), str(workdir / "engine.json"))], 3600)
        measured = json.loads((workdir / "engine.json").read_text())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    params, kinds = measured["parameters"], measured["kinds"]
    total = sum(kinds.values())
    print(f"# the trainer's device memory when the fleet starts: one bf16 policy rank with Adam, "
          f"{params / 1e9:.2f}B parameters, torch {torch.__version__}")
    print()
    print("| memory | bytes / parameter | MiB | on the device at fleet start: old | new |")
    print("|---|---:|---:|---:|---:|")
    for kind, nbytes in kinds.items():
        print(f"| {kind} | {nbytes / params:.1f} | {nbytes / 2**20:.0f} | {nbytes / 2**20:.0f} | 0 |")
    print(f"| total | {total / params:.1f} | {total / 2**20:.0f} | {total / 2**20:.0f} | 0 |")
    print()
    print(f"CPU resident memory of the rank (host = device here): {measured['rss_before_mib']:.0f} MiB before "
          f"offload, {measured['rss_after_mib']:.0f} MiB after (the gradient buffers are freed)")

    recipe = load_recipe(args.recipe)
    layout = resolve_layout(recipe)
    model_params = sum(math.prod(shape) for shape in hf_param_shapes(arch_from_hf(recipe.model.hf_config())).values())
    actor = layout["actor"]
    trainer = model_params / (actor.tp * actor.pp) * total / params  # the actor, as measured per parameter
    if "reference" in layout:
        reference = layout["reference"]
        trainer += model_params / (reference.tp * reference.pp) * 2  # frozen bf16 weights only
    server_weights = model_params * 2 / recipe.rollout.tp
    old = kv_cache_gib(device_gib=args.device_gib, mem_fraction=recipe.rollout.mem_fraction,
                       server_weights_gib=server_weights / 2**30, trainer_gib=trainer / 2**30)
    new = kv_cache_gib(device_gib=args.device_gib, mem_fraction=recipe.rollout.mem_fraction,
                       server_weights_gib=server_weights / 2**30, trainer_gib=0.0)
    print()
    print(f"{recipe.name}: {model_params / 1e9:.2f}B parameters; per device the trainer holds "
          f"{trainer / 2**30:.1f} GiB until offloaded, a TP{recipe.rollout.tp} server's weights take "
          f"{server_weights / 2**30:.1f} GiB; {args.device_gib:g} GiB devices, mem_fraction "
          f"{recipe.rollout.mem_fraction:g}")
    print()
    print("| fleet starts | KV cache per device (GiB) |")
    print("|---|---:|")
    print(f"| with the engines on the device (old) | {old:.1f}{' (SGLang refuses to start)' if old <= 0 else ''} |")
    print(f"| after the engines are offloaded (new) | {new:.1f} |")


if __name__ == "__main__":
    main()
