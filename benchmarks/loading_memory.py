"""Benchmark: host memory of loading an HF checkpoint into a TP2 x PP2 Megatron model, per rank.

A Llama-shaped model (default: hidden 2048, 16 layers, 16 heads, ffn 5632, vocab
32000, untied: 0.95B parameters, 1.9 GB in bf16) is written once as random bf16
safetensors to a temp dir (one tensor at a time, so the driver never holds it).
Four rank processes (gloo, TP2 x PP2) build their bf16 model chunks, then call
`megarl.engines.hf_weights.load_hf_weights` on the checkpoint dir. For every rank
the table gives its shard (the bytes of its parameters), its peak RSS during the
load above its RSS just before (the kernel's high-water mark, reset with
`/proc/self/clear_refs` before the load), that ratio, and the load time; the last
lines give the driver's RSS before and after. Target: every rank's peak extra RSS
at most 1.5x its own shard, the driver unchanged.

The ranks load one after another (a barrier between turns): loading needs no
communication, so each rank's figures are what they would be in a concurrent
load, and the machine only ever holds one rank's transient memory (the old full
copies of four ranks at once would not fit on 24 GB). A digest of every rank's
loaded shards (sum of float64 values of its parameters) is printed, so runs of
two versions of the loader can be checked to load the same weights.

    python benchmarks/loading_memory.py                          # ~0.95B, needs ~6 GB free
    python benchmarks/loading_memory.py --json new.json --baseline old.json   # side by side

`--baseline FILE` prints the figures of an earlier run (its `--json` output) next
to this one's; e.g. the loader of commit 4ec748d, measured with this script and
`PYTHONPATH` pointing at a checkout of that commit.

It also gives, per rank, how much of the checkpoint its load brought into the page
cache ("read MiB"): before each rank's turn the file's cached pages are dropped
(`POSIX_FADV_DONTNEED`; the file was synced after writing), after the load they are
counted (`mincore`). A rank whose reads are exact reads its own shard and no more
(a few pages of rounding per row); a rank that maps the file and slices columns
faults in whole rows of the row-parallel tensors (`o_proj`, `down_proj`), which at
TP2 is their other half too.

Measured on 2 shared cores (torch 2.13 CPU, megatron-core 0.16.1), default model:
every rank's shard is 455 MiB. The old loader (4ec748d: every rank reads the whole
checkpoint and builds the full Megatron state dict) peaked at 4549 MiB extra per
rank, 10.0x its shard; the slice reader at 479-489 MiB, 1.05-1.08x (the shard
itself plus at most one 64 MiB read block), with the same weights (equal digests).
The driver stayed at its start-up RSS in both.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync import add_model_args, hf_config, run_processes, write_checkpoint  # noqa: E402

from megarl.models import arch_from_hf, hf_param_shapes  # noqa: E402
from megarl.ports import free_port  # noqa: E402

TP, PP = 2, 2
TARGET = 1.5


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_peak_rss() -> None:
    # Writing 5 resets VmHWM (the peak RSS) to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def drop_cached_pages(path: str) -> None:
    """Evict the file's pages from the page cache (they are clean: the file was synced after writing)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_bytes(path: str) -> int:
    """Bytes of the file now in the page cache (mincore over a mapping that touches no page)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vector = (ctypes.c_ubyte * pages)()
        try:
            if libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(page & 1 for page in vector) * mmap.PAGESIZE


def load_rank(rank: int, port: int, config: dict, checkpoint: str, out: str) -> None:
    """One TP2 x PP2 rank: build the bf16 chunks, wait for its turn, load, record memory and a digest."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from megarl.engines.distributed import destroy_distributed, init_distributed

    init_distributed(rank=rank, world_size=TP * PP, master_addr="127.0.0.1", master_port=port, tp=TP, pp=PP)
    from megarl.engines import gpt, hf_weights

    build_kwargs = {"params_dtype": "bfloat16"}
    if "transformer_impl" in inspect.signature(gpt.build_gpt).parameters:  # absent in the old loader's commit
        build_kwargs["transformer_impl"] = "local"
    model = gpt.build_gpt(config, **build_kwargs)
    params = [p for chunk in model.chunks for p in chunk.parameters()]
    shard_bytes = sum(p.numel() * p.element_size() for p in params)
    result = {}
    for turn in range(TP * PP):
        torch.distributed.barrier()
        if turn != rank:
            continue
        files = sorted(str(path) for path in Path(checkpoint).glob("*.safetensors"))
        for file in files:
            drop_cached_pages(file)
        cached_before = sum(cached_bytes(file) for file in files)
        _reset_peak_rss()
        before = _status_kib("VmRSS")
        start = time.perf_counter()
        hf_weights.load_hf_weights(model, checkpoint)
        seconds = time.perf_counter() - start
        peak = _status_kib("VmHWM")
        result = {"rank": rank, "shard_bytes": shard_bytes, "rss_before_kib": before, "peak_kib": peak,
                  "after_kib": _status_kib("VmRSS"), "seconds": seconds,
                  "read_bytes": sum(cached_bytes(file) for file in files) - cached_before,
                  "digest": sum(float(p.detach().double().sum()) for p in params)}
    torch.distributed.barrier()
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=2048, layers=16, ffn=5632)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--baseline", default=None, help="an earlier run's --json output, shown side by side")
    parser.add_argument("--workdir", default=None, help="scratch dir (default: a temp dir, removed at the end)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    config = hf_config(args)
    params = sum(math.prod(shape) for shape in hf_param_shapes(arch_from_hf(config)).values())
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="megarl-bench-loading-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        write_checkpoint(config, workdir / "model")
        for file in (workdir / "model").glob("*.safetensors"):  # clean pages: each turn can drop them
            with open(file, "rb+") as handle:
                os.fsync(handle.fileno())
        driver_before = _status_kib("VmRSS")
        _reset_peak_rss()
        out = workdir / "rank"
        port = free_port()
        run_processes(load_rank, [(rank, port, config, str(workdir / "model"), str(out)) for rank in range(TP * PP)],
                      3600)
        ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(TP * PP)]
        driver = {"before_kib": driver_before, "after_kib": _status_kib("VmRSS"), "peak_kib": _status_kib("VmHWM")}
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    figures = {"params": params, "config": config, "ranks": ranks, "driver": driver}
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else None
    report(figures, baseline)


