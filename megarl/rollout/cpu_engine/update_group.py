"""Receiving weights by broadcast from a trainer: SGLang's `/init_weights_update_group` family.

The rendezvous follows SGLang's `init_custom_process_group`, so trainer code
written for SGLang servers works here unchanged: a TCP store at
`tcp://master_address:master_port` hosted by the trainer (rank 0), wrapped in
`PrefixStore(group_name, store)`, and a process group built outside the
default group with torch's `_new_process_group_helper`. This server (one TP
rank) joins as rank `rank_offset`. `/update_weights_from_distributed` sends
names, dtypes and shapes over HTTP; the trainer then broadcasts the tensors
from rank 0 in that order (or, with `load_format: "flattened_bucket"`, one
uint8 buffer of their bytes). On CPU the backend is gloo.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

NamedTensors = list[tuple[str, torch.Tensor]]
GROUP_TIMEOUT = timedelta(minutes=10)
IDLE_BUFFERS = 3  # per group: a trainer keeps up to three buckets in flight


def parse_dtype(name: str) -> torch.dtype:
    """"bfloat16" or "torch.bfloat16" -> torch.bfloat16; ValueError for anything that is not a dtype."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtypes: {name!r} is not a torch dtype")
    return dtype


class UpdateGroups:
    """The weight-update groups this server has joined, by name.

    Thread-safe, and joins/receives of *different* groups run concurrently: a
    pipeline-parallel trainer sends each PP stage through its own group at the
    same time, and on gloo a server that served one group at a time could block
    stage 0 while stage 1 waits on another server that does the opposite.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[str, torch.distributed.ProcessGroup | None] = {}  # None: still joining
        self._busy: dict[str, threading.Lock] = {}
        self._idle: dict[str, list[torch.Tensor]] = {}  # flat receive buffers ready for reuse

    def join(self, *, master_address: str, master_port: int, rank: int, world_size: int, group_name: str) -> None:
        """Block until every rank has joined the group (the trainer must join concurrently)."""
        with self._lock:
            if group_name in self._groups:
                raise ValueError(f"group_name: {group_name!r} is already joined; destroy it first")
            self._groups[group_name] = None
        try:
            group = self._create(master_address, master_port, rank, world_size, group_name)
        except BaseException:
            with self._lock:
                del self._groups[group_name]
            raise
        with self._lock:
            self._groups[group_name] = group
            self._busy[group_name] = threading.Lock()

    @staticmethod
    def _create(master_address: str, master_port: int, rank: int, world_size: int, group_name: str):
        init_method = f"tcp://{master_address}:{master_port}"
        store, _, _ = next(rendezvous(init_method, rank, world_size, timeout=GROUP_TIMEOUT))
        store.set_timeout(GROUP_TIMEOUT)
        group = _new_process_group_helper(
            world_size, rank, [], Backend("gloo"), PrefixStore(group_name, store),
            group_name=group_name, timeout=GROUP_TIMEOUT,
        )
        # Some torch versions return (group, prefix_store).
        group = group[0] if isinstance(group, tuple) else group
        # Registering the ranks lets destroy_process_group forget the group name,
        # so a later init with the same name works.
        _world.pg_group_ranks[group] = {index: index for index in range(world_size)}
        return group

    @contextmanager
    def received(
        self,
        group_name: str,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[list[int]],
        *,
        flattened: bool = False,
    ) -> Iterator[NamedTensors]:
        """The tensors broadcast from rank 0, valid inside the `with` block: one broadcast per name, or
        (`flattened`) one uint8 buffer holding their bytes back to back in order (SGLang's
        "flattened_bucket" load format). Flat buffers are reused by later receives of the group:
        fresh memory for every bucket cost more in page faults than the broadcast itself."""
        group, busy = self._group(group_name)
        buffer = None
        with busy:
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
        group, busy = self._group(group_name)
        with busy:
            torch.distributed.destroy_process_group(group)
        with self._lock:
            del self._groups[group_name]
            del self._busy[group_name]
            self._idle.pop(group_name, None)

    def _group(self, group_name: str) -> tuple[torch.distributed.ProcessGroup, threading.Lock]:
        with self._lock:
            group = self._groups.get(group_name)
            if group is None:
                state = "is still joining" if group_name in self._groups else "does not exist"
                raise ValueError(f"group_name: weight-update group {group_name!r} {state}; "
                                 f"call /init_weights_update_group")
            return group, self._busy[group_name]
