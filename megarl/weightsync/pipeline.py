"""Overlap: while the transport sends bucket k, the stage gathers and assembles bucket k+1.

On the sending rank a background thread takes filled buffers from a one-slot
queue, digests them (checksum mode) and hands them to the transport; the main
thread keeps gathering (a TP collective, which must stay on the thread that
runs the other collectives). Two buffers circulate, so memory stays at two
buckets. A failure on either side stops both and is raised on the main thread;
every wait is bounded by the sync timeout. Buffers on a GPU are sent from the
main thread, one bucket after the other: the send may be an NCCL broadcast, and
two NCCL communicators used at once from two threads of one process can deadlock
(NCCL documents this).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from megarl.rollout.weight_wire import held_checksum
from megarl.weightsync.plan import Bucket
from megarl.weightsync.session import WeightSyncError

Tensor = torch.Tensor
POLL_S = 0.05


class Transport(Protocol):
    """How buckets reach the servers. `send` runs on stage senders; `prepare`/`commit` on trainer rank 0."""

    name: str

    def buffer(self, slot: int, nbytes: int) -> Tensor:
        """A uint8 buffer of >= `nbytes` for ring slot `slot` (the transport may keep it across syncs)."""

    def prepare(self, *, weight_version: str) -> None:
        """Before any sender starts (rank 0)."""

    def start_stage(self, pp_rank: int, *, weight_version: str) -> None:
        """On the stage's sender, before its first bucket of a sync (e.g. set up a broadcast group once)."""

    def send(self, bucket: Bucket, flat: Tensor, *, last: bool) -> None:
        """Load one bucket into every server; `last`: the stage's final bucket of this sync."""

    def commit(self, *, weight_version: str) -> None:
        """After every sender succeeded (rank 0)."""

    def release_buffers(self) -> None:
        """Free the bucket buffers (a later sync allocates them again); groups and clients stay."""

    def close(self) -> None:
        """Release what the transport holds (groups on the servers, buffers)."""


def bucket_views(bucket: Bucket, flat: Tensor) -> list[tuple[str, Tensor]]:
    """The HF tensors inside a filled bucket buffer."""
    return [(t.name, flat[t.offset : t.offset + t.nbytes].view(bucket.dtype).view(t.shape)) for t in bucket.tensors]


def run_stage(
    buckets: Sequence[Bucket],
    *,
    assemble: Callable[[Bucket, Tensor | None], None],
    transport: Transport | None,
    verify: bool,
    timeout_s: float,
) -> dict[str, str]:
    """Assemble every bucket of the stage; with a `transport` (the sender) also send each. Returns digests."""
    if transport is None:
        for bucket in buckets:
            assemble(bucket, None)
        return {}
    nbytes = max((bucket.nbytes for bucket in buckets), default=0)
    if buckets and transport.buffer(0, nbytes).is_cuda:
        return _run_in_turn(buckets, assemble=assemble, transport=transport, verify=verify, nbytes=nbytes)
    free: queue.Queue[Tensor] = queue.Queue()
    for slot in range(min(2, len(buckets))):
        free.put(transport.buffer(slot, nbytes))
    filled: queue.Queue[tuple[Bucket, Tensor] | None] = queue.Queue(maxsize=1)
    digests: dict[str, str] = {}
    failure: list[BaseException] = []

    def send_loop() -> None:
        try:
            while (item := filled.get()) is not None:
                bucket, flat = item
                if verify:
                    digests.update((name, held_checksum(t)) for name, t in bucket_views(bucket, flat))
                transport.send(bucket, flat, last=bucket is buckets[-1])
                free.put(flat)
        except BaseException as error:  # noqa: BLE001 - handed to the main thread
            failure.append(error)

    sender = threading.Thread(target=send_loop, name="weight-sync-send", daemon=True)
    sender.start()
    deadline = time.monotonic() + timeout_s
    try:
        for bucket in buckets:
            flat = _wait(lambda: free.get(timeout=POLL_S), failure, deadline, f"buffer for bucket {bucket.index}")
            assemble(bucket, flat)
            _wait(lambda: filled.put((bucket, flat), timeout=POLL_S), failure, deadline, f"send of bucket {bucket.index}")
    finally:
        # Stop the sender whatever happened (it exits on None or after its own failure).
        while sender.is_alive() and not _offer(filled, None):
            pass
        sender.join(timeout_s)
    if failure:
        raise failure[0]
    return digests


def _run_in_turn(buckets: Sequence[Bucket], *, assemble, transport: Transport, verify: bool, nbytes: int
                 ) -> dict[str, str]:
    """Assemble, then send, each bucket on this thread (no second thread inside an NCCL collective)."""
    digests: dict[str, str] = {}
    flat = transport.buffer(0, nbytes)
    for bucket in buckets:
        assemble(bucket, flat)
        if verify:
            digests.update((name, held_checksum(t)) for name, t in bucket_views(bucket, flat))
        transport.send(bucket, flat, last=bucket is buckets[-1])
    return digests


def _offer(slot: queue.Queue, item: Any) -> bool:
    try:
        slot.put(item, timeout=POLL_S)
        return True
    except queue.Full:
        return False


def _wait(step: Callable[[], Any], failure: list[BaseException], deadline: float, what: str) -> Any:
    """Retry a blocking queue step until it succeeds, the sender thread failed, or the deadline passes."""
    while True:
        if failure:
            raise failure[0]
        try:
            return step()
        except (queue.Empty, queue.Full):
            if time.monotonic() > deadline:
                raise WeightSyncError(f"weight sync pipeline: timed out waiting for the {what}") from None
