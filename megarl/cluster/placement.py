"""Resource pools and role placement on Ray: the only place that knows placement groups and GPU ids.

A pool is `nodes x per_node` device slots reserved as Ray placement-group
bundles (one STRICT_PACK group per node, so a node's ranks stay together).
Roles that share a pool (actor, critic, rollout by default) put one worker
each on every bundle and split the slot's resources between them; a reference
fused into the actor's workers (`reference_fused`) takes no share.
`actor_options(rank)` places a Ray actor on slot `rank` with its role's share;
`slot_gpus` finds the GPU id and UUID Ray gives each slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.config import Recipe
from megarl.config.layout import active_roles, reference_fused, role_pool

@dataclass(eq=False)  # identity semantics: roles sharing a pool share the object
class ResourcePool:
    """`nodes * per_node` slots; `device` is "cuda" (a GPU per slot) or "cpu" (a process per slot)."""

    name: str
    nodes: int
    per_node: int
    device: str
    roles: list[str] = field(default_factory=list)
    _groups: list = field(default_factory=list, repr=False)

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    def bundle(self) -> dict[str, float]:
        return {"GPU": 1.0, "CPU": 1.0} if self.device == "cuda" else {"CPU": 1.0}

    def reserve(self, timeout_s: float = 300.0) -> None:
        """Create the placement groups and wait until Ray grants them."""
        import ray
        from ray.util.placement_group import placement_group

        if self._groups:
            return
        self._groups = [
            placement_group([self.bundle()] * self.per_node, strategy="STRICT_PACK", name=f"megarl-{self.name}-{node}")
            for node in range(self.nodes)
        ]
        ready = [group.ready() for group in self._groups]
        done, pending = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)
        if pending:
            raise RuntimeError(
                f"resource pool {self.name!r}: Ray could not grant {self.nodes} x {self.per_node} "
                f"{self.bundle()} within {timeout_s:.0f} s (cluster resources: {ray.cluster_resources()})"
            )

    def slot(self, rank: int):
        """The (placement group, bundle index) of global slot `rank`."""
        node, local = divmod(rank, self.per_node)
        return self._groups[node], local

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self._groups:
            remove_placement_group(group)
        self._groups = []

    def share(self) -> float:
        """Fraction of one slot each colocated role's worker asks for."""
        return 1.0 / max(1, len(self.roles))

    def actor_options(self, rank: int) -> dict:
        """Ray actor options that put an actor on slot `rank` with one role's share of its resources."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group, bundle = self.slot(rank)
        share = self.share()
        return {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=bundle
            ),
            "num_cpus": share,
            **({"num_gpus": share} if self.device == "cuda" else {}),
        }

    def slot_gpus(self, ranks: list[int]) -> list[tuple[int, str]]:
        """(GPU id, GPU UUID) that Ray gives each slot of `ranks` (one tiny task per slot; cuda pools only)."""
        import ray

        @ray.remote
        def assigned_gpu() -> tuple[int, str]:
            from megarl.rollout.weight_wire import device_uuid

            # Ray exposes only this slot's GPU to the task: local index 0 is it.
            return int(ray.get_gpu_ids()[0]), device_uuid(0)

        options = [self.actor_options(rank) for rank in ranks]
        return ray.get([assigned_gpu.options(**option).remote() for option in options])


def total_devices(pools: dict[str, ResourcePool]) -> int:
    """Every device the run holds: each pool once, however many roles share it."""
    return sum(pool.world_size for pool in set(pools.values()))


def plan_pools(recipe: Recipe) -> dict[str, ResourcePool]:
    """Map every active role to its pool; roles sharing a pool share the ResourcePool object."""
    made: dict[str, ResourcePool] = {}
    placement: dict[str, ResourcePool] = {}
    fused = reference_fused(recipe)
    for role in active_roles(recipe):
        pool = role_pool(recipe.placement, role)
        if pool.name not in made:
            made[pool.name] = ResourcePool(pool.name, pool.nodes, pool.gpus_per_node, recipe.placement.device)
        if not (role == "reference" and fused):  # a fused reference has no workers to share the slots with
            made[pool.name].roles.append(role)
        placement[role] = made[pool.name]
    return placement
