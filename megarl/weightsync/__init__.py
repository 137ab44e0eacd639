"""Weight sync: trainer shards -> full HF tensors -> the rollout fleet, under a new weight version.

- `plan`: the resharding plan (pure): per Megatron shard, the HF tensors it makes, the
  sender rank and the size-capped bucket; `assemble_bucket` runs its copy program.
- `gather`, `pipeline`: per PP stage, the TP ranks assemble each bucket (in shared memory on
  CPU, by a gather otherwise), overlapped with sending.
- transports, registered in `megarl.registry.WEIGHT_SYNC_TRANSPORTS` with their placement
  rules: `tensor` (colocated only, `/update_weights_from_tensor`, flattened buckets in
  shared memory; on GPUs fanned out to every rank's GPU, `fanout`), `distributed`
  (disaggregated only, one broadcast group per sender, senders in turns,
  `/update_weights_from_distributed`), `disk` (safetensors + `/update_weights_from_disk`).
  The wire formats come from `megarl.rollout.weight_wire`.
- `session`, `checksum`: begin/end with pause and version, phase-named errors with
  timeouts, and the optional per-tensor checksum verification.
- `buffers`: bucket buffers kept across syncs, shared memory on CPU.
- `syncer.WeightSyncer`: one sync across all trainer ranks.
"""

from __future__ import annotations

from pathlib import Path

from megarl.registry import WEIGHT_SYNC_TRANSPORTS
from megarl.rollout.client import RolloutClient
from megarl.weightsync.disk_transport import DiskTransport
from megarl.weightsync.distributed_transport import DistributedTransport
from megarl.weightsync.groups import RankCoords, SyncGroups
from megarl.weightsync.pipeline import Transport
from megarl.weightsync.plan import ReshardPlan, TrainerLayout, assemble_bucket, build_plan
from megarl.weightsync.session import SyncStats, WeightSyncError
from megarl.weightsync.syncer import WeightSyncer
from megarl.weightsync.tensor_transport import TensorTransport

__all__ = [
    "DiskTransport",
    "DistributedTransport",
    "RankCoords",
    "ReshardPlan",
    "SyncGroups",
    "SyncStats",
    "TensorTransport",
    "TrainerLayout",
    "Transport",
    "WeightSyncError",
    "WeightSyncer",
    "assemble_bucket",
    "build_plan",
    "make_transport",
]


def make_transport(name: str, client: RolloutClient | None, *, timeout_s: float,
                   disk_dir: str | Path | None = None, server_devices: list[list[str]] | None = None) -> Transport:
    """The transport registered as `name` (`weight_sync.transport`), talking to the servers of `client`.

    `server_devices`: per server, the device UUID of each TP rank (the tensor transport on GPUs needs them).
    """
    return WEIGHT_SYNC_TRANSPORTS.get(name).target.create(client, timeout_s=timeout_s, disk_dir=disk_dir,
                                                          server_devices=server_devices)
