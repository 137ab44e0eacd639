"""Receiving weights by broadcast from a trainer: SGLang's `/init_weights_update_group` family.

The rendezvous follows SGLang's `init_custom_process_group`, so trainer code
written for SGLang servers works here unchanged: a TCP store at
`tcp://master_address:master_port` hosted by the trainer (rank 0), wrapped in
`PrefixStore(group_name, store)`, and a process group built outside the
default group with torch's `_new_process_group_helper`. This server (one TP
rank) joins as rank `rank_offset`. `/update_weights_from_distributed` sends
names, dtypes and shapes over HTTP; the trainer then broadcasts the tensors
from rank 0 in that order. On CPU the backend is gloo.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

NamedTensors = list[tuple[str, torch.Tensor]]
GROUP_TIMEOUT = timedelta(minutes=10)


def parse_dtype(name: str) -> torch.dtype:
    """"bfloat16" or "torch.bfloat16" -> torch.bfloat16; ValueError for anything that is not a dtype."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtypes: {name!r} is not a torch dtype")
    return dtype


class UpdateGroups:
    """The weight-update groups this server has joined, by name. Not thread-safe: callers serialise."""

    def __init__(self) -> None:
        self._groups: dict[str, torch.distributed.ProcessGroup] = {}

    def join(self, *, master_address: str, master_port: int, rank: int, world_size: int, group_name: str) -> None:
        """Block until every rank has joined the group (the trainer must join concurrently)."""
        if group_name in self._groups:
            raise ValueError(f"group_name: {group_name!r} is already joined; destroy it first")
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
        self._groups[group_name] = group

    def receive(
        self, group_name: str, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]
    ) -> NamedTensors:
        """Receive one broadcast (root: rank 0) per name, in order."""
        group = self._group(group_name)
        named: NamedTensors = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=dtype)
            group.broadcast(tensor, 0).wait()
            named.append((name, tensor))
        return named

    def destroy(self, group_name: str) -> None:
        torch.distributed.destroy_process_group(self._group(group_name))
        del self._groups[group_name]

    def _group(self, group_name: str) -> torch.distributed.ProcessGroup:
        if group_name not in self._groups:
            raise ValueError(f"group_name: no weight-update group {group_name!r}; call /init_weights_update_group")
        return self._groups[group_name]
