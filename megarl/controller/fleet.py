"""The controller's side of the rollout fleets: the policy's and the LLM judge's `RolloutFleet`, built from a recipe.

One server per `rollout.tp` slots of the rollout pool, each owned by a Ray
actor on its first slot with the pool's per-role share of the bundle.
Generation, routing, restarts and weight versions live in `megarl.rollout.fleet`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megarl.config import Recipe
from megarl.controller.placement import ResourcePool
from megarl.rollout.fleet import RolloutFleet
from megarl.rollout.server_host import ServerSpec

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
    )
    pool.reserve()
    share = pool.share()
    actor_options = {"num_cpus": share, **({"num_gpus": share} if pool.device == "cuda" else {})}
    return RolloutFleet(
        spec,
        num_servers=rollout.num_servers,
        max_response_length=recipe.data.max_response_length,
        pad_token_id=tokenizer.pad_token_id,
        stop_token_ids=[tokenizer.eos_token_id],
        seed=recipe.seed,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_concurrency=rollout.max_concurrency,
        routing=rollout.routing,
        router_policy=rollout.router_policy,
        use_ray=True,
        slots=[pool.slot(rank) for rank in range(rollout.num_servers * rollout.tp)],
        actor_options=actor_options,
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
    pool.reserve()
    share = pool.share()
    actor_options = {"num_cpus": share, **({"num_gpus": share} if pool.device == "cuda" else {})}
    return RolloutFleet(
        spec,
        num_servers=judge.num_servers,
        max_response_length=judge.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        stop_token_ids=[tokenizer.eos_token_id],
        seed=recipe.seed,
        max_concurrency=judge.max_concurrency,
        use_ray=True,
        slots=[pool.slot(rank) for rank in range(judge.num_servers * judge.tp)],
        actor_options=actor_options,
    )
