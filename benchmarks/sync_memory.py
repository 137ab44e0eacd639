"""Benchmark: the memory a trainer rank keeps between weight syncs, buffers kept (old) against freed (new).

Four trainer processes (TP2 x PP2, gloo, bf16 shards of a Llama-shaped model; default
hidden 1024, 12 layers, ffn 2816, vocab 32000: 0.2B parameters) push `--syncs` times into
one megarl CPU engine through the tensor transport. The TP ranks assemble each bucket by
point-to-point gather, as they do on GPUs (each sender keeps its two ring buffers, TP
rank 0 its receive scratch, the peer its pack scratch). Run twice: buffers kept across
syncs (`release_buffers=False`: every sync before this change, and the CPU default now)
and freed after each sync (`release_buffers=True`: what shards on a GPU now get). Per
rank: its resident memory right after the last sync returned, above its resident
memory with only its shards built (CPU RSS stands in for the device memory these
buffers take on a GPU, where they would sit idle under the fleet's KV cache and the
next training phase; glibc's freed heap pages are trimmed first, so only live memory
counts), and the median sync time (what re-allocating costs: on CPU, page faults of
fresh shared memory on both sides; on a GPU, a few allocations from the device).

    python benchmarks/sync_memory.py                        # ~0.2B, 128 MiB buckets, ~3 GB peak
    python benchmarks/sync_memory.py --hidden 512 --layers 4 --ffn 1408 --bucket-mb 16   # a quick look
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weight_sync import add_model_args, hf_config, run_processes, write_checkpoint  # noqa: E402

from megarl.models import arch_from_hf  # noqa: E402
from megarl.ports import free_port  # noqa: E402
from megarl.rollout.client import RolloutClient  # noqa: E402
from megarl.rollout.server import start_cpu_engine  # noqa: E402
from megarl.weightsync import RankCoords, SyncGroups, TrainerLayout, WeightSyncer, build_plan  # noqa: E402
from megarl.weightsync import make_transport  # noqa: E402

API_KEY = "bench"
TP, PP = 2, 2


def _rss_mib() -> float:
    """Resident memory after handing glibc's freed heap pages back to the OS (it keeps them otherwise, as a
    GPU's caching allocator keeps freed blocks until `empty_cache`), so the figure counts live memory only."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def trainer_rank(rank: int, port: int, config: dict, url: str, syncs: int, bucket_mb: float, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    world = TP * PP
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    coords = RankCoords(rank=rank, world_size=world, tp_rank=rank % TP, tp_size=TP, pp_rank=rank // TP, pp_size=PP)
    layout = TrainerLayout(tp=TP, pp=PP)
    plan = build_plan(arch_from_hf(config), layout, dtype=torch.bfloat16, bucket_bytes=int(bucket_mb * 2**20))
    local = {}
    for bucket in plan.stage_buckets(coords.pp_rank):
        for param in bucket.params:
            seed = zlib.crc32(f"{param.name}/{coords.tp_rank if param.split_dim is not None else 0}".encode())
            local[(param.vpp_rank, param.local_name)] = (
                torch.randn(param.shard_shape, generator=torch.Generator().manual_seed(seed)) * 0.02
            ).to(torch.bfloat16)
    groups = SyncGroups.build(coords, timeout_s=600)
    groups.tp_same_host = False  # assemble by point-to-point gather, as on GPUs
    client = RolloutClient([url], api_key=API_KEY, timeout_s=600) if coords.tp_rank == 0 else None
    result = {"rank": rank, "role": "sender" if coords.is_sender else "TP peer"}
    for mode, release in (("kept", False), ("freed", True)):
        torch.distributed.barrier()
        shards_only = _rss_mib()
        syncer = WeightSyncer(plan, make_transport("tensor", client, timeout_s=600), groups, client=client,
                              release_buffers=release)
        times = []
        for index in range(syncs):
            torch.distributed.barrier()
            start = time.perf_counter()
            syncer.push(local, weight_version=f"{mode}-{index}")
            times.append(time.perf_counter() - start)
        torch.distributed.barrier()
        result[mode] = {"held_mib": _rss_mib() - shards_only, "seconds": statistics.median(times[1:] or times)}
        syncer.close()  # frees whatever the kept mode held, before the next mode measures its baseline
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    if client is not None:
        client.close()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=1024, layers=12, ffn=2816)
    parser.add_argument("--bucket-mb", type=float, default=128)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    config = hf_config(args)
    workdir = Path(tempfile.mkdtemp(prefix="megarl-bench-sync-memory-"))
    try:
        write_checkpoint(config, workdir / "model")
        server = start_cpu_engine(workdir / "model", api_key=API_KEY, log_path=workdir / "server.log",
                                  startup_timeout_s=900, dtype="auto")
        try:
            port, out = free_port(), workdir / "rank"
            run_processes(trainer_rank, [(rank, port, config, server.url, args.syncs, args.bucket_mb, str(out))
                                         for rank in range(TP * PP)], 3600)
            ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(TP * PP)]
        finally:
            server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "ranks": ranks}, indent=2))
    print(f"# memory kept between weight syncs: TP{TP} x PP{PP} bf16, tensor transport, point-to-point gather, "
          f"{args.bucket_mb:g} MiB buckets, {args.syncs} syncs, torch {torch.__version__}")
    print()
    print("| rank | role | kept: held MiB | kept: sync s | freed: held MiB | freed: sync s |")
    print("|---:|---|---:|---:|---:|---:|")
    for rank in ranks:
        kept, freed = rank["kept"], rank["freed"]
        print(f"| {rank['rank']} | {rank['role']} | {kept['held_mib']:.0f} | {kept['seconds']:.2f} | "
              f"{freed['held_mib']:.0f} | {freed['seconds']:.2f} |")


if __name__ == "__main__":
    main()
