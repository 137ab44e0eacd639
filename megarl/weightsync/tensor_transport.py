"""The colocated `tensor` transport: buckets -> `/update_weights_from_tensor` on every server.

`TensorTransport` sends each bucket in SGLang's "flattened_bucket" load format:
one uint8 buffer plus per-tensor metadata. The bucket buffers live in shared
memory (CPU; CUDA IPC on GPU) and are pickled by reference with torch's
ForkingPickler, so a server maps the trainer's buffer and copies from it: the
bytes never travel through HTTP and are never copied on the trainer side. Two
buffers per sender are kept across syncs (re-faulting fresh shared memory every
sync would cost more than the copy). Payloads are pickles: only send to servers
you trust (SGLang's own property; protect servers with an API key).

`sync_from_tensor` is weight sync v1: one full HF state dict, one request.
"""

from __future__ import annotations

import base64
import io
import pickle
import time
from multiprocessing.reduction import ForkingPickler
from typing import Mapping

import torch
import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler

from megarl.rollout.client import RolloutClient
from megarl.rollout.tensor_transport import FlattenedTensorMetadata
from megarl.weightsync.plan import Bucket
from megarl.weightsync.session import SyncStats, call_servers

Tensor = torch.Tensor


class TensorTransport:
    name = "tensor"

    def __init__(self, client: RolloutClient, *, device: torch.device | None = None):
        self.client = client
        self.device = device or torch.device("cpu")
        self._buffers: dict[int, Tensor] = {}

    def buffer(self, slot: int, nbytes: int) -> Tensor:
        held = self._buffers.get(slot)
        if held is None or held.numel() < nbytes:
            held = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            if held.device.type == "cpu":
                # file_system: the pickle carries a /dev/shm name that survives an HTTP body.
                torch.multiprocessing.set_sharing_strategy("file_system")
                held.share_memory_()
            self._buffers[slot] = held
        return held

    def prepare(self, *, weight_version: str) -> None:
        pass

    def start_stage(self, pp_rank: int, *, weight_version: str) -> None:
        pass

    def send(self, bucket: Bucket, flat: Tensor, *, last: bool) -> None:
        metadata = [
            FlattenedTensorMetadata(t.name, t.shape, bucket.dtype, t.offset, t.offset + t.nbytes, t.nbytes)
            for t in bucket.tensors
        ]
        payload = {"flattened_tensor": flat[: bucket.nbytes], "metadata": metadata}
        # One pickle per server: each holds one reference on the shared buffer, which its receiver releases.
        bodies = [
            {"serialized_named_tensors": [_pickle_b64(payload)], "load_format": "flattened_bucket",
             "flush_cache": last}
            for _ in self.client.urls
        ]
        call_servers(self.client, "POST", "/update_weights_from_tensor", bodies,
                     phase=f"tensor transport, bucket {bucket.index} (PP stage {bucket.pp_rank})")

    def commit(self, *, weight_version: str) -> None:
        pass

    def close(self) -> None:
        self._buffers.clear()


def _pickle_b64(payload: object) -> str:
    """SGLang's `serialized_named_tensors` entry: base64 of a ForkingPickler pickle (tensors by reference)."""
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(payload)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def sync_from_tensor(
    named_tensors: Mapping[str, torch.Tensor], client: RolloutClient, *, weight_version: str
) -> SyncStats:
    """Weight sync v1: load `named_tensors` into every server of `client` under `weight_version`."""
    start = time.perf_counter()
    tensors = {name: tensor.detach().contiguous() for name, tensor in named_tensors.items()}
    client.begin_weight_update()
    try:
        client.update_weights_from_tensor(list(tensors.items()), weight_version=weight_version)
    finally:
        client.end_weight_update()
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return SyncStats(len(tensors), num_bytes, time.perf_counter() - start)
