"""One weight sync across all trainer ranks: session on rank 0, stages in parallel, one outcome everywhere.

`WeightSyncer.push` is called on every trainer rank (it is collective):
1. rank 0 opens the update session on every server (`session.UpdateSession`)
   and lets the transport prepare; every rank learns whether that worked;
2. each PP stage of DP replica 0 gathers and assembles its buckets; the
   stage's TP rank 0 sends them (`pipeline.run_stage`), all stages (and, for
   MoE, the EP ranks of each stage with their experts) at once, unless the
   transport needs its senders one at a time (`ordered_senders`, the
   distributed transport: see there) or fans buckets out to every rank (the
   tensor transport on GPUs, `fanout`): then the senders take turns in
   (PP stage, EP rank) order, and after each turn every rank learns whether it
   failed (a failed turn skips the later ones);
3. every rank's outcome (and, in checksum mode, its digests) goes to every rank;
4. if all succeeded rank 0 commits the transport, publishes the new version,
   verifies the checksums and closes the session; otherwise it aborts the
   session and every rank raises the same error, naming the failing ranks.
Rank 0 returns `SyncStats` (seconds from opening to closing the session); the
other ranks return None.

Buffers: the transport's bucket ring, the TP-gather scratch and the peers' mappings
of TP rank 0's buckets live for one sync when they take accelerator memory (shards on
a GPU; `release_buffers=True` forces it anywhere): every rank frees them when its
push ends, successful or not, and returns the blocks to the device (`empty_cache`),
so the colocated fleet's KV cache and the next training phase get them back. Host
buffers (shards on CPU) are kept across syncs by default: re-creating shared memory
costs page faults on every sync, and the host is not what a colocated fleet sizes
its cache from.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Mapping

import torch

from megarl.rollout.client import RolloutClient
from megarl.weightsync.checksum import verify_server_checksums
from megarl.weightsync.buffers import SharedMappings
from megarl.weightsync.fanout import run_fanout_turn
from megarl.weightsync.gather import StageAssembler
from megarl.weightsync.groups import SyncGroups
from megarl.weightsync.pipeline import Transport, run_stage
from megarl.weightsync.plan import ReshardPlan
from megarl.weightsync.session import SyncStats, UpdateSession, WeightSyncError

Tensor = torch.Tensor


class WeightSyncer:
    """Pushes this rank's shards through `transport`; `client` is needed on senders and rank 0 (else None)."""

    def __init__(self, plan: ReshardPlan, transport: Transport, groups: SyncGroups, *,
                 client: RolloutClient | None, verify: bool = False, pause_mode: str | None = "in_place",
                 release_buffers: bool | None = None):
        """`release_buffers`: free the sync's buffers when each push ends (None: when the shards are on a GPU)."""
        self.plan, self.transport, self.groups = plan, transport, groups
        self.coords = groups.coords
        self.client, self.verify = client, verify
        self.release_after_push = release_buffers
        self.session = UpdateSession(client, pause_mode=pause_mode) if self.coords.rank == 0 else None
        self._scratch: dict[str, Tensor] = {}  # TP gather buffers, kept across buckets (and syncs, see above)
        self._mappings = SharedMappings()  # TP rank 0's bucket buffers, mapped on its peers

    def push(self, local: Mapping[tuple[int, str], Tensor], *, weight_version: str) -> SyncStats | None:
        release = self.release_after_push
        if release is None:
            release = any(tensor.is_cuda for tensor in local.values())
        try:
            return self._push(local, weight_version=weight_version)
        finally:
            if release:
                self.release_buffers()

    def release_buffers(self) -> None:
        """Free this rank's bucket buffers, TP-gather scratch and mapped peer buffers (the next push
        allocates them again); on a GPU the freed blocks go back to the device."""
        self.transport.release_buffers()
        self._scratch.clear()
        self._mappings.clear()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # blocks a server's CUDA IPC mapping held back, now released
            torch.cuda.empty_cache()

    def _push(self, local: Mapping[tuple[int, str], Tensor], *, weight_version: str) -> SyncStats | None:
        start = time.perf_counter()
        opened = self._on_rank_zero(lambda: self._open(weight_version))
        opened = self.groups.share_from_zero(opened, phase="open update session")
        if opened is not None:
            raise WeightSyncError(opened if self.coords.rank == 0 else f"trainer rank 0: {opened}")
        if getattr(self.transport, "fanout", False) or getattr(self.transport, "ordered_senders", False):
            outcome = self._send_in_turns(local, weight_version=weight_version)
        else:
            outcome = self._send_stage(local, weight_version=weight_version)
        outcomes = self.groups.gather_all(outcome, phase="collect sender outcomes")
        failures = [f"trainer rank {rank}: {error}" for rank, (error, _) in enumerate(outcomes) if error]
        final = self._on_rank_zero(lambda: self._finish(failures, outcomes, weight_version))
        final = self.groups.share_from_zero(final, phase="finish update session")
        if final is not None:
            raise WeightSyncError(final)
        if self.coords.rank != 0:
            return None
        digests = {name: digest for _, stage in outcomes for name, digest in stage.items()}
        return SyncStats(len(self.plan.hf_names()), self.plan.nbytes, time.perf_counter() - start, digests)

    def close(self) -> None:
        self.transport.close()
        self.release_buffers()

    def _open(self, weight_version: str) -> None:
        self.session.open()
        try:
            self.transport.prepare(weight_version=weight_version)
        except BaseException:
            self.session.abort()
            raise

    def _send_stage(self, local, *, weight_version: str) -> tuple[str | None, dict[str, str]]:
        """(error or None, digests) of this rank's part; never raises, so every rank reaches the exchange."""
        coords = self.coords
        # Senders, and the TP peers of DP replica 0 that join its gathers; the rest hold copies.
        if not (coords.is_sender or coords.dp_rank == 0):
            return None, {}
        try:
            buckets = self.plan.stage_buckets(coords.pp_rank, ep_rank=coords.ep_rank)
            assemble = StageAssembler(self.plan, local, self.groups, self._scratch, buckets=buckets,
                                      mappings=self._mappings)
            if coords.is_sender:
                self.transport.start_stage(coords.pp_rank, weight_version=weight_version)
            digests = run_stage(buckets, assemble=assemble, transport=self.transport if coords.is_sender else None,
                                verify=self.verify, timeout_s=self.groups.timeout_s)
            return None, digests
        except Exception as error:  # noqa: BLE001 - reported through the exchange, raised on every rank
            return _describe(error), {}

    def _send_in_turns(self, local, *, weight_version: str) -> tuple[str | None, dict[str, str]]:
        """One turn per sender, in (PP stage, EP rank) order; every rank passes through every turn."""
        fanout = getattr(self.transport, "fanout", False)
        error, digests, failed = None, {}, None
        for pp_rank, ep_rank, sender in self.groups.senders:
            if failed is None and (fanout or self.groups.participates(pp_rank, ep_rank)):
                if fanout:
                    turn_error, turn_digests = self._fanout_turn(local, pp_rank, ep_rank, sender, weight_version)
                else:
                    turn_error, turn_digests = self._send_stage(local, weight_version=weight_version)
                error, digests = error or turn_error, {**digests, **turn_digests}
            turn = self.groups.share_from(sender, error if self.coords.rank == sender else None,
                                          phase=f"end of sender rank {sender}'s turn")
            failed = failed or turn  # the failing sender reports it; later turns are skipped on every rank
        return error, digests

    def _fanout_turn(self, local, pp_rank: int, ep_rank: int, sender: int, weight_version: str):
        """(error or None, digests) of one sender's fan-out turn; never raises (see `_send_stage`)."""
        try:
            buckets = self.plan.stage_buckets(pp_rank, ep_rank=ep_rank)
            assemble = None
            if self.groups.participates(pp_rank, ep_rank):
                assemble = StageAssembler(self.plan, local, self.groups, self._scratch, buckets=buckets,
                                          mappings=self._mappings)
            if self.coords.rank == sender:
                self.transport.start_stage(pp_rank, weight_version=weight_version)
            return None, run_fanout_turn(buckets, sender=sender, assemble=assemble, transport=self.transport,
                                         groups=self.groups, verify=self.verify)
        except Exception as error:  # noqa: BLE001 - reported through the exchange, raised on every rank
            return _describe(error), {}

    def _finish(self, failures: list[str], outcomes, weight_version: str) -> None:
        if failures:
            self._abort_quietly()
            raise WeightSyncError("weight sync failed: " + " | ".join(failures))
        try:
            self.transport.commit(weight_version=weight_version)
            if self.verify:
                expected = {name: digest for _, stage in outcomes for name, digest in stage.items()}
                verify_server_checksums(self.client, expected)
        except BaseException:
            self._abort_quietly()
            raise
        self.session.close(weight_version=weight_version)

    def _abort_quietly(self) -> None:
        try:
            self.session.abort()
        except WeightSyncError:
            pass  # the original failure is what the caller needs to see

    def _on_rank_zero(self, action) -> str | None:
        """Run `action` on rank 0; its error message (or None) to share with the other ranks."""
        if self.coords.rank != 0:
            return None
        try:
            action()
        except Exception as error:  # noqa: BLE001 - shared with every rank, then raised
            return _describe(error)
        return None


def _describe(error: BaseException) -> str:
    if isinstance(error, (WeightSyncError, ValueError)):
        return str(error)
    return "".join(traceback.format_exception_only(error)).strip()
