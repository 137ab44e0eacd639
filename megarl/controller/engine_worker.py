"""The Ray actor that hosts one rank of a Megatron engine (actor, reference or critic).

The controller creates one per rank (see `WorkerGroup`), initialises torch
distributed + Megatron parallel state in each, then calls one method per phase
with this rank's data-parallel shard. Ranks that do not hold the output (TP
rank > 0, or not the last pipeline stage) return None.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from megarl.ports import free_port
from megarl.protocol import Batch


class MegatronWorker:
    def __init__(self, *, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.engine = None
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    def master_endpoint(self) -> tuple[str, int]:
        """Called on rank 0: where the other ranks meet it for the process group."""
        host = "127.0.0.1" if self.world_size == 1 or not torch.cuda.is_available() else socket.gethostbyname(socket.gethostname())
        return host, free_port()

    def _init_distributed(self, *, master_addr: str, master_port: int, parallel: dict) -> None:
        from megarl.engines.distributed import init_distributed

        init_distributed(
            rank=self.rank,
            world_size=self.world_size,
            master_addr=master_addr,
            master_port=master_port,
            tp=parallel["tp"],
            pp=parallel["pp"],
            vpp=parallel.get("vpp"),
            ep=parallel.get("ep", 1),
        )

    def init_engine(self, *, master_addr: str, master_port: int, parallel: dict, engine_kwargs: dict) -> None:
        """This rank hosts a `PolicyEngine` (actor or frozen reference)."""
        self._init_distributed(master_addr=master_addr, master_port=master_port, parallel=parallel)
        from megarl.engines.actor import PolicyEngine

        self.engine = PolicyEngine(**engine_kwargs)

    def parallel_layout(self) -> dict[str, Any]:
        from megarl.engines.distributed import parallel_layout

        return parallel_layout()

    def _is_output(self) -> bool:
        return self.parallel_layout()["is_output"]

    def compute_log_prob(self, shard: Batch, *, temperature: float, micro_batch_size: int, with_entropy: bool,
                         key: str, max_tokens_per_microbatch: int | None = None) -> Batch | None:
        log_probs, entropy = self.engine.compute_log_prob(
            input_ids=shard["input_ids"],
            attention_mask=shard["attention_mask"],
            position_ids=shard["position_ids"],
            response_length=shard["responses"].shape[1],
            temperature=temperature,
            micro_batch_size=micro_batch_size,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            with_entropy=with_entropy,
        )
        if not self._is_output():
            return None
        out = {key: log_probs}
        if with_entropy:
            out["entropy"] = entropy
        return Batch.from_dict(out)

    def update_actor(self, shard: Batch, **ppo_kwargs) -> dict[str, float] | None:
        metrics = self.engine.update_policy(
            input_ids=shard["input_ids"],
            attention_mask=shard["attention_mask"],
            position_ids=shard["position_ids"],
            response_mask=shard["response_mask"],
            old_log_probs=shard["old_log_probs"],
            advantages=shard["advantages"],
            ref_log_prob=shard["ref_log_prob"] if "ref_log_prob" in shard else None,
            **ppo_kwargs,
        )
        return metrics if self._is_output() else None

    def sft_step(self, shard: Batch, *, micro_batch_size: int, lr: float,
                 max_tokens_per_microbatch: int | None = None) -> dict[str, float] | None:
        metrics = self.engine.sft_step(
            input_ids=shard["input_ids"],
            attention_mask=shard["attention_mask"],
            position_ids=shard["position_ids"],
            loss_mask=shard["loss_mask"],
            micro_batch_size=micro_batch_size,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            lr=lr,
        )
        return metrics if self._is_output() else None

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named weights (collective over TP/PP); returned by rank 0 only."""
        named = self.engine.hf_state_dict()
        return named if self.rank == 0 else None

    def load_hf_state_dict(self, named: dict[str, torch.Tensor]) -> None:
        self.engine.load_hf_state_dict(named)

    def save_checkpoint(self, ckpt_dir: str) -> None:
        """Distributed checkpoint of this role (collective over its ranks)."""
        self.engine.save_checkpoint(ckpt_dir)

    def reset_optimizer_state(self) -> None:
        """Forget Adam moments (e.g. after the SFT warm-up) so they do not leak into RL updates."""
        optimizer = self.engine.train.optimizer
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner.optimizer.state.clear()

    def init_critic(self, *, master_addr: str, master_port: int, parallel: dict, engine_kwargs: dict) -> None:
        """Like `init_engine`, but this rank hosts a `ValueEngine` (the GAE critic)."""
        self._init_distributed(master_addr=master_addr, master_port=master_port, parallel=parallel)
        from megarl.engines.critic import ValueEngine

        self.engine = ValueEngine(**engine_kwargs)

    def compute_values(self, shard: Batch, *, micro_batch_size: int,
                       max_tokens_per_microbatch: int | None = None) -> Batch | None:
        values = self.engine.compute_values(
            input_ids=shard["input_ids"],
            attention_mask=shard["attention_mask"],
            position_ids=shard["position_ids"],
            response_length=shard["responses"].shape[1],
            micro_batch_size=micro_batch_size,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
        )
        return Batch.from_dict({"values": values}) if self._is_output() else None

    def update_critic(self, shard: Batch, **value_kwargs) -> dict[str, float] | None:
        metrics = self.engine.update_critic(
            input_ids=shard["input_ids"],
            attention_mask=shard["attention_mask"],
            position_ids=shard["position_ids"],
            response_mask=shard["response_mask"],
            values=shard["values"],
            returns=shard["returns"],
            **value_kwargs,
        )
        return metrics if self._is_output() else None

    def push_weights(
        self,
        *,
        urls: list[str],
        api_key: str | None,
        version: int,
        transport: str = "tensor",
        bucket_mb: float = 512,
        verify: str = "none",
        timeout_s: float = 600.0,
        disk_dir: str | None = None,
        devices: list[list[str]] | None = None,
    ) -> dict[str, float] | None:
        """Load this policy's weights into every server in `urls` under `version`; metrics on rank 0, else None.

        Collective over all ranks. `transport` "tensor", "distributed" or "disk" (`recipe.weight_sync`)
        reshards bucket by bucket through `megarl.weightsync`: each PP stage assembles its buckets
        over TP and its sender pushes them. `devices`: per server, its TP ranks' GPU UUIDs (the fleet's).
        """
        from megarl.engines.distributed import parallel_layout
        from megarl.weightsync.engine_sync import EngineWeightSync
        from megarl.weightsync.groups import RankCoords

        if getattr(self, "_weight_sync", None) is None:
            self._weight_sync = EngineWeightSync()
        model = self.engine.model
        return self._weight_sync.push(
            chunks=model.chunks, arch=model.arch, padded_vocab=model.padded_vocab,
            coords=RankCoords.from_layout(parallel_layout()), urls=urls, api_key=api_key, version=version,
            transport=transport, bucket_mb=bucket_mb, verify=verify, timeout_s=timeout_s, disk_dir=disk_dir,
            server_devices=devices,
        )

    def close_weight_sync(self) -> None:
        """Leave the servers' weight-update groups and close the sync clients (before the servers stop)."""
        if getattr(self, "_weight_sync", None) is not None:
            self._weight_sync.close()
            self._weight_sync = None

