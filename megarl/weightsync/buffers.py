"""Bucket buffers that live across syncs, in shared memory when on CPU, and how other processes map them.

Every transport fills the same two ring slots per sender each sync, so the buffers
are allocated once and kept: faulting in fresh pages every sync would cost more than
filling them. On CPU they are shared memory under torch's "file_system" strategy,
so a buffer's pickle carries a /dev/shm name that another process on this host can
map: a colocated server reads the bucket in place (`weight_wire` pickles it for
the server), and the TP peers of the sending rank write their shards straight into
it (`share_handle`, `SharedMappings`).
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler

Tensor = torch.Tensor
MAPPINGS_KEPT = 8  # a few senders' two-slot rings; older mappings are released


class BufferRing:
    """uint8 buffers by ring slot on `device`, grown on demand and kept until `clear`."""

    def __init__(self, device: torch.device | None = None):
        self.device = device or torch.device("cpu")
        self._held: dict[int, Tensor] = {}

    def get(self, slot: int, nbytes: int) -> Tensor:
        held = self._held.get(slot)
        if held is None or held.numel() < nbytes:
            held = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            if held.device.type == "cpu":
                share(held)
            self._held[slot] = held
        return held

    def clear(self) -> None:
        self._held.clear()


def share(tensor: Tensor) -> Tensor:
    """Move a CPU tensor's storage into named shared memory (in place; once per storage)."""
    _use_named_shared_memory()
    if not tensor.is_shared():
        tensor.share_memory_()
    return tensor


def share_handle(payload: object) -> bytes:
    """A pickle of `payload` whose tensors travel by reference to their shared storage, for the TP peers
    of this rank; a CPU tensor not yet shared is moved into shared memory first."""
    _use_named_shared_memory()
    return bytes(ForkingPickler.dumps(payload, pickle.HIGHEST_PROTOCOL))


def _use_named_shared_memory() -> None:
    # file_system: the pickle carries a /dev/shm name, which survives an HTTP body (a file
    # descriptor would not), and any process on the host can open it.
    torch.multiprocessing.set_sharing_strategy("file_system")


class SharedMappings:
    """Maps `share_handle` pickles from other processes, keeping recent ones mapped: while a storage
    is alive torch maps its file once, instead of faulting its pages in on every bucket."""

    def __init__(self, kept: int = MAPPINGS_KEPT):
        self.kept = kept
        self._mapped: OrderedDict[bytes, Tensor] = OrderedDict()

    def open(self, handle: bytes) -> Tensor:
        tensor = self._mapped.get(handle)
        if tensor is None:
            tensor = self._mapped[handle] = pickle.loads(handle)
            while len(self._mapped) > self.kept:
                self._mapped.popitem(last=False)
        else:
            self._mapped.move_to_end(handle)
        return tensor

    def clear(self) -> None:
        self._mapped.clear()
