"""Which roles a recipe runs, on which resource pool, with which parallel layout.

The one place that turns `placement` + per-role `parallel` into world sizes, so
the validation checks, the `megarl validate` dry run and the controller's
placement all agree on what a recipe means.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megarl.config.schema import PlacementConfig, Recipe
from megarl.config.training import Parallel

TRAINING_ROLES = ("actor", "critic", "reference", "reward_model")
FLEET_ROLES = ("rollout", "judge")
COLOCATED_POOL = "colocated"


@dataclass(frozen=True)
class Pool:
    name: str
    nodes: int
    gpus_per_node: int

    @property
    def size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class TrainingLayout:
    """Megatron layout of one training role; `dp` is None only when the pool does not divide by tp*pp."""

    role: str
    pool: Pool
    tp: int
    pp: int
    vpp: int | None
    ep: int
    dp: int | None
    sequence_parallel: bool

    @property
    def world_size(self) -> int:
        return self.pool.size


@dataclass(frozen=True)
class RolloutLayout:
    pool: Pool
    num_servers: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.num_servers * self.tp


def active_roles(recipe: Recipe) -> tuple[str, ...]:
    """Roles `megarl train` starts: actor and rollout always, critic and reward_model iff configured,
    reference iff KL is used without LoRA (with `actor.lora` the actor computes the reference log-probs with its
    adapters off), judge iff reward.judge is configured."""
    roles = ["actor"]
    if recipe.critic is not None:
        roles.append("critic")
    if (recipe.algorithm.use_kl_in_reward or recipe.actor.use_kl_loss) and recipe.actor.lora is None:
        roles.append("reference")
    if recipe.reward_model is not None:
        roles.append("reward_model")
    roles.append("rollout")
    if recipe.reward.judge is not None:
        roles.append("judge")
    return tuple(roles)


def role_pool(placement: PlacementConfig, role: str) -> Pool | None:
    """The pool `role` runs on; None when a disaggregated placement gives it no existing pool."""
    if placement.colocate:
        return Pool(COLOCATED_POOL, placement.nodes, placement.gpus_per_node)
    pool_name = placement.roles.get(role)  # type: ignore[call-overload]
    spec = placement.pools.get(pool_name) if pool_name is not None else None
    return None if spec is None else Pool(pool_name, spec.nodes, spec.gpus_per_node)


def role_parallel(recipe: Recipe, role: str) -> Parallel:
    """The `parallel` section of a training role (critic must be configured)."""
    if role == "actor":
        return recipe.actor.parallel
    if role == "critic":
        if recipe.critic is None:
            raise ValueError("role_parallel: the recipe has no critic section")
        return recipe.critic.parallel
    if role == "reference":
        return recipe.reference.parallel
    if role == "reward_model":
        if recipe.reward_model is None:
            raise ValueError("role_parallel: the recipe has no reward_model section")
        return recipe.reward_model.parallel
    raise ValueError(f"role_parallel: {role!r} is not one of {TRAINING_ROLES}")


def training_layout(recipe: Recipe, role: str) -> TrainingLayout:
    """Resolved layout of a training role; ValueError when its pool does not resolve (validate first)."""
    pool = role_pool(recipe.placement, role)
    if pool is None:
        raise ValueError(f"training_layout: role {role!r} has no pool in placement")
    parallel = role_parallel(recipe, role)
    model_parallel = parallel.tp * parallel.pp
    derived_dp = pool.size // model_parallel if pool.size % model_parallel == 0 else None
    return TrainingLayout(
        role=role,
        pool=pool,
        tp=parallel.tp,
        pp=parallel.pp,
        vpp=parallel.vpp,
        ep=parallel.ep,
        dp=parallel.dp if parallel.dp is not None else derived_dp,
        sequence_parallel=parallel.sequence_parallel,
    )


def reference_fused(recipe: Recipe) -> bool:
    """Whether the reference runs inside the actor's ranks, a second frozen engine in each actor process (as
    verl's fused actor-reference worker), rather than on ranks of its own: when it is active and shares the
    actor's pool and layout, processes of its own would only add a runtime per rank (the interpreter, its
    imports, a CUDA context) holding the same shards on the same devices."""
    if "reference" not in active_roles(recipe):
        return False
    return replace(training_layout(recipe, "reference"), role="actor") == training_layout(recipe, "actor")


def rollout_layout(recipe: Recipe, role: str = "rollout") -> RolloutLayout:
    """Resolved fleet of `role` ("rollout", or "judge" when reward.judge is set); ValueError when its pool
    does not resolve (validate first)."""
    pool = role_pool(recipe.placement, role)
    if pool is None:
        raise ValueError(f"rollout_layout: role {role!r} has no pool in placement")
    fleet = recipe.rollout if role == "rollout" else recipe.reward.judge
    return RolloutLayout(pool=pool, num_servers=fleet.num_servers, tp=fleet.tp)


def resolve_layout(recipe: Recipe) -> dict[str, TrainingLayout | RolloutLayout]:
    """Layout of every active role, in `active_roles` order."""
    return {
        role: rollout_layout(recipe, role) if role in FLEET_ROLES else training_layout(recipe, role)
        for role in active_roles(recipe)
    }
