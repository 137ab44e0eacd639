"""The colocated `tensor` transport: buckets -> `/update_weights_from_tensor` on every server.

Each bucket goes in SGLang's "flattened_bucket" load format: the uint8 bucket
buffer plus one `SimpleNamespace` of metadata per tensor (`weight_wire`), pickled
by reference with torch's ForkingPickler, so a server maps the trainer's buffer and
copies from it: the bytes never travel through HTTP. A server with TP size t gets
t entries, a separate pickle each (SGLang's TP rank r reads entry r). Updates carry
`flush_cache: false`; the update session flushes (see `session`).

Two ways to hand out buffers:
- shared memory (CPU): the sender's ring buffers live in /dev/shm, which every
  server TP rank on the host can map; the sender posts to every server itself.
- fan-out (GPU): a CUDA IPC handle only maps the buffer on its own GPU for the
  SGLang TP rank whose GPU it is, so every trainer rank keeps a copy of each bucket
  on its GPU (broadcast from the sender, `fanout.run_fanout_turn`) and hands the
  server TP rank on that GPU (matched by device UUID, `server_devices`) a handle to
  it; the sender gathers the handles and posts. Needs colocated placement: each
  server TP rank's GPU must host a trainer rank.
Payloads are pickles: only send to servers you trust (SGLang's own property).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.registry import WEIGHT_SYNC_TRANSPORTS
from megarl.rollout.client import RolloutClient
from megarl.rollout.weight_wire import entries_for_tp_ranks, flattened_payload, serialize_payload, tensor_metadata
from megarl.weightsync.bounds import SyncBound, memcpy_seconds
from megarl.weightsync.buffers import BufferRing
from megarl.weightsync.groups import device_for
from megarl.weightsync.plan import Bucket
from megarl.weightsync.session import WeightSyncError, call_servers, server_tp_sizes

Tensor = torch.Tensor
ServerDevices = list[list[str]]  # per server (in URL order), the device UUID of each TP rank


def _memcpy_bound(nbytes: int, *, bucket_bytes: int, scratch_dir: Path, device: str) -> float:
    # At best a server copies the bytes once out of the buffer the trainer filled.
    return memcpy_seconds(nbytes)


@WEIGHT_SYNC_TRANSPORTS.register(
    "tensor", needs_colocation="tensor handles only reach colocated engines",
    bound=SyncBound("memcpy (1 thread)", _memcpy_bound),
)
class TensorTransport:
    name = "tensor"
    ordered_senders = False  # SGLang queues tensor updates; senders need no turns (except in fan-out, below)

    def __init__(self, client: RolloutClient | None, *, device: torch.device | None = None,
                 server_devices: ServerDevices | None = None, fanout: bool | None = None):
        """`fanout`: hand out per-GPU copies (default: when buffers are on CUDA); it needs `server_devices`."""
        self.client = client
        self.device = device or torch.device("cpu")
        self.server_devices = server_devices
        self.fanout = self.device.type == "cuda" if fanout is None else fanout
        if self.fanout and server_devices is None:
            raise ValueError("the tensor transport on GPUs needs the device UUID of every server TP rank "
                             "(server_devices, reported by the fleet)")
        self._ring = BufferRing(self.device)
        self._tp_sizes: list[int] | None = None  # per server, learned once

    @classmethod
    def create(cls, client: RolloutClient | None, *, timeout_s: float, disk_dir=None,
               server_devices: ServerDevices | None = None) -> TensorTransport:
        return cls(client, device=device_for(), server_devices=server_devices)

    def buffer(self, slot: int, nbytes: int) -> Tensor:
        return self._ring.get(slot, nbytes)

    def prepare(self, *, weight_version: str) -> None:
        pass

    def start_stage(self, pp_rank: int, *, weight_version: str) -> None:
        if self._tp_sizes is None:
            self._tp_sizes = server_tp_sizes(self.client, phase=f"tensor transport set-up, PP stage {pp_rank}")
            if self.server_devices is not None and [len(d) for d in self.server_devices] != self._tp_sizes:
                raise WeightSyncError(f"tensor transport: the servers report TP sizes {self._tp_sizes}, the fleet "
                                      f"gave devices for {[len(d) for d in self.server_devices]}")

    def send(self, bucket: Bucket, flat: Tensor, *, last: bool) -> None:
        """Shared-memory path: every server TP rank gets its own pickle of the sender's buffer."""
        payload = bucket_payload(bucket, flat)
        self._post(bucket, [entries_for_tp_ranks(payload, tp_size) for tp_size in self._tp_sizes])

    def handles(self, bucket: Bucket, flat: Tensor, *, mine: list[tuple[int, int]]) -> dict[tuple[int, int], str]:
        """Fan-out path, on every rank: an entry of this rank's copy for each (server, TP rank) in `mine`."""
        payload = bucket_payload(bucket, flat)
        return {key: serialize_payload(payload) for key in mine}

    def post(self, bucket: Bucket, entries: dict[tuple[int, int], str]) -> None:
        """Fan-out path, on the sender: every server's entries, in TP order, from the ranks on their GPUs."""
        self._post(bucket, [[entries[(server, tp_rank)] for tp_rank in range(len(devices))]
                            for server, devices in enumerate(self.server_devices)])

    def _post(self, bucket: Bucket, entries: list[list[str]]) -> None:
        bodies = [{"serialized_named_tensors": server_entries, "load_format": "flattened_bucket",
                   "flush_cache": False} for server_entries in entries]
        call_servers(self.client, "POST", "/update_weights_from_tensor", bodies,
                     phase=f"tensor transport, bucket {bucket.index} (PP stage {bucket.pp_rank})")

    def commit(self, *, weight_version: str) -> None:
        pass

    def release_buffers(self) -> None:
        self._ring.clear()

    def close(self) -> None:
        self.release_buffers()


def bucket_payload(bucket: Bucket, flat: Tensor) -> dict:
    """The "flattened_bucket" payload of a filled bucket buffer, with SGLang's metadata fields."""
    metadata = [tensor_metadata(t.name, t.shape, bucket.dtype, t.offset, t.nbytes) for t in bucket.tensors]
    return flattened_payload(flat[: bucket.nbytes], metadata)
