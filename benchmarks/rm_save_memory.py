"""Benchmark: host memory of writing a trained reward model as HF files, gathered on every rank (old) against
sharded checkpoint + export (new, what `megarl train-rm` does now).

Four processes (gloo, TP2 x PP2) hold a bf16 reward model (a Llama backbone and the
one-label score head; default hidden 1024, 12 layers, ffn 2816, vocab 32000: 0.2B
parameters). Old: every rank gathers the whole model in float32 (`hf_state_dict`, a
collective over TP and PP) and rank 0 writes it, as train-rm did through the engine's
`save_hf_weights` (a 7B reward model: 28 GB on every rank). New: every rank saves its
own shards (`save_checkpoint(weights_only=True)`), then one fresh process converts the
checkpoint (`megarl export`, which holds the model once, in its dtype). Per rank: its
shard and its peak resident memory during the save above its memory just before (the
kernel's high-water mark, reset with `/proc/self/clear_refs`); for the new way also the
exporting process's peak above its memory before the conversion (imports done). Both ways must write the same tensors (compared bit for bit).

    python benchmarks/rm_save_memory.py                         # ~0.2B, ~4 GB peak
    python benchmarks/rm_save_memory.py --hidden 512 --layers 4 --ffn 1408   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loading_memory import _reset_peak_rss, _status_kib  # noqa: E402
from weight_sync import add_model_args, hf_config, run_processes  # noqa: E402

from megarl.ports import free_port  # noqa: E402

TP, PP = 2, 2
_EXPORT = """
import sys
from pathlib import Path
import megarl.engines.export, megarl.engines.reward_model  # imported before the baseline is read
from megarl.engines.export import export_checkpoint

def status(key):
    with open("/proc/self/status") as lines:
        return int(next(line.split()[1] for line in lines if line.startswith(key + ":")))

before = status("VmRSS")
export_checkpoint(Path(sys.argv[1]), Path(sys.argv[2]))
print(status("VmHWM") - before)
"""


def save_rank(rank: int, port: int, config: dict, workdir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from megarl.engines.distributed import destroy_distributed, init_distributed

    init_distributed(rank=rank, world_size=TP * PP, master_addr="127.0.0.1", master_port=port, tp=TP, pp=PP)
    from safetensors.torch import save_file

    from megarl.engines.reward_model import RewardModelEngine

    engine = RewardModelEngine(hf_config=config, weights=None, seed=0, params_dtype="bfloat16",
                               transformer_impl="local", optimizer=None)
    shard = sum(p.numel() * p.element_size() for chunk in engine.model.chunks for p in chunk.parameters())
    result = {"rank": rank, "shard_bytes": shard}
    for way in ("gathered", "sharded"):
        torch.distributed.barrier()
        _reset_peak_rss()
        before = _status_kib("VmRSS")
        if way == "gathered":  # train-rm before: a full float32 copy on every rank, rank 0 writes it
            state = engine.hf_state_dict()
            if rank == 0:
                save_file({name: t.to(torch.bfloat16).contiguous() for name, t in state.items()},
                          f"{workdir}/old.safetensors", metadata={"format": "pt"})
            del state
        else:
            engine.save_checkpoint(f"{workdir}/checkpoint", weights_only=True)
        result[way] = (_status_kib("VmHWM") - before) / 1024
    Path(f"{workdir}/rank.{rank}").write_text(json.dumps(result))
    destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, hidden=1024, layers=12, ffn=2816)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    config = hf_config(args)
    workdir = Path(tempfile.mkdtemp(prefix="megarl-bench-rm-save-"))
    try:
        port = free_port()
        run_processes(save_rank, [(rank, port, config, str(workdir)) for rank in range(TP * PP)], 3600)
        ranks = [json.loads((workdir / f"rank.{rank}").read_text()) for rank in range(TP * PP)]
        result = subprocess.run([sys.executable, "-c", _EXPORT, str(workdir / "checkpoint"), str(workdir / "hf")],
                                capture_output=True, text=True, check=True, timeout=3600)
        export_peak_mib = int(result.stdout.split()[-1]) / 1024
        from safetensors.torch import load_file

        old, new = load_file(workdir / "old.safetensors"), load_file(workdir / "hf" / "model.safetensors")
        same = old.keys() == new.keys() and all(torch.equal(old[name], new[name]) for name in old)
        model_mib = sum(t.numel() * t.element_size() for t in new.values()) / 2**20
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "ranks": ranks,
                                               "export_peak_mib": export_peak_mib, "same": same}, indent=2))
    print(f"# writing a reward model as HF files: TP{TP} x PP{PP}, bf16, {model_mib:.0f} MiB of weights, "
          f"torch {torch.__version__}")
    print()
    print("| rank | shard MiB | gathered (old): peak extra MiB | sharded (new): peak extra MiB |")
    print("|---:|---:|---:|---:|")
    for rank in ranks:
        print(f"| {rank['rank']} | {rank['shard_bytes'] / 2**20:.0f} | {rank['gathered']:.0f} | "
              f"{rank['sharded']:.0f} |")
    print()
    print(f"export process (new): peak {export_peak_mib:.0f} MiB above its RSS before the conversion, for "
          f"{model_mib:.0f} MiB of weights")
    print(f"same tensors written both ways: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
