"""Does a recipe's placement fit the allocation a job asks for (`--nodes N --gpus-per-node G`)?

Every pool the active roles use is `nodes x gpus_per_node` devices, and the
controller reserves one node's share of a pool on one node (a STRICT_PACK
placement group). Colocated roles share one pool; disaggregated pools occupy
distinct devices. So the job fits when the per-node shares of all pools in use
pack into N nodes of G devices each; otherwise Ray would wait forever for
bundles it can never grant, so submit refuses first and names the keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config import Recipe, active_roles, role_pool
from megarl.errors import InputError


@dataclass(frozen=True)
class PoolNeed:
    """A pool in use: the recipe section that sizes it (`prefix`.nodes, `prefix`.gpus_per_node), its roles."""

    prefix: str
    name: str
    nodes: int
    gpus_per_node: int
    roles: tuple[str, ...]

    @property
    def size(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return f"pool {self.name!r} = {self.nodes} x {self.gpus_per_node} for {', '.join(self.roles)}"


def pools_in_use(recipe: Recipe) -> list[PoolNeed]:
    """The pools the active roles run on, each once, in role order."""
    placement, by_pool = recipe.placement, {}
    for role in active_roles(recipe):
        pool = role_pool(placement, role)
        if pool is None:
            continue  # a recipe that loaded has a pool for every active role
        prefix = "placement" if placement.colocate else f"placement.pools.{pool.name}"
        need = by_pool.get(pool.name)
        roles = (*need.roles, role) if need else (role,)
        by_pool[pool.name] = PoolNeed(prefix, pool.name, pool.nodes, pool.gpus_per_node, roles)
    return list(by_pool.values())


def _packs(shares: list[int], free: list[int]) -> bool:
    """Whether every per-node share fits on some node (exact search; shares sorted largest first)."""
    if not shares:
        return True
    first, rest = shares[0], shares[1:]
    tried = set()
    for index, room in enumerate(free):
        if room >= first and room not in tried:
            tried.add(room)  # nodes with equal room are interchangeable
            free[index] -= first
            fits = _packs(rest, free)
            free[index] += first
            if fits:
                return True
    return False


def device_word(recipe: Recipe) -> str:
    return "GPU" if recipe.placement.device == "cuda" else "process slot"


def check_fit(recipe: Recipe, *, nodes: int, gpus_per_node: int) -> None:
    """InputError naming the recipe keys when the pools in use do not fit `nodes` x `gpus_per_node` devices."""
    needs, unit = pools_in_use(recipe), device_word(recipe)
    asked = f"--nodes {nodes} --gpus-per-node {gpus_per_node} = {nodes * gpus_per_node} {unit}s"
    problems = []
    for need in needs:
        if need.nodes > nodes:
            problems.append(
                f"{need.prefix}.nodes: {need.describe()} needs more nodes than the job asks for, {asked} "
                f"(got {need.nodes})"
            )
        if need.gpus_per_node > gpus_per_node:
            problems.append(
                f"{need.prefix}.gpus_per_node: {need.describe()} needs more {unit}s per node than the job asks for, "
                f"{asked} (got {need.gpus_per_node})"
            )
    if problems:
        raise InputError(problems)
    total = sum(need.size for need in needs)
    shares = sorted((need.gpus_per_node for need in needs for _ in range(need.nodes)), reverse=True)
    if total > nodes * gpus_per_node or not _packs(shares, [gpus_per_node] * nodes):
        pools = "; ".join(need.describe() for need in needs)
        raise InputError(
            f"placement.pools: the pools in use need {total} {unit}s ({pools}), which do not fit {asked}"
        )
