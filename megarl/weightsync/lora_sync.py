"""Adapter-only weight sync (`weight_sync.lora: adapter`): a LoRA policy's adapters reach every server as a PEFT
adapter, loaded under the weight version's name, instead of its weights.

Adapters weigh megabytes, so they take the short road: every trainer rank hands its adapter
shards to global rank 0 (one gather of Python objects over the engine's process group),
which merges the TP shards into the full layout and converts them to PEFT's tensors and
config (`megarl.models.lora`). Rank 0 then loads them on every server as
`lora_adapter_name(version)`:

- transport `tensor` (colocated servers): `/load_lora_adapter_from_tensors` with the PEFT
  config, one pickle of the tensors per server TP rank and a checksum per tensor;
- transport `disk`: PEFT's files written to `<disk_dir>/<name>/`, a directory every server
  must see, then `/load_lora_adapter`.

The servers then publish the version (`/update_weight_version`, not aborting requests) and
unload the previous version's adapter, which SGLang does once no request uses it. Every
generation names the current version's adapter (`RolloutFleet.lora_adapters`). The frozen
base never moves: the servers keep the weights they started with.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megarl.config.settings import WeightSyncSettings
from megarl.models.lora import merge_adapter, peft_config, to_peft
from megarl.rollout.client import RolloutClient, RolloutError
from megarl.rollout.weight_wire import lora_adapter_name, tensor_checksum
from megarl.weightsync.groups import RankCoords
from megarl.weightsync.session import SyncStats, WeightSyncError

if TYPE_CHECKING:  # the engines package installs megatron's CPU stubs on import: only the type is needed here
    from megarl.engines.protocol import AdapterShards

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def peft_adapter(gathered: list[tuple[int, dict]], adapters: AdapterShards) -> tuple[dict[str, torch.Tensor], dict]:
    """Every rank's (TP rank, shards) -> (PEFT tensors, PEFT config) of the whole adapter."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for tp_rank, local in gathered:
        for (_, name), tensor in local.items():
            shards.setdefault(name, {})[0 if ".experts." in name else tp_rank] = tensor
    full = {name: merge_adapter(name, [parts[r] for r in sorted(parts)]) for name, parts in shards.items()}
    settings = adapters.settings
    config = peft_config(rank=settings.rank, alpha=settings.alpha, dropout=settings.dropout,
                         targets=settings.targets, base_model=None)
    return {name: t.contiguous() for name, t in to_peft(full, adapters.arch).items()}, config


class AdapterSync:
    """One per trainer rank (held by its worker); remembers which adapter each server holds."""

    def __init__(self) -> None:
        self._held: dict[str, str] = {}  # server URL -> the adapter name it holds
        self._fleets: set[frozenset[str]] = set()  # the server sets pushed to whole

    def push(self, adapters: AdapterShards, *, coords: RankCoords, urls: list[str], api_key: str | None,
             version: object, settings: WeightSyncSettings) -> dict[str, float] | None:
        """Load this version's adapter on `urls` (collective over the trainer's ranks); metrics on rank 0."""
        gathered: list = [None] * coords.world_size
        torch.distributed.all_gather_object(gathered, (adapters.tp_rank, {k: v.cpu() for k, v in
                                                                          adapters.shards.items()}))
        if coords.rank != 0:
            return None
        started = time.perf_counter()
        tensors, config = peft_adapter(gathered, adapters)
        name = lora_adapter_name(version)
        self._forget_restarted(urls)
        targets = [url for url in urls if self._held.get(url) != name]
        with RolloutClient(targets or urls, api_key=api_key, timeout_s=settings.timeout_s) as client:
            try:
                if targets:
                    self._load(client, name, tensors, config, settings)
                client.update_weight_version(str(version), abort_all_requests=False)
            except RolloutError as error:
                raise WeightSyncError(f"adapter-only sync of {name}: {error}") from error
        for old in sorted({self._held.get(url) for url in targets} - {None, name}):
            for url in (url for url in targets if self._held.get(url) == old):
                self._unload(url, old, api_key=api_key, timeout_s=settings.timeout_s)
            if settings.transport == "disk":
                shutil.rmtree(Path(settings.disk_dir) / old, ignore_errors=True)
        self._held.update({url: name for url in urls})
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return SyncStats(len(tensors), num_bytes, time.perf_counter() - started).metrics()

    @staticmethod
    def _unload(url: str, name: str, *, api_key: str | None, timeout_s: float) -> None:
        """Unload `name` from the server at `url`; a server restarted at the same URL since it loaded `name` (the
        fleet restarts a dead server on its port and syncs it with the others' next version) holds nothing."""
        with RolloutClient([url], api_key=api_key, timeout_s=timeout_s) as client:
            try:
                client.unload_lora_adapter(name)
            except RolloutError as error:
                if error.status == 400 and f"LoRA with name {name} does not exist." in error.message:
                    return  # SGLang's LoRAManager.unload_lora_adapter refusal of a name it does not hold
                raise WeightSyncError(f"adapter-only sync: unloading {name}: {error}") from error

    def _forget_restarted(self, urls: list[str]) -> None:
        """A push to part of a known server set re-syncs restarted servers (the fleet re-syncs a restarted
        server alone): they hold no adapter any more."""
        pushed = frozenset(urls)
        if any(pushed < fleet for fleet in self._fleets):
            for url in urls:
                self._held.pop(url, None)
        else:
            self._fleets.add(pushed)

    @staticmethod
    def _load(client: RolloutClient, name: str, tensors: dict[str, torch.Tensor], config: dict,
              settings: WeightSyncSettings) -> None:
        if settings.transport == "disk":
            from safetensors.torch import save_file

            directory = Path(settings.disk_dir) / name
            staging = directory.with_name(f".tmp-{name}")
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
            shutil.rmtree(directory, ignore_errors=True)
            os.replace(staging, directory)
            client.load_lora_adapter(name, str(directory))
        else:
            checksums = {key: tensor_checksum(tensor) for key, tensor in tensors.items()}
            client.load_lora_adapter_from_tensors(name, config, list(tensors.items()), checksums=checksums)
