"""The Ray actor that hosts one rank of a training engine (actor, reference, critic or reward model).

The controller creates one per rank (see `WorkerGroup`), initialises torch
distributed + Megatron parallel state in each, builds the engine, then calls one
method per phase with this rank's data-parallel shard. The worker talks to the
engine through `megarl.engines.protocol.TrainEngine` only. Ranks that do not hold
the output (TP rank > 0, or not the last pipeline stage) return None.
"""

from __future__ import annotations

import os
from pathlib import Path
import resource
from typing import Any

import torch

from megarl.cluster.worker_group import WorkerGroup
from megarl.config.settings import Batching, EngineSettings, WeightSyncSettings
from megarl.net import node_address
from megarl.ports import free_port
from megarl.processes import shield_ray_actor
from megarl.protocol import Batch

ENGINE_KINDS = ("policy", "value", "reward")


def _redirect_output(log_path: str) -> None:
    """Send this process's stdout and stderr (Python's and native code's: megatron, gloo) to `log_path`."""
    import sys

    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    handle = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(handle, 1)
    os.dup2(handle, 2)
    os.close(handle)


class MegatronWorker:
    def __init__(self, *, rank: int, world_size: int, log_path: str | None = None):
        shield_ray_actor()  # under a launcher, SIGTERM is the driver's: it checkpoints through this rank
        self.rank, self.world_size = rank, world_size
        if log_path is not None:
            _redirect_output(log_path)
        self.engine = None  # a TrainEngine once init_engine ran
        self.reference = None  # a frozen PolicyEngine beside the actor once init_reference ran
        self._weight_sync = None
        self._adapter_sync = None
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    def master_endpoint(self) -> tuple[str, int]:
        """Called on rank 0: where the other ranks meet it for the process group: loopback for a single rank,
        else this node's routable address (`megarl.net.node_address`), never what the hostname resolves to."""
        host = "127.0.0.1" if self.world_size == 1 else node_address()
        return host, free_port("" if self.world_size > 1 else "127.0.0.1")

    def init_engine(self, settings: EngineSettings, *, master_addr: str, master_port: int, hf_config: dict,
                    weights: str | None) -> None:
        """Join the engine's process group and build its engine of `settings.kind` ("policy": actor or, without
        an optimizer, the frozen reference; "value": the critic; "reward": the reward model)."""
        from megarl.engines.distributed import init_distributed

        if settings.kind not in ENGINE_KINDS:
            raise ValueError(f"engine kind {settings.kind!r} is not one of {ENGINE_KINDS}")
        parallel = settings.parallel
        init_distributed(rank=self.rank, world_size=self.world_size, master_addr=master_addr,
                         master_port=master_port, tp=parallel["tp"], pp=parallel["pp"], vpp=parallel.get("vpp"),
                         ep=parallel.get("ep", 1))
        common = dict(hf_config=hf_config, weights=weights, seed=settings.seed, params_dtype=settings.params_dtype,
                      transformer_impl=settings.transformer_impl, optimizer=settings.optimizer)
        if settings.kind == "policy":
            from megarl.engines.actor import PolicyEngine

            self.engine = PolicyEngine(**common, lora_settings=settings.lora)
        elif settings.kind == "value":
            from megarl.engines.critic import ValueEngine

            self.engine = ValueEngine(**common)
        else:
            from megarl.engines.reward_model import RewardModelEngine

            self.engine = RewardModelEngine(**common)

    def init_reference(self, settings: EngineSettings, *, hf_config: dict, weights: str | None) -> None:
        """Build the frozen reference policy beside this rank's actor, in the same process group (the fused
        actor-reference worker: a reference with the actor's pool and layout needs no ranks of its own)."""
        from megarl.engines.actor import PolicyEngine

        if settings.optimizer is not None or settings.lora is not None:
            raise ValueError("init_reference: the reference is frozen and has no adapters")
        self.reference = PolicyEngine(hf_config=hf_config, weights=weights, seed=settings.seed,
                                      params_dtype=settings.params_dtype,
                                      transformer_impl=settings.transformer_impl, optimizer=None)

    def _engine(self, reference: bool):
        """The engine a call is for: the fused reference (`reference=True`) or the rank's own."""
        if not reference:
            return self.engine
        if self.reference is None:
            raise RuntimeError("this worker holds no reference engine (init_reference was not called)")
        return self.reference

    def _engines(self) -> list:
        return [engine for engine in (self.engine, self.reference) if engine is not None]

    def parallel_layout(self) -> dict[str, Any]:
        from megarl.engines.distributed import parallel_layout

        return parallel_layout()

    def _output(self, result):
        """`result` on the ranks that hold the output, None on the others."""
        return result if self.parallel_layout()["is_output"] else None

    def compute_log_prob(self, shard: Batch, *, key: str, temperature: float, with_entropy: bool,
                         batching: Batching, adapters: bool = True, reference: bool = False) -> Batch | None:
        """Log-probs (and entropy) of this rank's rows under `key`; `adapters=False`: a LoRA policy's base model;
        `reference=True`: the fused reference's."""
        engine = self._engine(reference)
        log_probs, entropy = engine.compute_log_prob(shard, temperature=temperature, with_entropy=with_entropy,
                                                     batching=batching, adapters=adapters)
        out = {key: log_probs, **({"entropy": entropy} if with_entropy else {})}
        return self._output(Batch.from_dict(out))

    def compute_values(self, shard: Batch, *, batching: Batching) -> Batch | None:
        return self._output(Batch.from_dict({"values": self.engine.compute_values(shard, batching=batching)}))

    def compute_scores(self, shard: Batch, *, batching: Batching) -> Batch | None:
        return self._output(Batch.from_dict({"scores": self.engine.compute_scores(shard, batching=batching)}))

    def update(self, shard: Batch, settings) -> dict[str, float] | None:
        """One update (PPO policy or value, or Bradley-Terry, by the engine) on this rank's shard."""
        return self._output(self.engine.update(shard, settings))

    def sft_step(self, shard: Batch, *, batching: Batching, lr: float) -> dict[str, float] | None:
        return self._output(self.engine.sft_step(shard, batching=batching, lr=lr))

    def save_checkpoint(self, ckpt_dir: str, *, weights_only: bool = False, reference: bool = False) -> None:
        """Distributed checkpoint of this role, or of the fused reference (collective over its ranks)."""
        self._engine(reference).save_checkpoint(ckpt_dir, weights_only=weights_only)

    def load_checkpoint(self, ckpt_dir: str, *, load_optimizer: bool, reference: bool = False) -> None:
        self._engine(reference).load_checkpoint(ckpt_dir, load_optimizer=load_optimizer)

    def load_policy_checkpoint(self, ckpt_dir: str) -> None:
        """The weights of a policy's checkpoint (a value model takes the backbone); each rank reads its shards."""
        self.engine.load_policy_checkpoint(ckpt_dir)

    def copy_actor_to_reference(self) -> None:
        """The fused reference takes the actor's current weights (after the SFT warm-up): the same layout in the
        same process, so tensor by tensor, with no checkpoint in between."""
        self.reference.copy_weights_from(self.engine)

    def reset_optimizer_state(self) -> None:
        """Forget Adam moments (e.g. after the SFT warm-up) so they do not leak into RL updates."""
        self.engine.reset_optimizer_state()

    def offload(self, *, weights: bool) -> None:
        """Off the device: the engine's optimizer state and gradients (and its weights with `weights`); a fused
        reference always goes whole, since it has nothing to do between its log-prob pass and the next step's."""
        self.engine.offload(weights=weights)
        if self.reference is not None:
            self.reference.offload(weights=True)

    def onload(self) -> None:
        for engine in self._engines():
            engine.onload()

    def peak_memory_gb(self) -> float:
        """This rank's peak memory: device memory on a GPU, the process's resident set on CPU."""
        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux

    def train_state_gb(self, *, reference: bool = False) -> float:
        """The weights, gradient buffers and optimizer state this rank's engine (or fused reference) holds."""
        return self._engine(reference).train_state_bytes() / 2**30

    def push_weights(self, *, urls: list[str], api_key: str | None, version: int, settings: WeightSyncSettings,
                     devices: list[list[str]] | None = None) -> dict[str, float] | None:
        """Load this policy's weights into every server in `urls` under `version`; metrics on rank 0, else None.

        Collective over all ranks: `megarl.weightsync` reshards bucket by bucket, each PP stage
        assembling its buckets over TP while its sender pushes them, stages in parallel.
        `devices`: per server, its TP ranks' GPU UUIDs (the fleet's; the tensor transport on GPUs needs them).
        """
        from megarl.engines.distributed import parallel_layout
        from megarl.weightsync.engine_sync import EngineWeightSync
        from megarl.weightsync.groups import RankCoords
        from megarl.weightsync.lora_sync import AdapterSync

        coords = RankCoords.from_layout(parallel_layout())
        adapters = self.engine.adapter_shards() if settings.lora == "adapter" else None
        if adapters is not None:  # a LoRA policy's adapters alone (`weight_sync.lora: adapter`)
            if self._adapter_sync is None:
                self._adapter_sync = AdapterSync()
            return self._adapter_sync.push(adapters, coords=coords, urls=urls, api_key=api_key, version=version,
                                           settings=settings)
        if self._weight_sync is None:
            self._weight_sync = EngineWeightSync()
        return self._weight_sync.push(self.engine.weight_shards(), coords=coords, urls=urls, api_key=api_key,
                                      version=version, settings=settings, server_devices=devices)

    def close_weight_sync(self) -> None:
        """Leave the servers' weight-update groups and close the sync clients (before the servers stop)."""
        if self._weight_sync is not None:
            self._weight_sync.close()
            self._weight_sync = None


def start_engine_group(pool, *, name: str, settings: EngineSettings, hf_config: dict, weights: str | None,
                       log_dir: Path | None) -> WorkerGroup:
    """`pool.world_size` ranks hosting one engine (see `MegatronWorker.init_engine`) of `settings`; each rank's
    output goes to `<log_dir>/<name>-<rank>.log`."""
    group = WorkerGroup(MegatronWorker, pool, name=name, log_dir=log_dir)
    master_addr, master_port = group.run_rank(0, MegatronWorker.master_endpoint)
    group.run(MegatronWorker.init_engine, settings, master_addr=master_addr, master_port=master_port,
              hf_config=hf_config, weights=weights)
    return group
