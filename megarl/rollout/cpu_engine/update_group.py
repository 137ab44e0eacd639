"""Receiving weights by broadcast from a trainer: the server's half of SGLang's weight-update groups.

The rendezvous is `weight_wire.new_update_group` (SGLang's `init_custom_process_group`),
so trainer code written for SGLang servers works here unchanged; this server (one TP
rank) joins as rank `rank_offset`. `/update_weights_from_distributed` sends names,
dtypes and shapes over HTTP; the trainer then broadcasts the tensors from rank 0 in
that order (or, with `load_format: "flattened_bucket"`, one uint8 buffer of their
bytes). On CPU the backend is gloo.

Like a real server, this one takes part in one group operation at a time: the
engine serialises every weight operation (see `engine`), so a join or a receive
blocks the server's other weight calls until it completes.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from megarl.rollout.weight_wire import new_update_group

NamedTensors = list[tuple[str, torch.Tensor]]
IDLE_BUFFERS = 3  # per group: a trainer keeps up to three buckets in flight


class UpdateGroups:
    """The weight-update groups this server has joined, by name (callers serialise the operations)."""

    def __init__(self, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # guards the dicts against readers on other threads
        self._groups: dict[str, torch.distributed.ProcessGroup] = {}
        self._idle: dict[str, list[torch.Tensor]] = {}  # flat receive buffers ready for reuse

    def join(self, *, master_address: str, master_port: int, rank: int, world_size: int, group_name: str) -> None:
        """Block until every rank has joined the group (the trainer must join concurrently)."""
        with self._lock:
            if group_name in self._groups:
                raise ValueError(f"group_name: {group_name!r} is already joined; destroy it first")
        group = new_update_group(master_address=master_address, master_port=master_port, rank=rank,
                                 world_size=world_size, group_name=group_name, backend="gloo",
                                 timeout_s=self.timeout_s)
        with self._lock:
            self._groups[group_name] = group

    @contextmanager
    def received(self, group_name: str, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]], *,
                 flattened: bool = False) -> Iterator[NamedTensors]:
        """The tensors broadcast from rank 0, valid inside the `with` block: one broadcast per name, or
        (`flattened`) one uint8 buffer holding their bytes back to back in order (SGLang's
        "flattened_bucket" load format). Flat buffers are reused by later receives of the group:
        fresh memory for every bucket cost more in page faults than the broadcast itself."""
        group = self._group(group_name)
        buffer = None
        if flattened:
            sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in zip(dtypes, shapes)]
            buffer = self._take_buffer(group_name, sum(sizes))
            flat = buffer[: sum(sizes)]
            group.broadcast(flat, 0).wait()
            named = [(name, piece.view(dtype).view(shape))
                     for name, piece, dtype, shape in zip(names, flat.split(sizes), dtypes, shapes)]
        else:
            named = []
            for name, dtype, shape in zip(names, dtypes, shapes):
                tensor = torch.empty(shape, dtype=dtype)
                group.broadcast(tensor, 0).wait()
                named.append((name, tensor))
        try:
            yield named
        finally:
            if buffer is not None:
                with self._lock:
                    idle = self._idle.setdefault(group_name, [])
                    if len(idle) < IDLE_BUFFERS:
                        idle.append(buffer)

    def _take_buffer(self, group_name: str, nbytes: int) -> torch.Tensor:
        with self._lock:
            idle = self._idle.get(group_name, [])
            for index, buffer in enumerate(idle):
                if buffer.numel() >= nbytes:
                    return idle.pop(index)
        return torch.empty(nbytes, dtype=torch.uint8)

    def destroy(self, group_name: str) -> None:
        group = self._group(group_name)
        torch.distributed.destroy_process_group(group)
        with self._lock:
            del self._groups[group_name]
            self._idle.pop(group_name, None)

    def _group(self, group_name: str) -> torch.distributed.ProcessGroup:
        with self._lock:
            group = self._groups.get(group_name)
        if group is None:
            raise ValueError(f"group_name: weight-update group {group_name!r} does not exist; "
                             f"call /init_weights_update_group")
        return group
