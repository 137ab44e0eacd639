"""Starting a fleet on the cluster: the policy's or the LLM judge's `RolloutFleet`, from its `FleetSettings`.

One server per `tp` slots of the fleet's pool, each owned by a Ray
actor on its first slot with the pool's per-role share of the bundle; on GPUs
the server process sees the GPUs of its `tp` slots, whose UUIDs the fleet hands
to the weight sync. Generation, routing, restarts and weight versions live in
`megarl.rollout.fleet`.
"""

from __future__ import annotations

from pathlib import Path

from megarl.cluster.placement import ResourcePool
from megarl.config.settings import FleetSettings
from megarl.rollout.fleet import RolloutFleet
from megarl.rollout.server_host import HostPlacement, ServerSpec

__all__ = ["RolloutFleet", "start_fleet"]


def start_fleet(settings: FleetSettings, *, pool: ResourcePool, weights: Path | None, pad_token_id: int, api_key: str,
                log_dir: Path) -> RolloutFleet:
    """Start the `settings.num_servers` servers of a fleet on `pool` with the run's API key: the policy's with
    the run's initial `weights`, the judge's (`weights=None`) with its fixed `settings.model_path`."""
    model_path = str(weights) if weights is not None else settings.model_path
    spec = ServerSpec(
        backend=settings.backend,
        model_path=model_path,
        tokenizer_path=settings.tokenizer_path or model_path,
        log_dir=str(log_dir),
        api_key=api_key,
        bind=settings.bind,
        port=settings.port,
        threads=settings.threads,
        tp=settings.tp,
        mem_fraction=settings.mem_fraction,
        sglang_args=dict(settings.sglang_args),
        enable_memory_saver=settings.enable_memory_saver,
        enable_weights_cpu_backup=settings.enable_weights_cpu_backup,
        lora_max_rank=settings.lora_max_rank,
        lora_target_modules=settings.lora_target_modules,
        deterministic=settings.deterministic,
        max_sequences=settings.max_sequences,
    )
    return RolloutFleet(
        spec,
        num_servers=settings.num_servers,
        pad_token_id=pad_token_id,
        seed=settings.seed,
        max_concurrency=settings.max_concurrency,
        routing=settings.routing,
        router_policy=settings.router_policy,
        use_ray=True,
        startup_timeout_s=settings.startup_timeout_s,
        placements=host_placements(pool, num_servers=settings.num_servers, tp=settings.tp),
        lora_adapters=settings.lora_max_rank is not None,
    )


def host_placements(pool: ResourcePool, *, num_servers: int, tp: int) -> list[HostPlacement]:
    """Server i's host on slot i*tp; on GPUs its server uses the GPUs of slots i*tp .. i*tp+tp-1."""
    pool.reserve()
    placements = []
    for server in range(num_servers):
        first = server * tp
        gpus = pool.slot_gpus(list(range(first, first + tp))) if pool.device == "cuda" else None
        placements.append(HostPlacement(
            actor_options=pool.actor_options(first),
            gpu_ids=tuple(gpu for gpu, _ in gpus) if gpus else None,
            device_uuids=tuple(uuid for _, uuid in gpus) if gpus else None,
        ))
    return placements
