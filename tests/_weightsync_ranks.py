"""Trainer-side helpers for the weight-sync tests, and the spawned trainer ranks (run by
`_engine_spawn.run_spawned(..., layout=None)`: each sets up its own groups).

Kept free of pytest and transformers: every spawned rank re-imports this module,
and on two shared cores four ranks importing transformers took ~40 s.
"""

from __future__ import annotations

import torch

from _engine_workers import policy_engine
from megarl.config.settings import WeightSyncSettings
from megarl.models import arch_from_hf, hf_param_shapes, hf_to_megatron, shard_for_rank
from megarl.rollout.client import RolloutClient
from megarl.rollout.weight_wire import held_checksum
from megarl.weightsync import RankCoords, SyncGroups, TrainerLayout, WeightSyncer, build_plan, make_transport

API_KEY = "sync-key"
CONFIG = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, max_position_embeddings=128, tie_word_embeddings=False)
ARCH = arch_from_hf({"model_type": "llama", **CONFIG})
BUCKET_BYTES = 40_000  # several buckets per stage
SYNC_BUCKET_BYTES = 52_428  # 0.05 MiB: an engine's push is several buckets too
PP_TRANSPORTS = {"distributed": 31, "tensor": 32, "disk": 33}  # transport -> weight seed


def trainer_weights(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in hf_param_shapes(ARCH).items():
        noise = torch.randn(shape, generator=gen)
        weights[name] = (1 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise).to(dtype)
    return weights


def local_shards(hf, layout: TrainerLayout, *, tp_rank: int = 0, pp_rank: int = 0, padded_vocab: int):
    """What the (tp_rank, pp_rank) model chunks of a trainer at `layout` hold, keyed as the plan expects."""
    full = hf_to_megatron(hf, ARCH, padded_vocab=padded_vocab)
    chunks = shard_for_rank(full, num_layers=ARCH.num_layers, tie_word_embeddings=False, tp_rank=tp_rank,
                            tp_size=layout.tp, pp_rank=pp_rank, pp_size=layout.pp, vpp_size=layout.vpp)
    return {(vpp, name): tensor for vpp, chunk in enumerate(chunks) for name, tensor in chunk.items()}


def server_digests(client: RolloutClient) -> dict[str, str]:
    reply = client.run(client.request(client.urls[0], "POST", "/weights_checker", {"action": "checksum"}))
    return {name: checksum for rank in reply["ranks"] for name, checksum in rank["checksums"].items()}


def reference_digests(hf) -> dict[str, str]:
    return {name: held_checksum(tensor) for name, tensor in hf.items()}


def tp2_pp2_rank(*, rank: int, world_size: int, port: int, url: str, disk_dir: str, transports: list[str],
                 shared_memory: bool) -> dict:
    """One of four bf16 trainer ranks (TP2 x PP2): one sync per transport, each with other weights.
    `shared_memory` False makes the TP ranks assemble by point-to-point gather, as on GPUs or across hosts.

    Returns, per transport, its SyncStats and (rank 0) the server's digests right after that sync,
    and under "same_host" what the sync groups found.
    """
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world_size)
    coords = RankCoords(rank=rank, world_size=world_size, tp_rank=rank % 2, tp_size=2, pp_rank=rank // 2,
                        pp_size=2)
    layout = TrainerLayout(tp=2, pp=2)
    plan = build_plan(ARCH, layout, dtype=torch.bfloat16, bucket_bytes=BUCKET_BYTES)
    groups = SyncGroups.build(coords, timeout_s=60)
    results = {"same_host": groups.tp_same_host}
    groups.tp_same_host = groups.tp_same_host and shared_memory
    client = RolloutClient([url], api_key=API_KEY, timeout_s=60) if coords.tp_rank == 0 else None
    for name in transports:
        seed = PP_TRANSPORTS[name]
        local = local_shards(trainer_weights(seed, torch.bfloat16), layout, tp_rank=coords.tp_rank,
                             pp_rank=coords.pp_rank, padded_vocab=plan.padded_vocab)
        syncer = WeightSyncer(plan, make_transport(name, client, timeout_s=60, disk_dir=disk_dir), groups,
                              client=client, verify=True)
        stats = syncer.push(local, weight_version=f"pp-{name}")
        results[name] = (stats, server_digests(client) if rank == 0 else None)
        syncer.close()
    if client is not None:
        client.close()
    torch.distributed.destroy_process_group()
    return results


