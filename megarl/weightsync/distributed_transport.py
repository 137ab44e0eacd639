"""The disaggregated `distributed` transport: buckets broadcast from each sender to every server.

Each sender (one per PP stage and EP rank) owns one weight-update group with all
servers: it is rank 0, server i's TP rank r joins as `1 + (TP sizes of servers
before i) + r`.

Why the senders take turns (`ordered_senders`): a real SGLang server serves weight
operations strictly one at a time (its tokenizer manager holds a lock across each
update and its scheduler is a single thread), and joining a group or receiving a
broadcast blocks until every member takes part. With several senders pushing at
once, server X can be inside group A's join or broadcast while server Y is inside
group B's, each waiting for the other: a deadlock that grows likelier with more
senders and servers. So the syncer runs the senders one after another in
(PP stage, EP rank) order, each sender's turn ending when all its buckets are
applied (every reply awaited): every server then sees the calls of all senders
in one global order, and every call it serves can complete, for any number of
senders and servers. Turns cost little: a server applies one update at a time
anyway, and within a turn the next bucket still travels while the previous one
is applied.

The group is set up once, on the
stage's first sync, and kept; a push to a different set of servers (a server was
restarted) sets up a new one and drops the groups that contained any of them.
Per bucket the metadata (`names`, `dtypes`, `shapes`, `load_format:
"flattened_bucket"`, `flush_cache: false`) goes over HTTP to
`/update_weights_from_distributed` while the bucket's bytes go by one broadcast
(gloo on CPU, NCCL on GPU). The broadcast is polled next to the HTTP replies: a
server that refuses the update fails the sync at once, one that stops answering
fails it after `timeout_s`, each error naming the bucket, group and server.
Replies are awaited lazily (at most two outstanding, all by the stage's last
bucket), so a server applies bucket k while bucket k+1 is on the wire.
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from megarl.net import is_loopback, node_address
from megarl.ports import free_port
from megarl.registry import WEIGHT_SYNC_TRANSPORTS
from megarl.rollout.client import RolloutClient
from megarl.rollout.weight_wire import wire_dtype
from megarl.weightsync.bounds import SyncBound, broadcast_seconds
from megarl.weightsync.buffers import BufferRing
from megarl.weightsync.plan import Bucket
from megarl.weightsync.session import WeightSyncError, call_servers, server_tp_sizes
from megarl.weightsync.update_group import POLL_S, destroy_update_group, init_update_group

Tensor = torch.Tensor
MAX_PENDING = 2  # bucket replies awaited at once: bounds the buckets a server holds received but not applied


def _broadcast_bound(nbytes: int, *, bucket_bytes: int, scratch_dir: Path, device: str) -> float:
    # The same bytes in the same bucket-sized pieces, broadcast between two fresh processes (NCCL on two GPUs).
    pieces = [bucket_bytes] * (nbytes // bucket_bytes) + ([nbytes % bucket_bytes] if nbytes % bucket_bytes else [])
    multi_gpu = device == "cuda" and torch.cuda.device_count() >= 2
    return broadcast_seconds(pieces, backend="nccl" if multi_gpu else "gloo")


@WEIGHT_SYNC_TRANSPORTS.register(
    "distributed",
    refuses_colocation="a sender and a server TP rank on one GPU would join one NCCL communicator, which NCCL refuses",
    bound=SyncBound("broadcast (2 processes)", _broadcast_bound),
)
class DistributedTransport:
    name = "distributed"
    ordered_senders = True  # see the module docstring

    def __init__(self, client: RolloutClient, *, backend: str | None = None, timeout_s: float = 600.0,
                 group_prefix: str | None = None):
        self.client = client
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout_s = timeout_s
        # Unique per trainer: a group name a dead trainer left joined on a server cannot collide.
        self.group_prefix = group_prefix or f"megarl_{secrets.token_hex(4)}"
        self._groups: dict[int, tuple[str, dist.ProcessGroup]] = {}
        self._ring = BufferRing(self.device)
        self._pool = ThreadPoolExecutor(MAX_PENDING + 1, thread_name_prefix="weight-sync-meta")
        self._pending: list[Future] = []

    @classmethod
    def create(cls, client: RolloutClient, *, timeout_s: float, disk_dir=None, server_devices=None
               ) -> DistributedTransport:
        return cls(client, timeout_s=timeout_s)

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def buffer(self, slot: int, nbytes: int) -> Tensor:
        return self._ring.get(slot, nbytes)

    def prepare(self, *, weight_version: str) -> None:
        pass

    def start_stage(self, pp_rank: int, *, weight_version: str) -> None:
        if pp_rank in self._groups:
            return
        urls = self.client.urls
        tp_sizes = server_tp_sizes(self.client, phase=f"distributed transport set-up, PP stage {pp_rank}")
        name = f"{self.group_prefix}_pp{pp_rank}"
        group = init_update_group(self.client, urls=urls, tp_sizes=tp_sizes, master_address=_master_address(urls),
                                  master_port=free_port(""), group_name=name, backend=self.backend,
                                  timeout_s=self.timeout_s)
        self._groups[pp_rank] = (name, group)

    def send(self, bucket: Bucket, flat: Tensor, *, last: bool) -> None:
        name, group = self._groups[bucket.pp_rank]
        tensors = bucket.tensors
        body = {
            "names": [t.name for t in tensors],
            "dtypes": [wire_dtype(bucket.dtype)] * len(tensors),
            "shapes": [list(t.shape) for t in tensors],
            "group_name": name,
            "load_format": "flattened_bucket",
            "flush_cache": False,  # the update session flushes (see `session`)
        }
        what = f"distributed transport, bucket {bucket.index} (PP stage {bucket.pp_rank}, group {name!r})"
        self._pending.append(self._pool.submit(call_servers, self.client, "POST", "/update_weights_from_distributed",
                                               body, phase=what))
        work = group.broadcast(flat[: bucket.nbytes], 0)
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            failed = next((reply for reply in self._pending if reply.done() and reply.exception()), None)
            if failed is not None:
                self._forget(bucket.pp_rank)  # the servers left the broadcast: this group is out of step
                raise failed.exception()
            if time.monotonic() > deadline:
                self._forget(bucket.pp_rank)
                raise WeightSyncError(f"{what}: broadcast timed out after {self.timeout_s:.0f} s; servers "
                                      f"{', '.join(self.client.urls)} (group ranks 1..{group.size() - 1})")
            time.sleep(POLL_S)
        try:
            work.wait()
        except RuntimeError as error:
            self._forget(bucket.pp_rank)
            raise WeightSyncError(f"{what}: broadcast failed: {error}") from error
        # The buffer is free once broadcast; the servers apply bucket k while bucket k+1 arrives.
        # At most MAX_PENDING replies are awaited at once, all of them after the stage's last bucket.
        while self._pending and (last or len(self._pending) > MAX_PENDING):
            self._pending.pop(0).result(timeout=self.timeout_s)

    def commit(self, *, weight_version: str) -> None:
        pass

    def release_buffers(self) -> None:
        self._ring.clear()

    def close(self) -> None:
        for pp_rank in list(self._groups):
            name, group = self._groups.pop(pp_rank)
            destroy_update_group(self.client, group, group_name=name)
        self.release_buffers()
        self._pool.shutdown(wait=False)

    def _forget(self, pp_rank: int) -> None:
        """Drop a group left mid-broadcast; the next sync sets up a fresh one.

        Torn down in the background: a server may still be blocked receiving, and the
        error must reach the caller now, not after the server's own timeout.
        """
        self._pending.clear()
        name, group = self._groups.pop(pp_rank)
        threading.Thread(target=destroy_update_group, args=(self.client, group), kwargs={"group_name": name},
                         daemon=True).start()


def _master_address(urls: list[str]) -> str:
    """Loopback when every server is local, else this node's routable address (`megarl.net.node_address`:
    never what the hostname resolves to, 127.0.1.1 under Debian's default /etc/hosts)."""
    if all(is_loopback(urlparse(url).hostname or "") for url in urls):
        return "127.0.0.1"
    return node_address()



