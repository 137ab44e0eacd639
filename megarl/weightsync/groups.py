"""Where this trainer rank sits, and the process groups a sync needs besides Megatron's own.

`RankCoords` is the rank's position (from `megarl.engines.distributed.parallel_layout()`,
or written by hand in tests). `SyncGroups.build` is a collective over the default
group: it learns every rank's coordinates and creates, with the sync's timeout,
one TP group per PP stage of DP replica 0 (dense buckets are assembled there; with
MoE, DP ranks r < ep send EP rank r's experts, which are never TP-split; other
replicas hold the same weights and stay idle) and a gloo control group over all
ranks for the small object exchanges that keep every rank's outcome consistent.
It also learns whether the TP group shares one host (`tp_same_host`): then CPU
shards meet in shared memory instead of travelling over a socket; every rank's
device (its GPU's UUID, None on CPU), which tells the colocated tensor transport
which trainer rank shares a GPU with which server TP rank; and the senders in the
order they take turns when a transport needs them one at a time.
Building our own groups keeps megatron out of this package.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megarl.rollout.weight_wire import device_uuid
from megarl.weightsync.session import WeightSyncError


@dataclass(frozen=True)
class RankCoords:
    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    @classmethod
    def from_layout(cls, layout: dict[str, Any]) -> RankCoords:
        """From `parallel_layout()`; EP keys are optional (a dense model has ep 1)."""
        return cls(**{name: int(layout[name]) for name in cls.__dataclass_fields__ if name in layout})

    @property
    def is_sender(self) -> bool:
        """TP rank 0 of the stage's first EP group (DP rank < ep): sends its (stage, EP rank)'s buckets."""
        return self.tp_rank == 0 and self.dp_rank < self.ep_size


class SyncGroups:
    """This rank's TP gather group (None when it has no TP peers or is not in DP replica 0), the control group,
    every rank's device (`devices`, by rank) and the senders in turn order (`senders`: (pp, ep, rank))."""

    def __init__(self, coords: RankCoords, *, tp_group, tp_ranks: list[int], control, timeout_s: float,
                 tp_same_host: bool = False, devices: list[str | None] | None = None,
                 senders: list[tuple[int, int, int]] | None = None):
        self.coords, self.tp_group, self.tp_ranks = coords, tp_group, tp_ranks
        self.control, self.timeout_s = control, timeout_s
        # Every rank of the TP group runs on this host: CPU shards can meet in shared memory.
        self.tp_same_host = tp_same_host
        self.devices = devices if devices is not None else [device_identity()]
        self.senders = senders if senders is not None else [(0, 0, 0)]
        self._fanout = None

    @classmethod
    def build(cls, coords: RankCoords, *, timeout_s: float, device: str | None = None) -> SyncGroups:
        """`device`: this rank's device identity (default: its GPU's UUID, None on CPU)."""
        device = device if device is not None else device_identity()
        if coords.world_size == 1:
            return cls(coords, tp_group=None, tp_ranks=[0], control=None, timeout_s=timeout_s, devices=[device])
        timeout = timedelta(seconds=timeout_s)
        placed: list[Any] = [None] * coords.world_size
        dist.all_gather_object(placed, (coords, host_identity(), device))
        everyone = [c for c, _, _ in placed]
        host_of = {c.rank: host for c, host, _ in placed}
        senders = sorted((c.pp_rank, c.ep_rank, c.rank) for c in everyone if c.is_sender)
        if [(pp, ep) for pp, ep, _ in senders] != [(pp, ep) for pp in range(coords.pp_size)
                                                 for ep in range(coords.ep_size)]:
            raise ValueError(f"weight sync needs one sender per (PP stage, EP rank) (TP rank 0, DP rank < ep); "
                             f"the ranks give {[(pp, ep) for pp, ep, _ in senders]}")
        tp_group, tp_ranks = None, [coords.rank]
        # new_group is collective over the default group: every rank creates every group, in the same order.
        for pp_rank in range(coords.pp_size):
            ranks = [c.rank for c in sorted(everyone, key=lambda c: c.tp_rank)
                     if c.pp_rank == pp_rank and c.dp_rank == 0]
            group = dist.new_group(ranks, timeout=timeout) if coords.tp_size > 1 else None
            if coords.rank in ranks:
                tp_group, tp_ranks = group, ranks
        control = dist.new_group(list(range(coords.world_size)), timeout=timeout, backend="gloo")
        same_host = len({host_of[rank] for rank in tp_ranks}) == 1
        devices = [None] * coords.world_size
        for c, _, rank_device in placed:
            devices[c.rank] = rank_device
        return cls(coords, tp_group=tp_group, tp_ranks=tp_ranks, control=control, timeout_s=timeout_s,
                   tp_same_host=same_host, devices=devices, senders=senders)

    def participates(self, pp_rank: int, ep_rank: int) -> bool:
        """Whether this rank works in the turn of (PP stage, EP rank)'s sender: the sender and its TP peers."""
        coords = self.coords
        return (coords.pp_rank, coords.ep_rank) == (pp_rank, ep_rank) and (coords.is_sender or coords.dp_rank == 0)

    def share_from_zero(self, value: Any, *, phase: str) -> Any:
        """Rank 0's `value` on every rank."""
        return self.share_from(0, value, phase=phase)

    def share_from(self, src: int, value: Any, *, phase: str) -> Any:
        """Rank `src`'s `value` on every rank."""
        if self.control is None:
            return value
        box = [value]
        try:
            dist.broadcast_object_list(box, src=src, group=self.control)
        except RuntimeError as error:
            raise WeightSyncError(f"{phase}: control broadcast from trainer rank {src} to rank {self.coords.rank} "
                                  f"failed or timed out after {self.timeout_s:.0f} s: {error}") from error
        return box[0]

    def gather_to(self, dst: int, value: Any, *, phase: str) -> list[Any] | None:
        """Every rank's `value` in rank order on rank `dst`; None on the others."""
        if self.control is None:
            return [value]
        values: list[Any] | None = [None] * self.coords.world_size if self.coords.rank == dst else None
        try:
            dist.gather_object(value, values, dst=dst, group=self.control)
        except RuntimeError as error:
            raise WeightSyncError(f"{phase}: control gather to trainer rank {dst} on rank {self.coords.rank} "
                                  f"failed or timed out after {self.timeout_s:.0f} s: {error}") from error
        return values

    def fanout(self):
        """A group of all ranks on the default backend (NCCL on GPUs), made on first use: collective."""
        if self._fanout is None and self.control is not None:
            self._fanout = dist.new_group(list(range(self.coords.world_size)),
                                          timeout=timedelta(seconds=self.timeout_s))
        return self._fanout

    def gather_all(self, value: Any, *, phase: str) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        if self.control is None:
            return [value]
        values: list[Any] = [None] * self.coords.world_size
        try:
            dist.all_gather_object(values, value, group=self.control)
        except RuntimeError as error:
            raise WeightSyncError(f"{phase}: control all-gather on trainer rank {self.coords.rank} failed or "
                                  f"timed out after {self.timeout_s:.0f} s: {error}") from error
        return values


def host_identity() -> str:
    """Hostname and boot id: two processes with equal identities see the same /dev/shm (a hostname
    alone can repeat across machines, e.g. containers left at a default name)."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


def device_identity() -> str | None:
    """This rank's GPU, by UUID (the same GPU has the same UUID in every process); None without CUDA."""
    return device_uuid(torch.cuda.current_device()) if torch.cuda.is_available() else None


def device_for(backend: str | None = None) -> torch.device:
    """Where bucket buffers live: the current GPU with CUDA, else CPU."""
    if backend != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
