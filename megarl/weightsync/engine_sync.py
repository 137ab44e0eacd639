"""A trainer rank's weight-sync state across steps: plan, groups, clients and transports, built once.

`EngineWeightSync.push` is what `MegatronWorker.push_weights` runs on every rank
of the actor: it takes the rank's weight shards and coordinates, builds the plan
and the sync groups on first use, and keeps one `WeightSyncer` per (transport,
settings, server set), so a distributed transport's broadcast groups live across
steps. A push to a different server set that overlaps a known one means those
servers were restarted (the fleet re-syncs a restarted server alone): syncers
whose server sets contain them are closed, so their groups are set up afresh. A
distributed sync that fails on groups kept from an earlier sync is retried once
with new groups (a server restarted at the same URL no longer knows them).
Every rank must make the same calls in the same order (they are collective).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megarl.config.settings import WeightSyncSettings
from megarl.models import experts_per_rank
from megarl.models.spec import Arch
from megarl.rollout.client import RolloutClient
from megarl.weightsync import make_transport
from megarl.weightsync.groups import RankCoords, SyncGroups
from megarl.weightsync.plan import ReshardPlan, TrainerLayout, build_plan
from megarl.weightsync.session import WeightSyncError
from megarl.weightsync.syncer import WeightSyncer

VERIFY_MODES = ("none", "checksum")


class EngineWeightSync:
    """One per trainer rank (held by its `MegatronWorker`); see the module docstring."""

    def __init__(self) -> None:
        self._groups: SyncGroups | None = None
        self._plans: dict[tuple, ReshardPlan] = {}
        self._syncers: dict[tuple, tuple[WeightSyncer, RolloutClient | None]] = {}

    def push(
        self,
        weights: Any,
        *,
        coords: RankCoords,
        urls: list[str],
        api_key: str | None,
        version: object,
        settings: WeightSyncSettings,
        server_devices: list[list[str]] | None = None,
    ) -> dict[str, float] | None:
        """One sync of this rank's `weights` (an engine's `WeightShards`: Megatron-named shards per chunk,
        the arch and the padded vocab) to `urls` under `version`; metrics on trainer rank 0, else None.

        `server_devices`: per server, its TP ranks' GPU UUIDs (the tensor transport on GPUs needs them)."""
        verify, timeout_s, transport = settings.verify, settings.timeout_s, settings.transport
        if verify not in VERIFY_MODES:
            raise ValueError(f"weight_sync.verify: {verify!r} is not one of {VERIFY_MODES}")
        local, arch, padded_vocab = weights.shards, weights.arch, weights.padded_vocab
        dtype = next(iter(local.values())).dtype
        coords = _with_expert_parallel(coords, arch, local)
        if self._groups is None:
            self._groups = SyncGroups.build(coords, timeout_s=timeout_s)
        layout = TrainerLayout(tp=coords.tp_size, pp=coords.pp_size, vpp=weights.num_chunks, dp=coords.dp_size,
                               ep=coords.ep_size)
        plan_key = (layout, dtype, settings.bucket_bytes, padded_vocab, weights.only)
        if plan_key not in self._plans:
            self._plans[plan_key] = build_plan(arch, layout, dtype=dtype, bucket_bytes=plan_key[2],
                                               padded_vocab=padded_vocab, only=weights.only)
        servers = tuple(urls)
        disk_dir = settings.disk_dir
        devices = tuple(tuple(server) for server in server_devices) if server_devices is not None else None
        key = (servers, api_key, transport, plan_key, verify, timeout_s, str(disk_dir), devices,
               settings.pause_mode)
        self._drop_restarted(servers, keep=key)
        reused = key in self._syncers
        syncer = self._syncer(key, coords=coords, disk_dir=disk_dir)
        try:
            stats = syncer.push(local, weight_version=str(version))
        except WeightSyncError:
            # Broadcast groups from an earlier sync go stale when a server restarts at the same
            # URL (a one-server fleet re-syncs its restarted server with the same URL set). Every
            # rank got the same error and knows the same history, so all retry once, afresh.
            if not (reused and transport == "distributed"):
                raise
            self._close(key)
            stats = self._syncer(key, coords=coords, disk_dir=disk_dir).push(local, weight_version=str(version))
        return stats.metrics() if stats is not None else None

    def _syncer(self, key: tuple, *, coords: RankCoords, disk_dir) -> WeightSyncer:
        if key not in self._syncers:
            servers, api_key, transport, plan_key, verify, timeout_s, _, devices, pause_mode = key
            needs_client = coords.rank == 0 or coords.is_sender
            client = RolloutClient(list(servers), api_key=api_key, timeout_s=timeout_s) if needs_client else None
            sender_transport = make_transport(transport, client, timeout_s=timeout_s, disk_dir=disk_dir,
                                              server_devices=[list(d) for d in devices] if devices else None)
            syncer = WeightSyncer(self._plans[plan_key], sender_transport, self._groups, client=client,
                                  verify=verify == "checksum", pause_mode=pause_mode)
            self._syncers[key] = (syncer, client)
        return self._syncers[key][0]

    def close(self) -> None:
        """Release every transport (leave the servers' broadcast groups) and close the clients."""
        for key in list(self._syncers):
            self._close(key)

    def _drop_restarted(self, servers: tuple[str, ...], *, keep: tuple) -> None:
        for key in list(self._syncers):
            if key != keep and key[0] != servers and set(key[0]) & set(servers):
                self._close(key)

    def _close(self, key: tuple) -> None:
        syncer, client = self._syncers.pop(key)
        try:
            syncer.close()
        finally:
            if client is not None:
                client.close()


def _with_expert_parallel(coords: RankCoords, arch: Arch, local) -> RankCoords:
    """`coords` with the EP rank and size, when the layout did not report them (MoE models only).

    The EP size is how many ways this rank's layer holds the experts; the EP rank follows
    Megatron's default order (tp-cp-ep-dp-pp), where DP rank r holds EP rank r % ep.
    """
    if not arch.is_moe or coords.ep_size > 1:
        return coords
    held = experts_per_rank([name for _, name in local], 1)
    ep_size = arch.num_experts // held if held else 1
    return replace(coords, ep_size=ep_size, ep_rank=coords.dp_rank % ep_size)
