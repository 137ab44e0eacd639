"""Fan-out for the colocated tensor transport on GPUs: each server TP rank gets a buffer on its own GPU.

A CUDA IPC handle maps memory of the GPU it was made on, and SGLang's TP rank r loads
from entry r of `serialized_named_tensors` on its own GPU (found by the UUID in the
handle). So every bucket is broadcast from its stage's sender to every trainer rank
(one copy per GPU; with colocated placement each server TP rank's GPU hosts one), each
rank pickles a handle of its copy for the server TP ranks on its GPU (`holders`, matched
by device UUID), the sender gathers the handles and posts one body per server, and
every rank learns the outcome before it reuses its buffer. All of it is collective over
every trainer rank, so the senders take turns (the syncer runs one turn per sender).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megarl.rollout.weight_wire import held_checksum
from megarl.weightsync.groups import SyncGroups
from megarl.weightsync.pipeline import bucket_views
from megarl.weightsync.plan import Bucket
from megarl.weightsync.session import WeightSyncError
from megarl.weightsync.tensor_transport import TensorTransport

Tensor = torch.Tensor


def holders(server_devices: Sequence[Sequence[str]], rank_devices: Sequence[str | None]) -> list[list[int]]:
    """For each server TP rank, the trainer rank on its GPU (the lowest, if several share it).

    WeightSyncError naming every server TP rank whose GPU hosts no trainer rank (placement not colocated).
    """
    by_device: dict[str, int] = {}
    for rank, device in enumerate(rank_devices):
        if device is not None:
            by_device.setdefault(device, rank)
    missing = [f"server {server} TP rank {tp_rank} (device {device})"
               for server, devices in enumerate(server_devices) for tp_rank, device in enumerate(devices)
               if device not in by_device]
    if missing:
        raise WeightSyncError("tensor transport: no trainer rank shares a GPU with " + ", ".join(missing)
                              + f"; trainer devices: {list(rank_devices)} (the tensor transport needs colocated "
                                f"placement; use 'distributed' or 'disk' otherwise)")
    return [[by_device[device] for device in devices] for devices in server_devices]


def run_fanout_turn(buckets: Sequence[Bucket], *, sender: int, assemble: Callable[[Bucket, Tensor | None], None] | None,
                    transport: TensorTransport, groups: SyncGroups, verify: bool) -> dict[str, str]:
    """One sender's buckets through every rank's GPU; collective over all ranks. Returns the sender's digests.

    `assemble` is given on the ranks that assemble this sender's buckets (the sender and its TP peers).
    When a post fails the sender raises WeightSyncError and the other ranks stop (the sender reports it).
    """
    me = groups.coords.rank
    owners = holders(transport.server_devices, groups.devices)
    mine = [(server, tp_rank) for server, ranks in enumerate(owners) for tp_rank, rank in enumerate(ranks)
            if rank == me]
    digests: dict[str, str] = {}
    for bucket in buckets:
        flat = transport.buffer(0, bucket.nbytes)
        if assemble is not None:
            assemble(bucket, flat if me == sender else None)
        if me == sender and verify:
            digests.update((name, held_checksum(t)) for name, t in bucket_views(bucket, flat))
        _broadcast(flat[: bucket.nbytes], src=sender, groups=groups, bucket=bucket)
        entries = transport.handles(bucket, flat, mine=mine)
        gathered = groups.gather_to(sender, entries, phase=f"tensor fan-out, handles of bucket {bucket.index}")
        failure = None
        if me == sender:
            try:
                transport.post(bucket, {key: entry for part in gathered for key, entry in part.items()})
            except WeightSyncError as error:
                failure = str(error)
        # Every rank waits for the servers to have loaded the bucket before it reuses its copy.
        failure = groups.share_from(sender, failure, phase=f"tensor fan-out, outcome of bucket {bucket.index}")
        if failure is not None:
            if me == sender:
                raise WeightSyncError(failure)
            break
    return digests


def _broadcast(flat: Tensor, *, src: int, groups: SyncGroups, bucket: Bucket) -> None:
    group = groups.fanout()
    if group is None:
        return
    try:
        dist.broadcast(flat, src=src, group=group)
    except RuntimeError as error:
        raise WeightSyncError(f"tensor fan-out of bucket {bucket.index} from trainer rank {src} on rank "
                              f"{groups.coords.rank} failed or timed out after {groups.timeout_s:.0f} s: "
                              f"{error}") from error
