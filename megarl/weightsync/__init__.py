"""Weight sync: trainer shards -> full HF tensors -> the rollout fleet, under a new weight version.

- `plan`: the resharding plan (pure): per Megatron shard, the HF tensors it makes, the
  sender rank and the size-capped bucket; `assemble_bucket` runs its copy program.
- `gather`, `pipeline`: per PP stage, the TP ranks assemble each bucket (in shared memory on
  CPU, by a gather otherwise), overlapped with sending.
- transports: `tensor` (colocated, `/update_weights_from_tensor`, flattened buckets in
  shared memory), `distributed` (one broadcast group per PP stage,
  `/update_weights_from_distributed`), `disk` (safetensors + `/update_weights_from_disk`).
- `session`, `checksum`: begin/end with pause and version, phase-named errors with
  timeouts, and the optional per-tensor checksum verification.
- `buffers`: bucket buffers kept across syncs, shared memory on CPU.
- `syncer.WeightSyncer`: one sync across all trainer ranks.
"""

from __future__ import annotations

from pathlib import Path

from megarl.rollout.client import RolloutClient
from megarl.weightsync.disk_transport import DiskTransport
from megarl.weightsync.distributed_transport import DistributedTransport
from megarl.weightsync.groups import RankCoords, SyncGroups, device_for
from megarl.weightsync.pipeline import Transport
from megarl.weightsync.plan import ReshardPlan, TrainerLayout, assemble_bucket, build_plan
from megarl.weightsync.session import SyncStats, WeightSyncError
from megarl.weightsync.syncer import WeightSyncer
from megarl.weightsync.tensor_transport import TensorTransport

TRANSPORTS = ("tensor", "distributed", "disk")

__all__ = [
    "TRANSPORTS",
    "RankCoords",
    "ReshardPlan",
    "SyncGroups",
    "SyncStats",
    "TrainerLayout",
    "Transport",
    "WeightSyncError",
    "WeightSyncer",
    "assemble_bucket",
    "build_plan",
    "make_transport",
]


def make_transport(name: str, client: RolloutClient, *, timeout_s: float, disk_dir: str | Path | None = None
                   ) -> Transport:
    """The transport called `name` (`weight_sync.transport`), talking to the servers of `client`."""
    if name == "tensor":
        return TensorTransport(client, device=device_for())
    if name == "distributed":
        return DistributedTransport(client, timeout_s=timeout_s)
    if name == "disk":
        if disk_dir is None:
            raise ValueError("the disk transport needs disk_dir (a run-local directory the servers can read)")
        return DiskTransport(client, root=disk_dir)
    raise ValueError(f"weight_sync.transport: {name!r} is not one of {TRANSPORTS}")
