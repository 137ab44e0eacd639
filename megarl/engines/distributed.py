"""Process-group set-up for one engine rank: torch.distributed + megatron parallel state.

Each engine rank (a `torch.multiprocessing.spawn` child in tests, a Ray actor in the
controller) calls `init_distributed` once before building a model and
`destroy_distributed` before exiting. On a CPU-only machine it installs the CPU
compatibility layer first and uses gloo; with CUDA it pins the device and uses NCCL.
Gloo (the CPU backend, and megatron's CPU-side groups on GPUs) is pointed at the
card that reaches the master: by default it binds to whatever the hostname resolves
to, 127.0.1.1 under Debian's default /etc/hosts.
"""

from __future__ import annotations

import datetime
import os

import torch

from megarl.engines import cpu_compat
from megarl.net import gloo_interface_toward, host_port


def init_distributed(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    tp: int,
    pp: int,
    vpp: int | None = None,
    ep: int = 1,
    backend: str | None = None,
    timeout_s: int = 600,
    seed: int = 1234,
    local_rank: int | None = None,
) -> None:
    """Join the process group and initialise megatron's TP/PP/DP groups and RNG tracker.

    `vpp` is the number of virtual pipeline chunks per PP rank (None or 1 = no VPP);
    `seed` seeds megatron's model-parallel RNG tracker (dropout streams), not weights.
    `local_rank` picks the GPU (default: rank modulo the visible device count).
    `ep` splits the experts of MoE layers over `ep` ranks of the TP x DP ranks of a stage.
    """
    cpu_compat.install()
    if torch.cuda.is_available():
        device_index = local_rank if local_rank is not None else rank % torch.cuda.device_count()
        torch.cuda.set_device(device_index)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    gloo_interface_toward(master_addr)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=backend,
            init_method=f"tcp://{host_port(master_addr, master_port)}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    set_model_parallel(tp=tp, pp=pp, vpp=vpp, ep=ep, timeout_s=timeout_s, seed=seed)


def set_model_parallel(
    *, tp: int, pp: int, vpp: int | None = None, ep: int = 1, timeout_s: int = 600, seed: int = 1234
) -> None:
    """(Re)initialise megatron's TP/PP/DP/EP groups and RNG tracker on the existing process group.

    Collective over all ranks. Calling it again switches the layout: engines built before
    keep references to the old groups and must not be used afterwards. Tests and the
    benchmark use this to run several layouts in one set of processes (start-up dominates).
    Experts are never TP-split (expert TP = 1): expert-TP > 1 needs the allgather token
    dispatcher on gloo, which cannot handle packed (variable-length) micro-batches.
    """
    world_size = torch.distributed.get_world_size()
    if world_size % (tp * pp) != 0:
        raise ValueError(f"world_size={world_size} is not a multiple of tp*pp={tp}*{pp}")
    if vpp is not None and vpp > 1 and pp == 1:
        raise ValueError(f"vpp={vpp} needs pp > 1 (got pp={pp})")
    if (world_size // pp) % ep != 0:
        raise ValueError(f"ep={ep} must divide tp*dp={world_size // pp} (world_size={world_size}, pp={pp})")
    cpu_compat.install()
    # Importing megatron only after the compat layer is in place (its modules capture
    # torch.cuda helpers at import time).
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        distributed_timeout_minutes=max(1, timeout_s // 60),
    )
    model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def parallel_layout() -> dict[str, int | bool]:
    """Where this rank sits: global rank/world size, TP/PP/DP rank and size, and `is_output`.

    `is_output` marks one rank per DP replica (TP rank 0 of the last pipeline stage)
    whose results the controller collects; the engines return the same values on every
    rank of the replica, so any choice is correct, this one is just canonical.
    """
    from megatron.core import parallel_state as ps

    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    return {
        "rank": torch.distributed.get_rank(),
        "world_size": torch.distributed.get_world_size(),
        "tp_rank": tp_rank,
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "pp_rank": pp_rank,
        "pp_size": pp_size,
        "dp_rank": ps.get_data_parallel_rank(),
        "dp_size": ps.get_data_parallel_world_size(),
        "is_output": tp_rank == 0 and pp_rank == pp_size - 1,
    }