def megatron_worker_pushes(*, rank: int, checkpoint: str, url: str, disk_dir: str) -> dict:
    """A Megatron rank (of TP2 x PP2): `MegatronWorker.push_weights` through each path, as the controller calls it.

    Returns, on trainer rank 0, each push's metrics, the server's digests and reported version after it.
    """
    from megarl.cluster.engine_worker import MegatronWorker

    worker = MegatronWorker(rank=rank, world_size=4)
    worker.engine = policy_engine(checkpoint)
    client = RolloutClient([url], api_key=API_KEY, timeout_s=60) if rank == 0 else None
    results = {}
    for version, (transport, verify) in enumerate([("distributed", "checksum"),
                                                   ("distributed", "checksum"),  # groups reused
                                                   ("disk", "checksum"),
                                                   ("tensor", "checksum"),
                                                   ("tensor", "none")]):
        settings = WeightSyncSettings(transport=transport, bucket_bytes=SYNC_BUCKET_BYTES, verify=verify,
                                      timeout_s=60, disk_dir=disk_dir, lora="merged")
        metrics = worker.push_weights(urls=[url], api_key=API_KEY, version=version, settings=settings)
        if rank == 0:
            results[version] = (metrics, server_digests(client), client.model_info()[0]["weight_version"])
    worker.close_weight_sync()
    if client is not None:
        client.close()
    return results


def megatron_moe_ep_push(*, rank: int, checkpoint: str, url: str) -> dict | None:
    """A Megatron rank of an EP2 (DP2) MoE policy: one checked tensor-transport push, as the controller makes it.

    Returns, on trainer rank 0, the push's metrics and the server's digests after it.
    """
    from megarl.cluster.engine_worker import MegatronWorker

    worker = MegatronWorker(rank=rank, world_size=2)
    worker.engine = policy_engine(checkpoint)
    settings = WeightSyncSettings(transport="tensor", bucket_bytes=SYNC_BUCKET_BYTES, verify="checksum",
                                  timeout_s=60, disk_dir="unused", lora="merged")
    metrics = worker.push_weights(urls=[url], api_key=API_KEY, version="ep", settings=settings)
    digests = None
    if rank == 0:
        with RolloutClient([url], api_key=API_KEY, timeout_s=60) as client:
            digests = server_digests(client)
    worker.close_weight_sync()
    return {"metrics": metrics, "digests": digests}


MOE_CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                  norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=128)
MOE_ARCH = arch_from_hf({"model_type": "qwen3_moe", **MOE_CONFIG})


def moe_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: 0.05 * torch.randn(shape, generator=gen) for name, shape in hf_param_shapes(MOE_ARCH).items()}


def moe_rank(*, rank: int, world_size: int, port: int, urls: list[str], pp: int, ep: int, transport: str, seed: int,
             devices: list[str] | None = None, server_devices: list[list[str]] | None = None) -> dict:
    """One trainer rank (TP1) of a MoE policy at PP `pp` x EP `ep`, pushing seed `seed`'s weights to every server
    of `urls` through `transport`; with `devices`, the tensor transport fans out as on GPUs, rank r standing on
    device `devices[r]` and server i's TP rank r on `server_devices[i][r]`. Returns rank 0's stats."""
    from megarl.weightsync.tensor_transport import TensorTransport

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world_size)
    dp = world_size // pp
    layout = TrainerLayout(pp=pp, dp=dp, ep=ep)
    dp_rank, pp_rank = rank % dp, rank // dp  # Megatron's order with TP 1: rank = dp_rank + dp * pp_rank
    coords = RankCoords(rank=rank, world_size=world_size, pp_rank=pp_rank, pp_size=pp, dp_rank=dp_rank, dp_size=dp,
                        ep_rank=dp_rank % ep, ep_size=ep)
    plan = build_plan(MOE_ARCH, layout, dtype=torch.float32, bucket_bytes=20_000)
    full = hf_to_megatron(moe_weights(seed), MOE_ARCH, padded_vocab=plan.padded_vocab)
    chunk = shard_for_rank(full, num_layers=MOE_ARCH.num_layers, tie_word_embeddings=False, tp_rank=0, tp_size=1,
                           pp_rank=pp_rank, pp_size=pp, ep_rank=coords.ep_rank, ep_size=ep)[0]
    groups = SyncGroups.build(coords, timeout_s=60, device=devices[rank] if devices else None)
    client = RolloutClient(urls, api_key=API_KEY, timeout_s=60) if rank == 0 or coords.is_sender else None
    if devices:
        sender_transport = TensorTransport(client, server_devices=server_devices, fanout=True)
    else:
        sender_transport = make_transport(transport, client, timeout_s=60)
    syncer = WeightSyncer(plan, sender_transport, groups, client=client, verify=True)
    stats = syncer.push({(0, name): tensor for name, tensor in chunk.items()}, weight_version=f"{transport}-{seed}")
    syncer.close()
    if client is not None:
        client.close()
    torch.distributed.destroy_process_group()
    return {"stats": stats, "senders": groups.senders}