def _rank_cells(rank: dict) -> tuple[float, float, float, str]:
    extra_mb = (rank["peak_kib"] - rank["rss_before_kib"]) / 1024
    shard_mb = rank["shard_bytes"] / 2**20
    read = f"{rank['read_bytes'] / 2**20:.0f}" if "read_bytes" in rank else "-"  # runs before the figure existed
    return extra_mb, extra_mb / shard_mb, rank["seconds"], read


def report(figures: dict, baseline: dict | None) -> None:
    config, ranks, drv = figures["config"], figures["ranks"], figures["driver"]
    print(f"# loading memory: HF safetensors -> TP{TP} x PP{PP} Megatron (bf16), python {sys.version.split()[0]}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"model: llama hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, ffn "
          f"{config['intermediate_size']}, vocab {config['vocab_size']}: {figures['params'] / 1e9:.2f}B parameters, "
          f"{2 * figures['params'] / 2**30:.2f} GiB in bf16")
    print()
    old = " old extra MiB | old x shard | old read MiB | old s |" if baseline else ""
    print(f"| rank | shard MiB |{old} extra MiB | x shard | read MiB | s |")
    print("|---:|---:|" + ("---:|---:|---:|---:|" if baseline else "") + "---:|---:|---:|---:|")
    verdicts = []
    for index, rank in enumerate(ranks):
        extra, ratio, seconds, read = _rank_cells(rank)
        cells = ""
        if baseline:
            old_extra, old_ratio, old_seconds, old_read = _rank_cells(baseline["ranks"][index])
            cells = f" {old_extra:.0f} | {old_ratio:.2f} | {old_read} | {old_seconds:.1f} |"
        shard_mib = rank["shard_bytes"] / 2**20
        print(f"| {rank['rank']} | {shard_mib:.0f} |{cells} {extra:.0f} | {ratio:.2f} | {read} | {seconds:.1f} |")
        verdicts.append(ratio <= TARGET)
    print()
    line = (f"driver RSS: {drv['before_kib'] / 1024:.0f} MiB before, {drv['after_kib'] / 1024:.0f} MiB after, "
            f"peak {drv['peak_kib'] / 1024:.0f} MiB during the load")
    if baseline:
        bd = baseline["driver"]
        line += f" (old: {bd['before_kib'] / 1024:.0f} / {bd['after_kib'] / 1024:.0f} / {bd['peak_kib'] / 1024:.0f})"
    print(line)
    digests = [f"{r['digest']:.6e}" for r in ranks]
    print("digests: " + ", ".join(digests))
    if baseline:
        same = all(abs(a["digest"] - b["digest"]) <= 1e-9 * max(1.0, abs(b["digest"]))
                   for a, b in zip(ranks, baseline["ranks"]))
        print(f"same weights as the baseline: {'yes' if same else 'NO'}")
    print(f"target: every rank's peak extra RSS <= {TARGET:g}x its shard: {'met' if all(verdicts) else 'missed'}")


if __name__ == "__main__":
    main()
