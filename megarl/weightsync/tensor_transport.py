"""The colocated `tensor` transport: buckets -> `/update_weights_from_tensor` on every server.

`TensorTransport` sends each bucket in SGLang's "flattened_bucket" load format:
one uint8 buffer plus per-tensor metadata. The bucket buffers live in shared
memory (CPU; CUDA IPC on GPU) and are pickled by reference with torch's
ForkingPickler, so a server maps the trainer's buffer and copies from it: the
bytes never travel through HTTP and are never copied on the trainer side. The
buffers are kept across syncs (`buffers.BufferRing`). A server with TP > 1 gets
one entry per TP rank (its `/server_info` `tp_size`, asked once), as SGLang expects. Payloads are pickles: only
send to servers you trust (SGLang's own property; protect servers with an API key).
"""

from __future__ import annotations

import base64

import torch

from megarl.rollout.client import RolloutClient
from megarl.rollout.tensor_transport import FlattenedTensorMetadata
from megarl.weightsync.buffers import BufferRing, share_handle
from megarl.weightsync.plan import Bucket
from megarl.weightsync.session import call_servers, server_tp_sizes

Tensor = torch.Tensor


class TensorTransport:
    name = "tensor"

    def __init__(self, client: RolloutClient, *, device: torch.device | None = None):
        self.client = client
        self.device = device or torch.device("cpu")
        self._ring = BufferRing(self.device)
        self._tp_sizes: list[int] | None = None  # per server, learned once

    def buffer(self, slot: int, nbytes: int) -> Tensor:
        return self._ring.get(slot, nbytes)

    def prepare(self, *, weight_version: str) -> None:
        pass

    def start_stage(self, pp_rank: int, *, weight_version: str) -> None:
        if self._tp_sizes is None:
            self._tp_sizes = server_tp_sizes(self.client, phase=f"tensor transport set-up, PP stage {pp_rank}")

    def send(self, bucket: Bucket, flat: Tensor, *, last: bool) -> None:
        metadata = [
            FlattenedTensorMetadata(t.name, t.shape, bucket.dtype, t.offset, t.offset + t.nbytes, t.nbytes)
            for t in bucket.tensors
        ]
        payload = {"flattened_tensor": flat[: bucket.nbytes], "metadata": metadata}
        # SGLang takes one entry per server TP rank (each rank loads its slice of the full tensors).
        # One pickle per receiver: a CUDA IPC pickle carries one reference for one consumer.
        tp_sizes = self._tp_sizes or [1] * len(self.client.urls)
        bodies = [
            {"serialized_named_tensors": [base64.b64encode(share_handle(payload)).decode("ascii")
                                          for _ in range(tp_size)],
             "load_format": "flattened_bucket", "flush_cache": last}
            for tp_size in tp_sizes
        ]
        call_servers(self.client, "POST", "/update_weights_from_tensor", bodies,
                     phase=f"tensor transport, bucket {bucket.index} (PP stage {bucket.pp_rank})")

    def commit(self, *, weight_version: str) -> None:
        pass

    def close(self) -> None:
        self._ring.clear()
