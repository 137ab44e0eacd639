"""The colocated `tensor` transport: named tensors -> `/update_weights_from_tensor` on every server.

On CPU the tensors travel through shared memory (ForkingPickler with the
file_system sharing strategy, done by the rollout client); on GPU through CUDA
IPC handles. Every sync is bracketed by `/begin_weight_update` and
`/end_weight_update` and carries the new weight version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import torch

from megarl.rollout.client import RolloutClient


@dataclass
class SyncStats:
    num_tensors: int
    num_bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Payload gigabytes per second (the `perf/weight_sync_gbps` metric)."""
        return self.num_bytes / 1e9 / self.seconds if self.seconds > 0 else float("nan")


def sync_from_tensor(
    named_tensors: Mapping[str, torch.Tensor], client: RolloutClient, *, weight_version: str
) -> SyncStats:
    """Load `named_tensors` into every server of `client` under `weight_version`."""
    start = time.perf_counter()
    tensors = {name: tensor.detach().contiguous() for name, tensor in named_tensors.items()}
    client.begin_weight_update()
    try:
        client.update_weights_from_tensor(list(tensors.items()), weight_version=weight_version)
    finally:
        client.end_weight_update()
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return SyncStats(len(tensors), num_bytes, time.perf_counter() - start)
