"""Starting the rollout fleets on the cluster: the policy's and the LLM judge's `RolloutFleet`, built from a recipe.

One server per `rollout.tp` slots of the rollout pool, each owned by a Ray
actor on its first slot with the pool's per-role share of the bundle; on GPUs
the server process sees the GPUs of its `tp` slots, whose UUIDs the fleet hands
to the weight sync. Generation, routing, restarts and weight versions live in
`megarl.rollout.fleet`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megarl.cluster.placement import ResourcePool
from megarl.config import Recipe
from megarl.rollout.fleet import RolloutFleet
from megarl.rollout.server_host import HostPlacement, ServerSpec

__all__ = ["RolloutFleet", "start_judge_fleet", "start_rollout_fleet"]


def start_rollout_fleet(
    recipe: Recipe, *, pool: ResourcePool, weights: Path, tokenizer: Any, api_key: str, log_dir: Path
) -> RolloutFleet:
    """Start `rollout.num_servers` servers on `pool` with the run's initial `weights` and API key."""
    rollout = recipe.rollout
    spec = ServerSpec(
        backend=rollout.backend,
        model_path=str(weights),
        tokenizer_path=str(weights),
        log_dir=str(log_dir),
        api_key=api_key,
        bind=rollout.host,
        port=rollout.port,
        threads=rollout.engine_threads,
        tp=rollout.tp,
        mem_fraction=rollout.mem_fraction,
        sglang_args=dict(rollout.sglang),
        enable_memory_saver=sleeps_between_phases(recipe),
    )
    return RolloutFleet(
        spec,
        num_servers=rollout.num_servers,
        max_response_length=recipe.data.max_response_length,
        pad_token_id=tokenizer.pad_token_id,
        stop_token_ids=[tokenizer.eos_token_id],
        seed=recipe.seed,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        ignore_eos=rollout.ignore_eos,
        max_concurrency=rollout.max_concurrency,
        routing=rollout.routing,
        router_policy=rollout.router_policy,
        use_ray=True,
        startup_timeout_s=rollout.startup_timeout_s,
        placements=host_placements(pool, num_servers=rollout.num_servers, tp=rollout.tp),
    )


def start_judge_fleet(recipe: Recipe, *, pool: ResourcePool, tokenizer: Any, api_key: str,
                      log_dir: Path) -> RolloutFleet:
    """Start `reward.judge.num_servers` judge servers on `pool` (the rollout's backend, fixed weights)."""
    judge = recipe.reward.judge
    spec = ServerSpec(
        backend=recipe.rollout.backend,
        model_path=judge.model_path,
        tokenizer_path=judge.tokenizer or judge.model_path,
        log_dir=str(log_dir),
        api_key=api_key,
        bind=recipe.rollout.host,
        threads=judge.engine_threads,
        tp=judge.tp,
        mem_fraction=judge.mem_fraction,
        sglang_args=dict(judge.sglang),
    )
    return RolloutFleet(
        spec,
        num_servers=judge.num_servers,
        max_response_length=judge.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        stop_token_ids=[tokenizer.eos_token_id],
        seed=recipe.seed,
        max_concurrency=judge.max_concurrency,
        use_ray=True,
        startup_timeout_s=recipe.rollout.startup_timeout_s,
        placements=host_placements(pool, num_servers=judge.num_servers, tp=judge.tp),
    )


def sleeps_between_phases(recipe: Recipe) -> bool:
    """Whether the fleet and the engines take turns on the devices (`megarl.cluster.memory`)."""
    return recipe.placement.colocate and recipe.placement.offload


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
